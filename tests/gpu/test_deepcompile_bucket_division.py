"""DeepCompile ZeRO-2 and ZeRO-3 divide the gradients of a reduce bucket with one kernel (patch
deepcompile-divide-each-bucket-once).

Before reducing a bucket, DeepCompile divided each gradient in it by the world size: one div_ a gradient, a kernel and
its host work at every backward, as many as the model has parameter tensors (219 a step in the profile of a 2-GPU
DeepCompile ZeRO-3 step of a 0.55B Llama, docs/bench.md, a step the host bounds). The gradients of a flush lie
one after another in the bucket, so the fork divides them as one tensor, as it already did at ZeRO-1
(test_deepcompile_z1_bucket_reduction.py, whose worker and runner this test shares).

workers/dc_reduce_ops.py trains stacks of 4 and 16 linear layers (8 and 32 parameter tensors) eagerly and with
DeepCompile, fp32, and profiles one more DeepCompile step: the divisions DeepCompile's reduction calls must not grow
with the parameter count, and every loss and gradient norm must stay eager ZeRO's of the same stage.
"""

import math

import pytest

from test_deepcompile_z1_bucket_reduction import LAYERS, RTOL, run


# ZeRO-2 at one rank fills no bucket (test_deepcompile_z2_alone_adds_gradients_in_place.py)
@pytest.mark.parametrize("stage, nprocs", [(2, 2), (3, 1), (3, 2)])
def test_the_division_of_a_flush_does_not_grow_with_the_parameter_count(stage, nprocs):
    runs = run(nprocs, stage)
    small, large = (runs[n][0]["deepcompile"] for n in LAYERS)
    print(f"\nZeRO-{stage}: ops called by DeepCompile's reduction in one step, {small['params']} and "
          f"{large['params']} parameter tensors:\n  {small['ops_of_one_step']}\n  {large['ops_of_one_step']}")
    assert small["deepcompile_active"] and large["deepcompile_active"]
    assert large["ops_of_one_step"]["dc::reduce_grad"] > small["ops_of_one_step"]["dc::reduce_grad"] > 0
    # div_ of a Scalar calls div_ of a Tensor, nested: not counted again
    assert large["ops_of_one_step"].get("aten::div_", 0) == small["ops_of_one_step"].get("aten::div_", 0)
    for n in LAYERS:
        for rank, report in runs[n].items():
            eager, dc = report["eager"], report["deepcompile"]
            assert len(dc["grad_norms"]) == len(eager["grad_norms"]) > 0
            for got, want in zip(dc["grad_norms"] + dc["losses"], eager["grad_norms"] + eager["losses"]):
                assert math.isfinite(got) and abs(got - want) <= RTOL * abs(want), (n, rank, dc, eager)
