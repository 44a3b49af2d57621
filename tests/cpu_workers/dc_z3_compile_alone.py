"""Worker for tests/test_deepcompile_z3_compile_alone_fails_fast.py: under a DeepCompile schedule that profiles
(ZeRO-3's), one rank of two starts compiling a graph; the other does not (--alone) or does too (--together). On CPU
(gloo, DS_ACCELERATOR=cpu).

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_z3_compile_alone.py --alone   (tests/gpu/dist.py starts it)

ZeRO-3's first pass over a new graph profiles it node by node with collectives (add_z3_gather_release); here a pass
does what it does first, an all-reduce of one flag, and the graph is compiled through DeepCompile's backend
(make_backend("eager"), the function Dynamo calls). With dynamic padding Dynamo compiles on one rank only (#7611): that
rank's profiling collectives then pair with the other rank's next collective, here a gradient bucket's all-reduce, and
on NCCL both wait for ever. Each rank reports what it saw (rank<RANK>.json): whether its compile ran the pass, the error
it raised instead and how long it took, and the value of the bucket both ranks all-reduce at the end.
"""

import argparse
import datetime
import os
import sys
import time
import types

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import reduce_the_final_bucket, run_worker  # noqa: E402

WAIT_S = 5  # compile.compile_sync_timeout: how long the compiling rank waits for the other


def main(report):
    import torch

    class TupleOut(torch.nn.Module):

        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return (torch.relu(self.inner(x)), )

    ap = argparse.ArgumentParser()
    ap.add_argument("--alone", action="store_true", help="only rank 0 compiles (default: both ranks do)")
    args = ap.parse_args()
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.compile import backend
    from deepspeed.compile.config import CompileConfig
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    # The lowering rules of DeepCompile's op for Inductor: the "eager" backend lowers nothing, and the op is CUDA's.
    backend.register_custom_ops = lambda: None

    def profile_like_zero3(gm, *args, **kwargs):
        with unset_fake_temporarily():  # passes run inside AOT's tracing, as the profiler does
            flag = torch.ones(1)
            dist.all_reduce(flag)
            report["pass_reduced"] = flag.item()
        return None

    backend.init_schedule([(0, [profile_like_zero3])])
    backend.next_passes = [profile_like_zero3]
    # (A build without the option compiles as 0.19.8 does: the test then shows what that does.)
    wait = {"compile_sync_timeout": WAIT_S} if "compile_sync_timeout" in CompileConfig.model_fields else {}
    compile_fn = backend.make_backend("eager", CompileConfig(deepcompile=True, **wait))
    rank = report["rank"]
    if rank == 0 or not args.alone:
        gm = torch.fx.symbolic_trace(TupleOut(torch.nn.Linear(8, 8)))  # a Dynamo graph returns a tuple
        gm.meta["dynamo_compile_id"] = types.SimpleNamespace(frame_id=0)
        start = time.time()
        try:
            compile_fn(gm, [torch.randn(4, 8)])
            report["compiled"] = True
        except RuntimeError as e:
            report["compile_error"] = str(e)
        report["compile_s"] = round(time.time() - start, 1)
    reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_z3_compile_alone", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
