"""tools/steady-state: a long run with a new padded length every step, each rank its own, and what it records.

On CPU (gloo, DS_ACCELERATOR=cpu) with the `tiny` model: eager ZeRO-3 at two ranks, and torch.compile at one (Inductor
on CPU), so that the lengths, the per-rank arrays, the compile record and the summary are checked against what the
ranks did; a rank that stalls must make every rank print its stacks and the run fail. On GPU hosts the same command
runs DeepCompile ZeRO-3 at 1.5B (docs/bench.md)."""

import json
import re
import os
import statistics
import subprocess
import sys

import pytest

import tool_module

HERE = os.path.dirname(os.path.abspath(__file__))
TOOL = os.path.join(os.path.dirname(HERE), "tools", "steady-state")
steady = tool_module.load("steady-state")


def log_of(out):
    return open(out + ".log").read()[-4000:] if os.path.exists(out + ".log") else "(no log)"


def cpu_env(**extra):
    """The tool on CPU, with none of a rendezvous this process may have inherited."""
    e = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", **extra)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        e.pop(name, None)
    return e


def run(tmp_path, *args, env=None, timeout=600):
    out = str(tmp_path / "steady.json")
    proc = subprocess.run([sys.executable, TOOL, "--model", "tiny", "--out", out, *args], capture_output=True,
                          text=True, env=cpu_env(**(env or {})), timeout=timeout)
    return proc, out


def test_lengths_are_padded_within_bounds_and_differ_between_ranks():
    a, b = (steady.lengths(r, 200, 100, 1000, 64) for r in (0, 1))
    assert all(100 <= n <= 1000 and (n % 64 == 0 or n == 1000) for n in a + b)
    assert a != b and len(set(a)) > 10
    assert steady.lengths(0, 200, 100, 1000, 64) == a  # a restarted run draws the same lengths


def test_the_summary_is_that_of_the_slowest_rank_after_the_warmup():
    ranks = [{"rank": 0, "length": [8, 16, 8, 24], "step_s": [5.0, 1.0, 1.0, 3.0], "allocated": [10, 20, 20, 30],
              "peak": [40, 40, 40, 50], "graphs": [1, 1, 2, 2]},
             {"rank": 1, "length": [16, 16, 8, 8], "step_s": [4.0, 2.0, 0.5, 1.0], "allocated": [10, 20, 20, 20],
              "peak": [40, 40, 40, 40], "graphs": [1, 2, 2, 2]}]
    s = steady.summarize(ranks, warmup=1)
    assert s["steps_that_compiled"] == [0, 1, 2] and s["steps_that_compiled_after_warmup"] == [1, 2]
    assert s["graphs"] == 2 and s["step_s_median"] == 2.0 and s["slowest_step"] == 3 and s["slowest_step_s"] == 3.0
    assert s["steps_where_ranks_differ"] == 2 and s["distinct_lengths"] == 3
    assert s["memory"][0]["growth_per_100_steps"] == pytest.approx(500.0) and s["memory"][1]["growth_per_100_steps"] == 0


def test_steps_training_a_length_new_to_a_rank_are_told_from_the_others():
    ranks = [{"rank": 0, "length": [8, 16, 8, 16, 24], "step_s": [9.0, 3.0, 1.0, 1.0, 4.0], "graphs": [1] * 5,
              "allocated": [], "peak": []},
             {"rank": 1, "length": [8, 8, 8, 8, 8], "step_s": [9.0, 3.0, 1.0, 1.0, 4.0], "graphs": [1] * 5,
              "allocated": [], "peak": []}]
    b = steady.summarize(ranks, warmup=1)["after_warmup_by_length"]
    assert b == {"new": {"steps": 2, "median": 3.5, "last": 4}, "seen": {"steps": 2, "median": 1.0, "last": 3}}


