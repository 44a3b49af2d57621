"""The zoo's knobs (tests/gpu/test_model_zoo.py): ZOO_CELLS picks the cells of a second run of a split one, ZOO_REPLAY
merges both runs' summaries for the checks, ZOO_RANKS runs every cell on several ranks. Checked on CPU, where the zoo
itself skips."""

import json
import os
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import test_model_zoo as zoo  # noqa: E402
from dist import DistResult  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu", "workers"))
import zoo_cell  # noqa: E402


def test_zoo_cells_runs_only_the_matching_cells(monkeypatch):
    monkeypatch.setenv("ZOO_CELLS", r"/1/compile$|^cell/llama_ckpt/3/deepcompile$")
    monkeypatch.delenv("ZOO_MODELS", raising=False)
    cells = zoo._cells()
    assert ("cell", "llama_ckpt", 3, "deepcompile") in cells
    assert {c[3] for c in cells} == {"compile", "deepcompile"} and len(cells) == len(zoo.ZOO) + 1, cells
    assert not any(c[0] == "trainer" for c in cells)


def test_zoo_cells_matching_nothing_is_an_error(monkeypatch):
    monkeypatch.setenv("ZOO_CELLS", "no-such-cell")
    with pytest.raises(AssertionError, match="matches no cell"):
        zoo._cells()


def test_replay_merges_runs_the_later_cell_winning(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"cells": {"cell/llama/3/deepcompile": {"ok": False}, "cell/llama/1/eager": {"ok": True}}}))
    second.write_text(json.dumps({"cells": {"cell/llama/3/deepcompile": {"ok": True}}}))
    cells = zoo._replayed(f"{first}:{second}")
    assert cells == {("cell", "llama", 3, "deepcompile"): {"ok": True}, ("cell", "llama", 1, "eager"): {"ok": True}}


@pytest.fixture
def two_ranks(monkeypatch):
    monkeypatch.setattr(zoo, "RANKS", 2)
    monkeypatch.setattr(zoo, "Z2_VARIANTS", ("2+oc", "2-cg", "2+oc-cg"))
    monkeypatch.delenv("ZOO_CELLS", raising=False)
    monkeypatch.delenv("ZOO_MODELS", raising=False)


def test_two_ranks_run_every_cell_on_both_and_zero2_with_its_reduction_options(two_ranks, tmp_path):
    cells = zoo._cells()
    for stage in ("2+oc", "2-cg", "2+oc-cg"):
        assert {("cell", "llama", stage, "deepcompile"), ("cell", "llama", stage, "eager")} <= set(cells), stage
        assert not any(c[2] == stage for c in cells if c[1] != "llama"), "variants are the Llama row's only"
    assert all(zoo._job(c, str(tmp_path)).nprocs == 2 for c in cells)


def test_a_resume_gets_its_own_deadline(two_ranks, tmp_path, monkeypatch):
    monkeypatch.setattr(zoo, "CELL_DEADLINE_S", 420.0)
    monkeypatch.setattr(zoo, "RESUME_DEADLINE_S", 150.0)
    cell, resume = (zoo._job((kind, "mixtral", 3, "deepcompile"), str(tmp_path)) for kind in ("cell", "resume"))
    assert resume.args[resume.args.index("--deadline") + 1] == "150.0" and resume.timeout == 210.0
    assert cell.args[cell.args.index("--deadline") + 1] == "420.0" and cell.timeout == 480.0


def _result(*reached):
    reports = {r: {"cells": {"2+oc": {"reached": x, "losses": [1.0]}}, "error": None} for r, x in enumerate(reached)}
    return DistResult(returncode=0, timed_out=False, duration_s=1.0, output="", results=reports)


def test_a_cell_is_done_only_when_every_rank_finished_its_loop(two_ranks):
    key = ("cell", "llama", "2+oc", "deepcompile")
    done = zoo._summaries(key, _result("done", "done"))[key]
    assert done["ok"] and len(zoo._ranks({key: done}, key)) == 2
    stuck = zoo._summaries(key, _result("done", "train micro-batch 3"))[key]
    assert not stuck["ok"] and stuck["reached"] == ["done", "train micro-batch 3"]


