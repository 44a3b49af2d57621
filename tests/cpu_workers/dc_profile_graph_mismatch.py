"""Worker for tests/test_deepcompile_profiler_needs_one_graph.py and
tests/test_deepcompile_z3_profiler_gathers_alike.py: two ranks run DeepCompile's profilers over their graphs, the
same graph (default) or graphs that differ by one node (--differ), or the same graph over a ZeRO-3 parameter that is
partitioned on rank 0 and gathered on rank 1 (--split-param), on CPU (gloo, DS_ACCELERATOR=cpu). The graphs come from
torch.fx.symbolic_trace, which records no input sizes, or with --traced from make_fx, which records them as AOT's
graphs do; --rows gives rank 0's and rank 1's input rows (4 and 4).

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_profile_graph_mismatch.py --differ   (tests/gpu/dist.py starts it)

The profilers (ProfilingInterpreter, MemoryProfilingInterpreter) pair collectives node by node. On 2xH200 both
DeepCompile ZeRO-3 cells of the zoo at 2 ranks stopped in their first compile, rank 0 inside the profiler, each rank
with inputs of its own length; graphs traced for other shapes can differ, and then a rank's per-node all-reduces pair
with another node's, or with nothing. The profilers run as a compile runs them: real inputs, under the fake-tensor mode
that AOT autograd's compile has active (run_profiler). Each rank reports (rank<RANK>.json) what each profiler did
(returned, or the error it raised) and the value of a bucket both ranks all-reduce at the end (a stray profiler
collective would pair with it: gloo aborts on the size mismatch).
"""

import argparse
import contextlib
import datetime
import io
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import reduce_the_final_bucket, run_worker  # noqa: E402


class FakeZeroParam:
    """What the profiler reads of a ZeRO-3 parameter: its id and status, and all_gather/partition, whose
    all-gather is a collective (here an all-reduce of the parameter's size, counted)."""

    def __init__(self, weight, gathered):
        from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
        self.weight, self.status, self.gathers = weight, ZeroParamStatus, 0
        weight.ds_id, weight.ds_persist = 7, False
        weight.ds_status = ZeroParamStatus.AVAILABLE if gathered else ZeroParamStatus.NOT_AVAILABLE
        weight.all_gather, weight.partition = self.all_gather, self.partition

    def all_gather(self, param_list):
        import deepspeed.comm as dist
        self.gathers += 1
        dist.all_reduce(self.weight.detach().clone().reshape(-1))
        self.weight.ds_status = self.status.AVAILABLE

    def partition(self, param_list, has_been_updated=False):
        self.weight.ds_status = self.status.NOT_AVAILABLE


class WallClockEvent:
    """A timing event for the CPU accelerator, which has none (its Event() is None)."""

    def __init__(self, enable_timing=True):
        self.t = None

    def record(self):
        import time
        self.t = time.perf_counter()

    def elapsed_time(self, end):
        return (end.t - self.t) * 1000.0


def profile_on_cpu(accelerator):
    """What the profilers need of an accelerator and the CPU's lacks: timing events, and an RNG fork for a device
    (torch's fork_rng reaches for CUDA)."""
    import types
    type(accelerator).Event = property(lambda self: WallClockEvent)  # a property of the accelerator's class
    accelerator.random = lambda: types.SimpleNamespace(fork_rng=lambda devices: contextlib.nullcontext())


class NoOpHandle:
    """DeepCompile's op handle (CUDA): the profilers only switch its profiling mode and clear its gathers."""

    def enable_profiling(self, enabled):
        pass

    def clear_all_gathered_params(self):
        pass

    def invalidate_gathered_param(self, ds_id):
        pass


def run_profiler(profiler, *inputs):
    """Run a profiler as DeepCompile's passes do: inside a compile, where AOT autograd's FakeTensorMode is active and
    the profiler leaves it for each real computation (fork.16's graph check read its all-reduced tensor outside
    that, and every ZeRO-3 compile failed: 'Please convert all Tensors to FakeTensors first')."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        return profiler.run(*inputs)


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--differ", action="store_true", help="rank 1's graph has one node more")
    ap.add_argument("--split-param", action="store_true", help="a ZeRO-3 parameter gathered on rank 1 only")
    ap.add_argument("--traced", action="store_true", help="graphs that record their inputs' sizes (make_fx)")
    ap.add_argument("--rows", type=int, nargs=2, default=(4, 4), help="rows of rank 0's and of rank 1's input")
    args = ap.parse_args()
    import torch
    import deepspeed
    from deepspeed.compile.profilers import graph_profile
    from torch.fx.experimental.proxy_tensor import make_fx

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    profile_on_cpu(deepspeed.accelerator.get_accelerator())
    graph_profile.get_deepcompile_handle = NoOpHandle
    # Which nodes are DeepCompile's gathers, releases and reductions: none here (its op library is CUDA's, not loaded).
    graph_profile.is_release_node = graph_profile.is_comm_op = lambda node: False

    class Net(torch.nn.Module):

        def __init__(self, extra):
            super().__init__()
            self.lin, self.extra = torch.nn.Linear(8, 8), extra

        def forward(self, x):
            y = torch.relu(self.lin(x))
            return (y * 2 if self.extra else y, )

    rank = report["rank"]
    x = torch.randn(args.rows[rank], 8)
    if args.split_param:
        weight = torch.nn.Parameter(torch.randn(8, 8))
        param = FakeZeroParam(weight, gathered=rank == 1)
        gm = torch.fx.symbolic_trace(lambda x, w: (torch.relu(x @ w), ))
        said = io.StringIO()
        with contextlib.redirect_stdout(said):  # rank 0 prints why the profile stopped
            run_profiler(graph_profile.ProfilingInterpreter(gm), x, weight)
        report["profiler_said"] = said.getvalue()
        report["gathers"] = param.gathers
        report["profile_incomplete"] = graph_profile.is_profile_incomplete(gm.graph)
    for name in ("ProfilingInterpreter", "MemoryProfilingInterpreter"):
        if args.split_param:
            break
        net = Net(extra=args.differ and rank == 1)
        gm = make_fx(net)(x) if args.traced else torch.fx.symbolic_trace(net)
        try:
            run_profiler(getattr(graph_profile, name)(gm), x)
            report[name] = "returned"
        except RuntimeError as e:
            report[name] = f"{type(e).__name__}: {e}"
    reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_profile_graph_mismatch", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
