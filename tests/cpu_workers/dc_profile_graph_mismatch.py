"""Worker for tests/test_deepcompile_profiler_needs_one_graph.py: two ranks run DeepCompile's profilers over their
graphs, the same graph (default) or graphs that differ by one node (--differ), on CPU (gloo, DS_ACCELERATOR=cpu).

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_profile_graph_mismatch.py --differ   (tests/gpu/dist.py starts it)

The profilers (ProfilingInterpreter, MemoryProfilingInterpreter) pair collectives node by node. On 2xH200 both
DeepCompile ZeRO-3 cells of the zoo at 2 ranks stopped in their first compile, rank 0 inside the profiler, each rank
with inputs of its own length; graphs traced for other shapes can differ, and then a rank's per-node all-reduces pair
with another node's, or with nothing. Each rank reports (rank<RANK>.json) what each profiler did (returned, or the
error it raised) and the value of a bucket both ranks all-reduce at the end (a stray profiler collective would pair
with it: gloo aborts on the size mismatch).
"""

import argparse
import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import run_worker  # noqa: E402


class NoOpHandle:
    """DeepCompile's op handle (CUDA): the profilers only switch its profiling mode and clear its gathers."""

    def enable_profiling(self, enabled):
        pass

    def clear_all_gathered_params(self):
        pass


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--differ", action="store_true", help="rank 1's graph has one node more")
    args = ap.parse_args()
    import torch
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.compile.profilers import graph_profile

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    graph_profile.get_deepcompile_handle = NoOpHandle

    class Net(torch.nn.Module):

        def __init__(self, extra):
            super().__init__()
            self.lin, self.extra = torch.nn.Linear(8, 8), extra

        def forward(self, x):
            y = torch.relu(self.lin(x))
            return (y * 2 if self.extra else y, )

    rank = report["rank"]
    x = torch.randn(4, 8)
    for name in ("ProfilingInterpreter", "MemoryProfilingInterpreter"):
        gm = torch.fx.symbolic_trace(Net(extra=args.differ and rank == 1))
        try:
            getattr(graph_profile, name)(gm).run(x)
            report[name] = "returned"
        except RuntimeError as e:
            report[name] = f"{type(e).__name__}: {e}"
    bucket = torch.full((1024, ), float(rank + 1))
    dist.all_reduce(bucket)
    report["reduced"] = bucket[0].item()


if __name__ == "__main__":
    run_worker("dc_profile_graph_mismatch", main)
