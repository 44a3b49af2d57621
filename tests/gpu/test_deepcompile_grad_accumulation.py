"""DeepCompile must accumulate every micro-batch's gradient when the micro-batches of one accumulation window run
different compiled graphs.

A collator that pads to the longest sequence of its batch gives every micro-batch a new length; Dynamo compiles a
static graph for the first length and a dynamic one at the second, so the first window's two micro-batches run two
graphs. DeepCompile kept the accumulation state in each graph's executor: at ZeRO-1 the first micro-batch's gradient
stayed in the static graph's executor and was never reduced; at ZeRO-3 the second graph did not know the buffer
already held the first one's gradient and overwrote it. The first optimizer step then used half the window.

The zoo's Llama (fp32, AdamW) is trained eagerly and under DeepCompile, one process each, all side by side on one
GPU (workers/dc_grad_accumulation.py); the global gradient norm of every step and every loss must match eager ZeRO
of the same stage. The same-length variant is the control (one graph for every micro-batch); past_warmup crosses
DeepCompile ZeRO-3's recompile at its WARMUP step.
"""

import math
import os

import pytest

from dist import DistJob, skip_reason

STAGES = (1, 2, 3)
VARIANTS = ("new_length_each_micro_batch", "same_length", "past_warmup")
MODES = ("eager", "deepcompile")
TIMEOUT_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "480"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_grad_accumulation.py")
# fp32 on both sides: Inductor's fused kernels and DeepCompile's bucketed reductions round differently from eager
# code, nothing more. A micro-batch lost from a window of two moves the step's gradient norm by far more.
RTOL = 1e-3


@pytest.fixture(scope="module")
def runs():
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    started = {(s, v, m): DistJob(WORKER, ["--stage", s, "--variant", v, "--mode", m], nprocs=1, timeout=TIMEOUT_S,
                                  env=env).start()
               for s in STAGES for v in VARIANTS for m in MODES}
    done = {}

    def result(stage, variant, mode):
        key = (stage, variant, mode)
        if key not in done:
            done[key] = started[key].wait()
            done[key].save(f"dc_grad_accumulation_z{stage}_{variant}_{mode}")
        return done[key]

    yield result
    for key in started:
        result(*key)


def _run(res):
    assert res.ok, res.failure_message()
    return res.results[0]["run"]


def _rel(got, want):
    return [abs(a - b) / max(abs(b), 1e-12) if a is not None and b is not None else math.inf for a, b in zip(got, want)]


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("stage", STAGES)
def test_deepcompile_accumulates_every_micro_batch(runs, stage, variant):
    eager, dc = _run(runs(stage, variant, "eager")), _run(runs(stage, variant, "deepcompile"))
    print(f"\nZeRO-{stage} {variant}: grad norms eager {eager['grad_norms']}\n"
          f"{'':>{len(str(stage)) + len(variant) + 8}}deepcompile {dc['grad_norms']}\n"
          f"losses eager {[round(x, 4) for x in eager['losses']]}\n"
          f"       deepcompile {[round(x, 4) for x in dc['losses']]}")
    assert dc["deepcompile_active"] and not eager["deepcompile_active"]
    assert eager["lengths"] == dc["lengths"]
    assert len(dc["grad_norms"]) == len(eager["grad_norms"]) > 0
    assert all(n is not None and n > 0 for n in eager["grad_norms"]), eager["grad_norms"]
    norm_diff = _rel(dc["grad_norms"], eager["grad_norms"])
    assert max(norm_diff) <= RTOL, (f"global gradient norm per step: deepcompile {dc['grad_norms']}, eager "
                                    f"{eager['grad_norms']} (relative differences {norm_diff})")
    loss_diff = _rel(dc["losses"], eager["losses"])
    assert max(loss_diff) <= RTOL, (f"loss per micro-batch: deepcompile {dc['losses']}, eager {eager['losses']} "
                                    f"(relative differences {loss_diff})")
