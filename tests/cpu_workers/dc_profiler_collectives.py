"""Worker for tests/test_deepcompile_profiling_collectives_per_graph.py: two gloo ranks on CPU run DeepCompile's
profilers (ProfilingInterpreter, MemoryProfilingInterpreter) over a chain of --layers linear layers, counting the
all-reduces each profiler takes and reporting every node's profile metadata; with --fail-on-rank1, rank 1's profiling
fails at a node (a scripted out-of-memory) ahead of a node that reads a ZeRO-3 parameter, which the profiler gathers
with a collective.

With --cache-root DIR each rank keeps Inductor's cache (where the profilers keep their profiles) in DIR/rank<RANK>,
as a job restarted on the same host finds it; --forget-on-rank1 empties rank 1's first. Without it the caches are
fresh temporary folders. Each profiler reports how many nodes it ran. Last, the prefetch pass's all-gather times
(comm_profile.create_predictor) are read, their measurement replaced by a count of the calls and times that differ
from process to process (the ranks' mean, as the real measurement's); --alter-times-on-rank1 changes rank 1's kept
copy first.

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_profiler_collectives.py --layers 8   (tests/gpu/dist.py starts it)
"""

import argparse
import datetime
import os
import shutil
import sys
import tempfile
import types

import torch
import torch.fx

from dc_profile_graph_mismatch import FakeZeroParam, NoOpHandle, profile_on_cpu, run_profiler
from founding_common import reduce_the_final_bucket, run_worker

META = ("device_time", "wall_time", "alloc_mem", "max_mem", "tensor_size", "profile_mem_start", "profile_mem_peak")


def fails_on_rank1(t):
    """A node whose profiling runs out of memory on rank 1 only."""
    if int(os.environ["RANK"]) == 1:
        raise RuntimeError("CUDA out of memory (scripted)")
    return t


torch.fx.wrap("fails_on_rank1")


class Chain(torch.nn.Module):

    def __init__(self, layers):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return (x, )


def failing_before_a_gather(x, w):
    return (torch.relu(fails_on_rank1(x * 2)) @ w, )


