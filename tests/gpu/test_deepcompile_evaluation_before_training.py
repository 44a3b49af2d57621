"""DeepCompile: evaluating before the first training step, as the Hugging Face Trainer does with eval_on_start, must
compile and give eager ZeRO's losses (patch deepcompile-passes-launch-on-calls-of-the-module).

The Trainer's evaluation calls the model itself, not the engine, and only the engine's forward launched DeepCompile's
pass schedule: the first compile found no passes and failed ("'NoneType' object is not iterable"), at every ZeRO
stage. The zoo's Llama (fp32) evaluates, trains, evaluates again at another length and trains on, eagerly and under
DeepCompile, one process each, side by side on one GPU (workers/dc_evaluation_first.py); each evaluation loss, each
training loss and each step's global gradient norm must be eager ZeRO's of the same stage.
"""

import os

import pytest

from against_eager import assert_as_eager, run_stages, runs

STAGES = (1, 2, 3)
DEADLINE_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "400"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_evaluation_first.py")
# fp32 on both sides: Inductor's fused kernels and DeepCompile's bucketed reductions round differently, nothing more
# (tests/gpu/test_deepcompile_grad_accumulation.py).
RTOL = 1e-3


@pytest.fixture(scope="module")
def done():
    return run_stages(WORKER, STAGES, DEADLINE_S, "dc_evaluation_first")


@pytest.mark.parametrize("stage", STAGES)
def test_evaluating_before_the_first_step_gives_eager_zeros_losses(done, stage):
    dc, eager = runs(done, stage)
    assert dc["reached"] == "done" and len(dc["eval_losses"]) == 2 and len(dc["losses"]) == 3, dc
    assert_as_eager(dc, eager, ("eval_losses", "losses", "grad_norms"), RTOL)
