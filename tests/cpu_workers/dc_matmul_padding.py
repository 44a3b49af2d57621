"""Worker for tests/test_deepcompile_z3_matmul_padding.py: a rank compiles a linear layer with 7 output features (not
a multiple of Inductor's alignment for fp32, 4) through DeepCompile's backend, make_backend("inductor"), under a
schedule that profiles as ZeRO-3's does, and reports the forward graphs DeepCompile's passes were given. On CPU (gloo,
DS_ACCELERATOR=cpu); without torchrun it runs alone, at world size 1.

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_matmul_padding.py

Inductor pads such a matmul where a benchmark, timed at compile time on the rank's own GPU, finds the padded one
faster (torch._inductor.fx_passes.pad_mm). It pads CUDA and XPU matmuls only, so here the worker stands in for a GPU
where pad_mm asks: the device check passes, Triton counts as available, and the benchmark answers for the rank: rank 0
finds padding faster and rank 1 does not, as two ranks timing it apart can. Alone, the benchmark finds padding faster.
The pass stands in for ZeRO-3's profiling pass: it records the graph's operations, and the ranks compare them.
"""

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import answer_inductors_padding_benchmark, reduce_the_final_bucket, run_worker  # noqa: E402


def main(report):
    import torch
    import torch._inductor.fx_passes.pad_mm as pad_mm
    import deepspeed
    from deepspeed.compile import backend
    from deepspeed.compile.config import CompileConfig

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))  # alone: a world of 1
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    backend.register_custom_ops = lambda: None  # DeepCompile's op and its lowering are CUDA's
    pad_mm.check_device = lambda a, b: True
    pad_mm.has_triton = lambda: True
    report["benchmarked"] = answer_inductors_padding_benchmark(report["rank"] == 0)

    graphs = report["graphs"] = []

    def profile_like_zero3(gm, *args, **kwargs):
        graphs.append([str(n.target) for n in gm.graph.nodes if n.op == "call_function"])
        return None

    # A schedule with entries left: this cycle's graphs run as AOT traced them, without Inductor's code generation.
    backend.init_schedule([(0, [profile_like_zero3])])
    backend.next_passes = [profile_like_zero3]
    compile_fn = backend.make_backend("inductor", CompileConfig(deepcompile=True))

    torch.manual_seed(0)
    layer = torch.nn.Linear(16, 7)
    x = torch.randn(8, 16)
    want = layer(x)
    got = torch.compile(layer, backend=compile_fn)(x)
    report["output_matches"] = torch.allclose(got, want, rtol=1e-5, atol=1e-6)
    if not report["standalone"]:
        reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_matmul_padding", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