def with_local_dc_ops(gm):
    """Each layer's output waited for (wait_allgather) and, after its use, released (release_param), as DeepCompile's
    ZeRO-3 pass follows a gathered parameter."""
    graph = gm.graph
    for i, relu in enumerate([n for n in graph.nodes if n.target is torch.relu]):
        with graph.inserting_after(relu):
            waited = graph.call_function(torch.ops.dc.wait_allgather.default, (relu, 0, i))
        relu.replace_all_uses_with(waited, delete_user_cb=lambda user: user is not waited)
        user = next(iter(waited.users))
        with graph.inserting_before(user) if user.op == "output" else graph.inserting_after(user):
            graph.call_function(torch.ops.dc.release_param.default, (waited, 0, i, 1))
    gm.recompile()


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dc-local-ops", action="store_true", help="each layer's output waited for and released by "
                    "DeepCompile's ops, which take part in no collective while profiled")
    ap.add_argument("--fail-on-rank1", action="store_true")
    ap.add_argument("--cache-root")
    ap.add_argument("--forget-on-rank1", action="store_true")
    ap.add_argument("--alter-times-on-rank1", action="store_true")
    args = ap.parse_args()
    rank = int(os.environ["RANK"])
    cache = os.path.join(args.cache_root, f"rank{rank}") if args.cache_root else tempfile.mkdtemp()
    if args.forget_on_rank1 and rank == 1:
        shutil.rmtree(cache, ignore_errors=True)
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache
    import deepspeed
    import deepspeed.comm as dist
    from deepspeed.compile.profilers import graph_profile

    deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    profile_on_cpu(deepspeed.accelerator.get_accelerator())
    graph_profile.get_deepcompile_handle = NoOpHandle
    graph_profile.is_release_node = graph_profile.is_comm_op = lambda node: False
    # The profilers compare targets with DeepCompile's ops, whose library (CUDA) is not loaded here: their schemas.
    dc = torch.library.Library("dc", "FRAGMENT")
    dc.define("allgather_param(Tensor a, int graph_id, int id, ScalarType? dtype=None) -> Tensor")
    dc.define("release_param(Tensor a, int graph_id, int id, int n_users) -> Tensor")
    dc.define("wait_allgather(Tensor a, int graph_id, int id) -> Tensor")
    dc.impl("release_param", lambda a, graph_id, id, n_users: a.clone(), "CPU")
    dc.impl("wait_allgather", lambda a, graph_id, id: a.clone(), "CPU")

    all_reduce, counted = dist.all_reduce, []

    def counting_all_reduce(*a, **k):
        counted.append(1)
        return all_reduce(*a, **k)

    dist.all_reduce = counting_all_reduce
    ran = []
    for cls in (graph_profile.ProfilingInterpreter, graph_profile.MemoryProfilingInterpreter):

        def counting_run_node(self, n, run_node=cls.run_node):
            ran.append(n.name)
            return run_node(self, n)

        cls.run_node = counting_run_node
    torch.manual_seed(0)
    x = torch.randn(4, 8)
    for name in ("ProfilingInterpreter", "MemoryProfilingInterpreter"):
        if args.fail_on_rank1:
            weight = torch.nn.Parameter(torch.randn(8, 8))
            param = FakeZeroParam(weight, gathered=False)
            gm = torch.fx.symbolic_trace(failing_before_a_gather)
            run_profiler(getattr(graph_profile, name)(gm), x, weight)
            report[name] = dict(gathers=param.gathers, incomplete=graph_profile.is_profile_incomplete(gm.graph))
            continue
        gm = torch.fx.symbolic_trace(Chain(args.layers))
        if args.dc_local_ops:
            with_local_dc_ops(gm)
        counted.clear()
        ran.clear()
        run_profiler(getattr(graph_profile, name)(gm), x)
        report[name] = dict(all_reduces=len(counted), nodes=len(gm.graph.nodes), ran=len(ran),
                            incomplete=graph_profile.is_profile_incomplete(gm.graph),
                            meta={n.name: [n.meta.get(k) for k in META] for n in gm.graph.nodes})
    dist.all_reduce = all_reduce
    report["all_gather"] = all_gather_times(args.alter_times_on_rank1 and rank == 1, cache)
    reduce_the_final_bucket(report)


def all_gather_times(alter, cache):
    """How often the all-gather times were measured, and the times the predictor interpolates."""
    import deepspeed.comm as dist
    from deepspeed.compile.profilers import comm_profile
    if alter:
        kept = os.path.join(cache, "deepcompile-profiles")
        for name in os.listdir(kept) if os.path.isdir(kept) else ():
            if name.startswith("all_gather-"):
                with open(os.path.join(kept, name), "w") as f:
                    f.write("[[0, 0.0], [2, 1.0], [4, 2.0]]")
    measured = []

    def measure(device, dtype, maxsize):
        measured.append(maxsize)
        own = torch.tensor([(os.getpid() % 1000) * 1e-7])
        dist.all_reduce(own)
        latency = own.item() / dist.get_world_size() + 1e-5
        return [(0, 0)] + [(2**p, latency + 2**p / 3e11) for p in range(1, maxsize)]

    # scipy's interpolation (not a dependency of the suite) stands in as a record of the times it is given.
    interpolate = types.ModuleType("scipy.interpolate")
    given = []
    interpolate.interp1d = lambda sizes, times, **kw: given.append([list(sizes), list(times)]) or (lambda size: 0.0)
    sys.modules.update({"scipy": types.ModuleType("scipy"), "scipy.interpolate": interpolate})
    comm_profile.run_all_gather = measure
    comm_profile.create_predictor()
    return dict(measured=len(measured), times=given[0])


if __name__ == "__main__":
    run_worker("dc_profiler_collectives", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
