"""ZeRO's inf/NaN check of the gradients before a step, on CUDA tensors (patch zero12-overflow-check-in-one-multi-
tensor-pass): one multi-tensor pass per dtype, bfloat16 included, for which CUDA's torch has no GradScaler kernel.

The first version of the patch met that NotImplementedError at the first bf16 gradient and went back to one
has_inf_or_nan per tensor for the whole device: a profile of DeepCompile ZeRO-1 on a 0.5B bf16 Llama (H100) showed
438 of them per step, as in 0.19.8. The CPU suite imitates CUDA's refusal (test_zero_step_per_tensor_work.py); this
runs the real kernels.
"""

import math
import os
import sys

import pytest

torch = pytest.importorskip("torch")

if not torch.cuda.is_available():
    pytest.skip("CUDA is not available", allow_module_level=True)

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "cpu_workers"))
from zero_step_checks import CountOps  # noqa: E402  the CPU suite's counter of dispatched aten ops


def _grads(n, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(97 * (i % 5 + 1), generator=g, device="cuda").to(dtype) for i in range(n)]


def _found(tensors):
    from deepspeed.runtime.utils import accumulate_inf_or_nan_
    flag = torch.zeros(1, device="cuda")
    with CountOps() as ops:
        accumulate_inf_or_nan_(tensors, flag)
    return flag.item(), ops.count


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_the_check_makes_as_many_ops_for_200_gradients_as_for_10(dtype):
    pytest.importorskip("deepspeed")
    _found(_grads(1, dtype, 0))  # the first call learns whether the dtype has the GradScaler kernel
    (clean_few, few), (clean_many, many) = _found(_grads(10, dtype, 1)), _found(_grads(200, dtype, 2))
    print(f"\n{dtype}: {few} ops for 10 gradients, {many} for 200")
    assert clean_few == clean_many == 0.0
    assert few == many, f"{dtype}: the check makes ops per tensor ({few} for 10, {many} for 200)"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan], ids=["inf", "-inf", "nan"])
def test_the_check_finds_a_non_finite_value_in_any_gradient(dtype, bad):
    pytest.importorskip("deepspeed")
    for where in (0, 57, 199):
        grads = _grads(200, dtype, where)
        before = [t.clone() for t in grads]
        grads[where].view(-1)[-1] = bad
        assert _found(grads)[0] == 1.0, (dtype, bad, where)
        assert all(torch.equal(a.view(-1)[:-1], b.view(-1)[:-1]) for a, b in zip(grads, before))
    mixed = _grads(50, dtype, 3) + _grads(50, torch.float32, 4)
    mixed[-1].view(-1)[0] = bad
    assert _found(mixed)[0] == 1.0
