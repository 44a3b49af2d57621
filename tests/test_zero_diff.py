"""The eager ZeRO differential suite (tools/zero-diff): its cells cover every pair of option levels, and on
CPU the fork trains every cell bit for bit as upstream 0.19.8 does, at 1 and 2 ranks.

On this CPU-only machine DeepSpeed's CPU accelerator runs (gloo, no streams, no fp16), so the stream-ordering patch
is not exercised here; the same cells with fp16 run on GPUs through tools/gpu-suite. 0.19.8 is built from the pinned
sdist (the one the fork's build verified) by the tool (`--site 0.19.8=pinned`).
"""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu", "workers"))
import zero_diff_cells  # noqa: E402

TOOL = os.path.join(REPO, "tools", "zero-diff")


@pytest.mark.parametrize("fp16", [True, False], ids=["gpu", "cpu"])
def test_cells_cover_every_pair_of_levels(fp16):
    cells = zero_diff_cells.covering_cells(fp16)
    assert len({zero_diff_cells.name(c) for c in cells}) == len(cells), "two cells share a name"
    for cell in cells:
        assert zero_diff_cells.normalize(cell) == cell, f"cell not in normal form: {cell}"
        assert fp16 or cell["precision"] != "fp16"
    covered = set().union(*(zero_diff_cells.pairs(c) for c in cells))
    required = set().union(*(zero_diff_cells.pairs(c) for c in zero_diff_cells.valid_configurations(fp16)))
    missing = required - covered
    assert not missing, f"{len(missing)} pairs of levels in no cell, e.g. {sorted(missing, key=str)[:3]}"
    # Every level of every factor that can be set is set somewhere (fp16 only where the accelerator has it).
    for factor, levels in zero_diff_cells.FACTORS.items():
        seen = {c[factor] for c in cells}
        assert seen == set(levels) - ({"fp16"} if not fp16 else set()), (factor, seen)
    assert len(cells) < 30, "the design grew: it must stay within one 10-minute GPU command"


def test_normal_form_drops_what_deepspeed_ignores():
    base = dict(zip(zero_diff_cells.NAMES, (levels[-1] for levels in zero_diff_cells.FACTORS.values())))
    z0 = zero_diff_cells.normalize(dict(base, stage=0, precision="bf16", model="dense"))
    assert (z0["overlap_comm"], z0["contiguous_gradients"], z0["offload"]) == (False, True, "none")
    assert zero_diff_cells.normalize(dict(base, stage=3, model="moe")) is None
    assert zero_diff_cells.normalize(dict(base, stage=2, model="moe", reduce_scatter=False)) is None
    z3 = zero_diff_cells.normalize(dict(base, stage=3, model="dense"))
    assert z3["reduce_scatter"] is True and z3["multi_rank_bucket_allreduce"] is True


@pytest.fixture(scope="module")
def out(tmp_path_factory, pinned_upstream_site):
    """One output folder for the module, where tools/zero-diff --site 0.19.8=pinned finds 0.19.8 built already: the
    test environment's one build of it (conftest's pinned_upstream_site, which other modules share), reused."""
    folder = tmp_path_factory.mktemp("zero-diff")
    os.symlink(pinned_upstream_site, folder / "site-0.19.8")
    return folder


def run_tool(out, *args):
    # JIT-built ops where the rest of the suite has them: the tool gives 0.19.8's site a build folder of its own
    # (pinned_upstream.site_env, by the site's real path: the one the conftest's build already filled).
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT", "PYTHONPATH"):
        env.pop(name, None)
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out), "--site", "0.19.8=pinned", *args],
                          capture_output=True,
                          text=True,
                          env=env,
                          timeout=1500)
    path = os.path.join(out, "zero-diff.json")
    assert proc.returncode in (0, 1) and os.path.exists(path), (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(path) as f:
        return proc, json.load(f)


CONTROL = zero_diff_cells.control(fp16=False)


def test_the_fork_trains_every_cell_as_0_19_8_at_one_rank(out):
    """Every CPU cell equal to the bit, except the control, whose learning rate the fork's side raised by 0.1 %: it
    must differ, or the comparison could not see a difference; and the cells a fork patch changes on purpose
    (zero_diff_cells.BY_DESIGN), equal through their first step and different after it."""
    proc, report = run_tool(out, "--perturb", CONTROL)
    versions = [ranks[0]["deepspeed_version"] for ranks in report["reports"]]
    assert versions[0] == "0.19.8" and "+fork." in versions[1], versions
    rows = {name: (result, where) for name, result, where in report["rows"]}
    assert CONTROL in rows and len(rows) == len(zero_diff_cells.cells(fp16=False))
    assert rows[CONTROL][0] == "DIFFERS", proc.stdout
    assert proc.returncode == 1
    bad = zero_diff_cells.unexpected(report)
    bad.pop(CONTROL)
    assert not bad, proc.stdout
    assert any(result == "by design" for _, result, _ in report["rows"]), "no cell a fork patch changes ran"


def test_the_fork_trains_every_cell_as_0_19_8_at_two_ranks(out):
    proc, report = run_tool(out, "--world-size", "2")
    bad = zero_diff_cells.unexpected(report)
    assert not bad and proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    assert all(len(ranks) == 2 for ranks in report["reports"])


@pytest.mark.parametrize("fp16", [False, True])
def test_control_cell_is_a_cell_of_the_host_design(fp16):
    """The first GPU run perturbed a control chosen from the CPU design, which the fp16 design does not hold: nothing
    was perturbed. Each design names its own control, a bf16 ZeRO-2 cell with accumulation."""
    name = zero_diff_cells.control(fp16)
    cell = zero_diff_cells.cells(fp16)[name]
    assert (cell["stage"], cell["precision"], cell["grad_accum"]) == (2, "bf16", 2)


def test_perturbing_a_cell_the_run_does_not_hold_is_refused(tmp_path):
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    proc = subprocess.run([sys.executable, TOOL, "--out", str(tmp_path), "--site", "a=/nonexistent", "--perturb",
                           "z9-nothing"], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "--perturb z9-nothing: not a cell of this run" in proc.stderr
    assert not os.listdir(tmp_path), "the refused run wrote output"
