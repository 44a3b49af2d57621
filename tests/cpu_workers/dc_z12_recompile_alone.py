"""Worker for tests/test_deepcompile_z12_recompiles_alone.py: one rank of two recompiles a graph under DeepCompile
ZeRO-1/2 while the other goes on to the step's gradient reduction, on CPU (gloo, DS_ACCELERATOR=cpu).

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_z12_recompile_alone.py --stage 1   (tests/gpu/dist.py starts it)

With the HF Trainer's dynamic padding each rank's micro-batch has a length of its own, so Dynamo recompiles on one rank
and not on another (2xH200, the zoo's Trainer cell: rank 0 profiling a new forward graph, rank 1 in backward reducing
gradients, both waiting for ever; #7611). Here rank 0 runs DeepCompile's passes over a new graph (run_opt_passes with
the ZeRO-1 or ZeRO-2 schedule; the gradient rewrite itself, which needs real parameters, is replaced by the identity:
what is checked is what DeepCompile does around it) and rank 1 does not; then both all-reduce a gradient bucket, with
a 60 s timeout. Each rank reports the reduced bucket's value (rank<RANK>.json); a profiler collective on rank 0 would
pair with rank 1's all-reduce instead (gloo aborts the process on the size mismatch; NCCL waits for ever).
"""

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import reduce_the_final_bucket, run_worker  # noqa: E402


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", required=True, choices=["1", "2"])
    args = ap.parse_args()
    import torch
    import deepspeed
    from deepspeed.compile import backend
    from deepspeed.compile.passes import zero_1_and_2_compile as z12
    from deepspeed.compile.profilers import ProfilingResult

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    # The profiler puts its collectives' tensors on torch.device(current_device()); the CPU accelerator's is 0.
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    z12.add_z1_reduce_fw = lambda gm, *args, **kwargs: gm
    opt_pass = {"1": z12.add_z1_reduce, "2": z12.add_z2_reduce}[args.stage]
    backend.init_schedule([(0, [opt_pass])])
    if report["rank"] == 0:
        gm = torch.fx.symbolic_trace(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU()))
        x = torch.randn(4, 8)
        backend.run_opt_passes([opt_pass], gm, 7, [], {7: ProfilingResult()}, lambda: (x, ), 0.0, {}, bwd=False)
    reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_z12_recompile_alone", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
