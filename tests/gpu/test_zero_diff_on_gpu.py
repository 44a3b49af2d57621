"""Eager ZeRO on GPUs, fork against upstream 0.19.8, bit for bit (issue 18): tools/zero-diff over every cell of
tests/gpu/workers/zero_diff_cells.py, fp16 included, at world size 1 and, where the host has two GPUs, 2.

0.19.8 comes from $DS_UPSTREAM_SITE (a `pip install --target` of it) or is built from the pinned sdist
($DS_FORK_SDIST or the fork's cache). On the GPU the stream-ordering patch is active in every ZeRO-1/2 cell.
"""

import importlib.util
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
CONTROL = "z2-bf16-oc0-cg0-rs1-mr0-ga2-noclip-all-off-none-dense"


@pytest.fixture(scope="module")
def upstream_site(tmp_path_factory):
    reason = skip_reason(1)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    if os.environ.get("DS_UPSTREAM_SITE"):
        return os.environ["DS_UPSTREAM_SITE"]
    sys.path.insert(0, REPO)
    from forkbuild import pin, source
    sdist = source.obtain(pin.load(REPO), REPO)
    site = tmp_path_factory.mktemp("deepspeed-0.19.8")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
         str(site), sdist],
        capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return str(site)


def run_tool(out, *args):
    proc = subprocess.run([sys.executable, TOOL, "--out", str(out), *args], capture_output=True, text=True,
                          timeout=1200)
    print(proc.stdout)
    path = os.path.join(out, "zero-diff.json")
    assert os.path.exists(path), f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    with open(path) as f:
        return proc, json.load(f)


def test_every_cell_equal_to_0_19_8_on_one_gpu(upstream_site, tmp_path):
    proc, report = run_tool(tmp_path, "--site", f"0.19.8={upstream_site}", "--perturb", CONTROL)
    rows = {name: (result, where) for name, result, where in report["rows"]}
    assert any("fp16" in name for name in rows), "no fp16 cell ran"
    assert rows.pop(CONTROL)[0] == "DIFFERS", "the control cell did not differ: the comparison sees nothing"
    bad = {name: row for name, row in rows.items() if row[0] != "equal"}
    assert not bad, proc.stdout


def test_every_cell_equal_to_0_19_8_on_two_gpus(upstream_site, tmp_path):
    reason = skip_reason(2)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    proc, report = run_tool(tmp_path, "--site", f"0.19.8={upstream_site}", "--world-size", "2")
    bad = {name: (result, where) for name, result, where in report["rows"] if result != "equal"}
    assert not bad and proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
