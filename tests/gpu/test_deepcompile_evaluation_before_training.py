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

from dist import DistJob, skip_reason

STAGES = (1, 2, 3)
MODES = ("eager", "deepcompile")
DEADLINE_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "400"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_evaluation_first.py")
# fp32 on both sides: Inductor's fused kernels and DeepCompile's bucketed reductions round differently, nothing more
# (tests/gpu/test_deepcompile_grad_accumulation.py).
RTOL = 1e-3


@pytest.fixture(scope="module")
def runs():
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    started = {(s, m): DistJob(WORKER, ["--stage", str(s), "--mode", m, "--deadline", str(DEADLINE_S)], nprocs=1,
                               timeout=DEADLINE_S + 60, env=env).start()
               for s in STAGES for m in MODES}
    done = {}
    for (stage, mode), job in started.items():
        done[stage, mode] = job.wait()
        done[stage, mode].save(f"dc_evaluation_first_z{stage}_{mode}")
    return done


@pytest.mark.parametrize("stage", STAGES)
def test_evaluating_before_the_first_step_gives_eager_zeros_losses(runs, stage):
    got = {}
    for mode in MODES:
        res = runs[stage, mode]
        assert res.ok, res.failure_message()
        got[mode] = res.results[0]["run"]
    dc, eager = got["deepcompile"], got["eager"]
    assert dc["reached"] == "done" and len(dc["eval_losses"]) == 2 and len(dc["losses"]) == 3, dc
    for key in ("eval_losses", "losses", "grad_norms"):
        for a, b in zip(dc[key], eager[key]):
            assert abs(a - b) <= RTOL * abs(b), (key, dc[key], eager[key])