def test_the_bench_page_shows_what_the_tool_renders_of_its_record():
    page = os.path.join(os.path.dirname(HERE), "docs", "bench.md")
    with open(page) as f:
        m = re.search(r"<!-- steady-state: (\S+) -->\n```\n(.*?)```\n<!-- /steady-state -->", f.read(), re.S)
    assert m, "docs/bench.md has no steady-state markers"
    proc = subprocess.run([sys.executable, TOOL, "--render", os.path.join(os.path.dirname(HERE), m.group(1))],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert m.group(2) == proc.stdout, "docs/bench.md's steady-state block differs from the tool's: regenerate it"


@pytest.mark.parametrize("bad", [["--min-seq", "64", "--seq", "32"], ["--steps", "5", "--warmup", "5"],
                                 ["--pad-to", "0"]])
def test_bad_bounds_are_refused_before_anything_runs(tmp_path, bad):
    proc, out = run(tmp_path, *bad, timeout=60)
    assert proc.returncode == 2 and "need 0 < --min-seq" in proc.stderr, proc.stderr
    assert not os.path.exists(out)


def test_two_ranks_train_a_new_length_every_step(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    proc, out = run(tmp_path, "--subject", "ds-z3", "--gpus", "2", "--steps", "12", "--warmup", "2", "--seq", "32",
                    "--min-seq", "8", "--pad-to", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr + log_of(out)
    with open(out) as f:
        rec = json.load(f)
    assert [r["rank"] for r in rec["ranks"]] == [0, 1]
    for r in rec["ranks"]:
        assert r["length"] == steady.lengths(r["rank"], 12, 8, 32, 8)
        assert len(r["step_s"]) == len(r["graphs"]) == 12 and all(t > 0 for t in r["step_s"])
        assert r["allocated"] == [] and r["graphs"] == [0] * 12  # CPU: no device memory; eager: no graph
    s = rec["summary"]
    slowest = [max(r["step_s"][i] for r in rec["ranks"]) for i in range(12)]
    assert s["step_s_median"] == pytest.approx(statistics.median(slowest[2:]))
    assert s["steps_where_ranks_differ"] > 0 and s["steps_that_compiled"] == [] and "memory" not in s
    assert "step s after the warm-up" in proc.stdout


def test_compiles_are_counted_at_the_steps_that_made_them(tmp_path):
    pytest.importorskip("transformers")
    proc, out = run(tmp_path, "--subject", "compile", "--steps", "6", "--warmup", "1", "--seq", "24", "--min-seq", "8",
                    "--pad-to", "8", timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr + log_of(out)
    with open(out) as f:
        rec = json.load(f)
    graphs, length = rec["ranks"][0]["graphs"], rec["ranks"][0]["length"]
    assert graphs[0] >= 1 and rec["summary"]["steps_that_compiled"][0] == 0
    # A length not seen before may compile (Dynamo's first recompile makes the length dynamic); a repeated one not.
    for i in rec["summary"]["steps_that_compiled"][1:]:
        assert length[i] not in length[:i], (i, length, graphs)


def test_a_rank_that_stalls_fails_the_run_with_every_ranks_stacks(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    proc, out = run(tmp_path, "--subject", "ds-z3", "--gpus", "2", "--steps", "8", "--warmup", "2", "--seq", "16",
                    "--min-seq", "8", "--pad-to", "8", "--step-deadline-s", "10", env={"STEADY_STATE_STALL": "1:3"})
    assert proc.returncode != 0 and "the run failed" in proc.stderr and not os.path.exists(out)
    log = open(out + ".log").read()
    # faulthandler's dump of each rank: the one stalled in the tool, the other waiting in the next step's gathers.
    assert log.count("Timeout (0:00:10)!") == 2, log[-6000:]
    assert log.count("in worker") >= 2, log[-6000:]


def test_a_launcher_stopped_from_outside_leaves_every_ranks_stacks_and_no_rank_behind(tmp_path):
    """A shell's timeout stops the launcher, not the ranks, which run in a session of their own: they used to outlive
    it silently, holding the GPUs into the next command."""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    import signal
    import time
    out = str(tmp_path / "steady.json")
    e = cpu_env(STEADY_STATE_STALL="1:3")
    p = subprocess.Popen([sys.executable, TOOL, "--model", "tiny", "--out", out, "--subject", "ds-z3", "--gpus", "2",
                          "--steps", "8", "--warmup", "2", "--seq", "16", "--min-seq", "8", "--pad-to", "8",
                          "--step-deadline-s", "300"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=e)
    deadline = time.monotonic() + 400
    while "stalls at step 3" not in (open(out + ".log").read() if os.path.exists(out + ".log") else ""):
        assert p.poll() is None and time.monotonic() < deadline, log_of(out)
        time.sleep(0.5)
    p.send_signal(signal.SIGTERM)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode != 0 and "stopped by signal" in stderr, stderr
    log = open(out + ".log").read()
    # Both ranks' stacks (the stalled one, the one waiting in the step's collectives), printed at once: their
    # lines interleave, but faulthandler writes each thread's heading whole.
    assert log.count("Current thread 0x") >= 2, log[-6000:]
    left = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if out.encode() in f.read():
                    left.append(pid)
        except OSError:
            pass
    assert not left, f"processes of the run left behind: {left}"
