"""DeepCompile's backward must end without making the host wait for the device (patch
deepcompile-backward-ends-without-a-host-sync), and the step after it must read the reduced gradients all the same.

0.19.8 waits on the host for the reduction stream at the end of every compiled graph's backward, and fork.50 again
when the engine released the reduce buckets; fork.50's DeepCompile ZeRO-1/2 also copied to the device and read back,
at every boundary backward, which parameters had got an eager gradient. The device ran dry there, and the optimizer
step's host work ran while it was idle. The zoo's Llama (fp32, two micro-batches a step, gradient clipping) trains
ten steps at each ZeRO stage, eagerly and under DeepCompile, one process each, side by side on one GPU
(workers/dc_backward_host_syncs.py); the last three steps' backwards run under torch's CUDA sync debug mode. Under
DeepCompile they must make no host sync, and every loss and every step's global gradient norm must be eager ZeRO's of
the same stage: a step that read its gradients before their reductions had written them would differ. (At several
ranks, DeepCompile ZeRO-1/2 still reads back once a boundary backward which parameters any rank got an eager
gradient for.)
"""

import os

import pytest

from against_eager import assert_as_eager, run_stages, runs

STAGES = (1, 2, 3)
DEADLINE_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "400"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_backward_host_syncs.py")
# fp32 on both sides: Inductor's fused kernels and DeepCompile's bucketed reductions round differently, nothing more
# (tests/gpu/test_deepcompile_grad_accumulation.py).
RTOL = 1e-3


@pytest.fixture(scope="module")
def done():
    return run_stages(WORKER, STAGES, DEADLINE_S, "dc_backward_host_syncs")


@pytest.mark.parametrize("stage", STAGES)
def test_deepcompile_backward_makes_no_host_sync_and_steps_as_eager_zero(done, stage):
    dc, eager = runs(done, stage)
    assert dc["reached"] == "done" and len(dc["syncs"]) == 6, dc
    print(f"\nZeRO-{stage}: host syncs in each watched backward: DeepCompile {dc['syncs']}, eager {eager['syncs']}")
    stacks = "\n".join(dc["sync_stacks"][:3])
    assert dc["syncs"] == [0] * 6, f"host syncs in DeepCompile's backward {dc['syncs']}, from:\n{stacks}"
    assert_as_eager(dc, eager, ("losses", "grad_norms"), RTOL)
