"""DeepCompile ZeRO-1 reduces a bucket with one division, one all-reduce and one multi-tensor add.

0.19.8's ZeRO-1 op (csrc/compile/z1.cpp) flushed a bucket with a division kernel, an all-reduce and an add kernel for
every gradient in it, each with its own views: host work that grows with the number of parameter tensors, at the end
of every backward (docs/bench.md: about 20 host ops a gradient in the profile of a 0.55B Llama). The gradients of a
flush lie one after another in the bucket, so the fork divides and all-reduces them as one tensor and adds the results
to the gradient buffers with one `_foreach_add_`.

workers/dc_reduce_ops.py trains stacks of 4 and 16 linear layers (8 and 32 parameter tensors) with eager and with
DeepCompile ZeRO-1, fp32, and profiles one more DeepCompile step. The aten ops DeepCompile's
reduction calls for the flush do not grow with the parameter count (each gradient's own copy into the bucket does),
and the losses and gradient norms stay those of eager ZeRO-1. At world size 2, where the host has two GPUs: at one rank
there is no bucket to flush (test_deepcompile_z1_alone_adds_gradients_in_place.py).
"""

import math
import os

import pytest

from dist import DistJob, skip_reason, wait_for_all

TIMEOUT_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "300"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_reduce_ops.py")
LAYERS = (4, 16)
# Aten ops a flush called once per gradient in 0.19.8: the division (div_ of a Scalar calls div_ of a Tensor, nested,
# not counted again) and the add into the gradient buffer.
PER_GRADIENT_IN_0198 = ("aten::div_", "aten::add_")
RTOL = 1e-4  # fp32; eager and DeepCompile differ only by Inductor's fused kernels


def run(nprocs, stage=1):
    """{layers: {rank: report}} of workers/dc_reduce_ops.py at ZeRO `stage`, one job per stack, side by side."""
    reason = skip_reason(nprocs)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    jobs = {n: DistJob(WORKER, ["--layers", n, "--stage", stage], nprocs=nprocs, timeout=TIMEOUT_S,
                       env={"TORCHINDUCTOR_COMPILE_THREADS": "1"}).start() for n in LAYERS}
    done = wait_for_all(jobs, lambda n: f"dc_z{stage}_bucket_reduction_ws{nprocs}_layers{n}")
    return {n: res.results for n, res in done.items()}


@pytest.mark.parametrize("nprocs", [2])
def test_flush_work_does_not_grow_with_the_parameter_count(nprocs):
    runs = run(nprocs)
    small, large = (runs[n][0]["deepcompile"] for n in LAYERS)
    print(f"\nops called by DeepCompile's reduction in one step, {small['params']} and {large['params']} parameter "
          f"tensors:\n  {small['ops_of_one_step']}\n  {large['ops_of_one_step']}")
    assert small["deepcompile_active"] and large["deepcompile_active"]
    # The profile sees the reduction: one reduce_grad per gradient and micro-batch.
    assert large["ops_of_one_step"]["dc::reduce_grad"] > small["ops_of_one_step"]["dc::reduce_grad"] > 0
    for op in PER_GRADIENT_IN_0198:
        assert large["ops_of_one_step"].get(op, 0) == small["ops_of_one_step"].get(op, 0), op
    for n in LAYERS:
        for rank, report in runs[n].items():
            eager, dc = report["eager"], report["deepcompile"]
            for got, want in zip(dc["grad_norms"] + dc["losses"], eager["grad_norms"] + eager["losses"]):
                assert math.isfinite(got) and abs(got - want) <= RTOL * abs(want), (n, rank, dc, eager)
            assert len(dc["grad_norms"]) == len(eager["grad_norms"]) > 0
