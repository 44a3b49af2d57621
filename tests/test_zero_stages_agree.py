"""Eager ZeRO-0, -1, -2 and -3 train one configuration alike at 2 ranks: the loss of every micro-batch and the global
gradient norm of every step agree across stages up to rounding.

Users compare stages by their logged gradient norm; reports of a ZeRO-2 norm unlike ZeRO-1's and ZeRO-3's on the same
run are upstream #7718 (a third of the others after 0.17.6) and #4298. The cells (zero_diff_cells.stage_cells: HF's
documented options, overlap_comm on, gradient accumulation 2, clipping 1.0, 4 steps) run through the differential
suite's worker on 2 CPU processes (gloo), with the fork installed here, and are compared with ZeRO-1's.

Tolerances are several times the largest difference measured on this machine (torch 2.11): in fp32, 1.2e-7 (gradients
reduced in another order; ZeRO-3's norm differs from ZeRO-1/2's in the 8th digit); in bf16, 2.6e-4 for ZeRO-2 and
ZeRO-3, 2.5e-7 for ZeRO-0, over all steps. Before patch zero0-mixed-precision-wrapper-does-not-step-at-construction
ZeRO-0's bf16 losses moved up to 7.5e-3 away from ZeRO-1's after its first update (its wrapper had stepped Adam once
with zero gradients when built; 0.19.8 alike), and this test compared ZeRO-0 over the first step only.
In fp32 ZeRO-0 reports no norm (the engine clips without keeping it).
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu", "workers"))
from dist import DistJob  # noqa: E402
import zero_diff_cells  # noqa: E402

WORKER = os.path.join(REPO, "tests", "gpu", "workers", "zero_diff.py")
RTOL = {"fp32": 1e-6, "bf16": 1e-3}


def values(rec):
    """(losses, gradient norms) of a cell's record, as floats; norms None where the engine kept none."""
    losses = [float.fromhex(x) for x in rec["losses"]]
    norms = [None if s["grad_norm"] is None else float.fromhex(s["grad_norm"]) for s in rec["steps"]]
    return losses, norms


@pytest.fixture(scope="module")
def reports():
    names = [n for p in RTOL for n in zero_diff_cells.stage_cells(p)]
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    res = DistJob(WORKER, ["--cells", *names], nprocs=2, timeout=600, env=env).start().wait()
    assert res.ok, res.failure_message()
    return res.results


@pytest.mark.parametrize("precision", list(RTOL))
def test_every_stage_trains_as_zero1_does(reports, precision):
    cells = zero_diff_cells.stage_cells(precision)
    assert [c["stage"] for c in cells.values()] == [0, 1, 2, 3]
    reference = next(name for name, c in cells.items() if c["stage"] == 1)
    rtol = RTOL[precision]
    for rank, report in reports.items():
        errors = {name: report["cells"][name]["error"] for name in cells if "error" in report["cells"][name]}
        assert not errors, errors
        for name, cell in cells.items():
            got, want = values(report["cells"][name]), values(report["cells"][reference])
            assert len(want[1]) == 4 and all(n and n > 0 for n in want[1]), want
            for a, b in zip(got[0] + got[1], want[0] + want[1]):
                if a is None:
                    assert cell["stage"] == 0 and precision == "fp32", (rank, name, got)
                    continue
                assert abs(a - b) <= rtol * abs(b), (rank, name, got, want)