@pytest.mark.parametrize("name,parsed", [
    ("1", (1, {})), ("3", (3, {})), ("2+oc", (2, {"overlap_comm": True})),
    ("2-cg", (2, {"contiguous_gradients": False})),
    ("2+oc-cg", (2, {"overlap_comm": True, "contiguous_gradients": False})),
    ("4", None), ("3+oc", None), ("2+oc+oc", None), ("2x", None), ("", None)])
def test_stage_names_give_zero_options_or_a_clear_error(name, parsed):
    if parsed is None:
        with pytest.raises(ValueError, match="1, 2, 3, or 2 with"):
            zoo_cell.zero_stage(name)
    else:
        assert zoo_cell.zero_stage(name) == parsed
        cfg = zoo_cell.ds_config(name, "deepcompile")["zero_optimization"]
        assert cfg["stage"] == parsed[0] and all(cfg[k] == v for k, v in parsed[1].items())


@pytest.mark.parametrize("world", [2, 4, 8])
def test_each_rank_gets_micro_batches_of_its_own_length_and_padding(monkeypatch, world):
    """At 4 ranks (4xH100) every cell stopped at its after-phase with an IndexError: the lengths ran out
    at 2 ranks' count of micro-batches."""
    seen = {}
    count = sum(len(v) if isinstance(v, list) else 1 for v in zoo_cell.plan().values())
    for rank in range(world):
        monkeypatch.setattr(zoo_cell, "RANK", rank)
        monkeypatch.setattr(zoo_cell, "WORLD", world)
        batches = [zoo_cell.make_batch(i) for i in range(count)]
        seen[rank] = [(b["input_ids"].shape[1], int(b["attention_mask"].sum())) for b in batches]
    lengths = [n for r in seen.values() for n, _ in r]
    assert len(set(lengths)) == len(lengths), "a length appears twice across micro-batches and ranks"
    assert max(lengths) <= 256, "longer than the zoo models' positions (zoo_models.py)"
    for i in range(count):
        tokens = [seen[r][i][1] for r in range(world)]
        assert len(set(tokens)) == world, f"micro-batch {i}: ranks hold the same token counts {tokens}"
    monkeypatch.setattr(zoo_cell, "RANK", 0)
    monkeypatch.setattr(zoo_cell, "WORLD", 1)
    # One rank keeps the lengths of the recorded one-GPU runs.
    assert zoo_cell.make_batch(3)["input_ids"].shape[1] == zoo_cell.LENGTHS[3]
    old = [n for n in range(33, 64) if n % 8]
    assert zoo_cell.LENGTHS[:len(old)] == old


# The ranks of the workers below reach their deadlines at most 4 s apart and faulthandler writes 5 s after one: a
# rank outlives its deadline by 12 s (founding_common.DEADLINE_GRACE_S), not the zoo's 30, which the tests waited out
# (rank 1 holding the GIL burnt a core meanwhile).
GRACE = {"DIST_DEADLINE_GRACE_S": "12"}

BUSY_WORKER = """\
import os, re, sys, threading, time
sys.path.insert(0, {workers!r})
from founding_common import stacks_at_deadline

def read_the_environment(depth):
    if depth:
        return read_the_environment(depth - 1)
    while True:  # the thread faulthandler was printing when it crashed a rank (a zoo run on 4xH100)
        os.environ.get("PATH")
        time.sleep(0.001)

def wait_for_a_collective_that_never_comes():
    time.sleep(120)

def hold_the_gil():
    re.match(r"(a+)+$", "a" * 40 + "b")  # the regular expression engine never releases the GIL

stacks_at_deadline(2)
if os.environ["RANK"] == "0":
    for _ in range(4):
        threading.Thread(target=read_the_environment, args=(200,), daemon=True).start()
    wait_for_a_collective_that_never_comes()
else:
    hold_the_gil()
"""


