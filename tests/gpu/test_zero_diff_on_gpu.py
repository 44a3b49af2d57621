"""Eager ZeRO on GPUs, fork against upstream 0.19.8, bit for bit: tools/zero-diff over every cell of
tests/gpu/workers/zero_diff_cells.py, fp16 included, at world size 1 and, where the host has two GPUs, 2.

0.19.8 is built by the tool from the pinned sdist ($DS_FORK_SDIST or the fork's cache; `--site 0.19.8=pinned`). On
the GPU the stream-ordering patch is active in every ZeRO-1/2 cell.
"""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from dist import skip_reason  # noqa: E402

TOOL = os.path.join(REPO, "tools", "zero-diff")
sys.path.insert(0, os.path.join(HERE, "workers"))
from zero_diff_cells import control, unexpected  # noqa: E402


@pytest.fixture(scope="module")
def out(tmp_path_factory):
    """One output folder for the module, so that 0.19.8 is built once (tools/zero-diff --site 0.19.8=pinned)."""
    reason = skip_reason(1)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    return tmp_path_factory.mktemp("zero-diff")


def run_tool(out, *args):
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out), "--site", "0.19.8=pinned", *args],
                          capture_output=True, text=True, timeout=1200)
    print(proc.stdout)
    path = os.path.join(out, "zero-diff.json")
    assert proc.returncode in (0, 1) and os.path.exists(path), (
        f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    with open(path) as f:
        return proc, json.load(f)


def test_every_cell_equal_to_0_19_8_on_one_gpu(out):
    proc, report = run_tool(out, "--perturb", control(fp16=True))
    rows = {name: (result, where) for name, result, where in report["rows"]}
    assert any("fp16" in name for name in rows), "no fp16 cell ran"
    assert rows[control(fp16=True)][0] == "DIFFERS", "the control cell did not differ: the comparison sees nothing"
    bad = unexpected(report)
    bad.pop(control(fp16=True))
    assert not bad, proc.stdout


def test_every_cell_equal_to_0_19_8_on_two_gpus(out):
    reason = skip_reason(2)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    proc, report = run_tool(out, "--world-size", "2")
    bad = unexpected(report)
    assert not bad and proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