def test_a_deadline_dump_shows_the_main_thread_first_beside_busy_threads(two_ranks, tmp_path):
    """A zoo run (4xH100): a rank died with SIGSEGV in the middle of faulthandler's dump, which reads other threads'
    frames while they run, and faulthandler prints the main thread last, so that a dump cut to STACKS_CHARS loses the
    one frame that matters ("rank 3 in ?"). The dump is now written under the GIL, the main thread's first: rank 0
    hangs beside four threads 200 frames deep. Rank 1 holds the GIL in C, where no Python thread can run, and
    faulthandler still writes its stacks, a few seconds late."""
    from dist import DistJob
    (tmp_path / "workers").mkdir()
    script = tmp_path / "workers" / "hung.py"
    script.write_text(BUSY_WORKER.format(workers=os.path.dirname(zoo_cell.__file__)))
    res = DistJob(str(script), nprocs=2, timeout=90, env=GRACE).start().wait()
    assert sorted(res.stacks) == [0, 1], (res.stacks, res.tail())
    key = ("cell", "llama", "2+oc", "deepcompile")
    summary = zoo._summaries(key, res)[key]
    assert "wait_for_a_collective_that_never_comes" in summary["stacks"]["0"], summary["stacks"]["0"][-1000:]
    assert "hold_the_gil" in summary["stacks"]["1"], summary["stacks"]["1"]
    path = tmp_path / "zoo.json"
    path.write_text(json.dumps({"deepspeed": "x", "wall_s": 1.0, "ranks": 2, "cells": {"/".join(key): summary}}))
    tool = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "zoo-table")
    out = subprocess.run([sys.executable, tool, str(path)], capture_output=True, text=True, timeout=60)
    line = BUSY_WORKER.splitlines().index("    time.sleep(120)") + 1
    assert f"rank 0 in hung.py:{line} wait_for_a_collective_that_never_comes" in out.stdout, out.stdout + out.stderr


HUNG_WORKER = """\
import os, sys, time
sys.path.insert(0, {workers!r})
from founding_common import stacks_at_deadline

def wait_for_a_collective_that_never_comes():
    time.sleep(120)

stacks_at_deadline(2 + 4 * int(os.environ["RANK"]))  # rank 1 started its cell later
wait_for_a_collective_that_never_comes()
"""


def test_a_hung_cell_keeps_every_ranks_stacks(two_ranks, tmp_path):
    """The first 2-rank zoo run hung in 10 DeepCompile cells, and the summary kept only the outermost frames of one
    rank (the tail of an interleaved stderr): every rank's dump, innermost frames first, must reach the summary. And
    a rank whose deadline passes first must not take the others down before they write theirs (2xH200, fork.15:
    rank 0 left at its deadline, torchrun stopped rank 1, and only rank 0's stacks were kept)."""
    from dist import DistJob
    script = tmp_path / "hung.py"
    script.write_text(HUNG_WORKER.format(workers=os.path.dirname(zoo_cell.__file__)))
    res = DistJob(str(script), nprocs=2, timeout=90, env=GRACE).start().wait()
    assert sorted(res.stacks) == [0, 1], (res.stacks, res.tail())
    key = ("cell", "llama", "2+oc", "deepcompile")
    summary = zoo._summaries(key, res)[key]
    assert not summary["ok"] and sorted(summary["stacks"]) == ["0", "1"]
    assert all("wait_for_a_collective_that_never_comes" in text for text in summary["stacks"].values()), summary
    # and every launcher's failure message shows them, for the tests that print only that
    message = res.failure_message()
    assert "rank 0's stacks" in message and "rank 1's stacks" in message, message[-2000:]


def test_zoo_cell_keeps_the_backward_compiles_aot_autograd_dropped():
    """The zoo fails a DeepCompile cell whose backward AOTAutograd compiled ahead of its run and dropped (it logs a
    warning and compiles again at the first backward). The cell keeps those from AOTAutograd's log, where
    torch._logging stops its records: here a backward compiler that fails under torch.compile with dynamic shapes."""
    script = f"""
import sys
sys.path.insert(0, {os.path.dirname(zoo_cell.__file__)!r})
import torch
from torch._dynamo.backends.common import aot_autograd
from zoo_cell import Counters

counters = Counters()
counters.capture_recompile_reasons([])  # resets torch._logging, as the cell does after counting starts


def failing(gm, inputs):
    raise RuntimeError("the backward compiler failed")


f = torch.compile(lambda x: (x.reshape(x.shape[0], -1) * x.shape[0]).sin().sum(), dynamic=True,
                  backend=aot_autograd(fw_compiler=lambda gm, inputs: gm.forward, bw_compiler=failing))
f(torch.randn(5, 3, requires_grad=True))
assert counters.dropped_backward_compiles == ["RuntimeError: the backward compiler failed"], \\
    counters.dropped_backward_compiles
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
