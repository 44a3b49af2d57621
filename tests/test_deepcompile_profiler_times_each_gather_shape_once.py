"""DeepCompile's operator profiler timed every layer's gathers again (patch
deepcompile-profile-times-gathers-of-one-shape-once).

The profiler times a node once for each kind of operands (their shapes and dtypes) and reuses that time for the next
node of the same kind, unless it is one of DeepCompile's own ops: those carry the number of their graph and of their
parameter, which made every gather's operands a kind of their own. Every gather of every layer was then run fifteen
times (five to warm up, ten timed), with a device synchronization, and at several ranks between two barriers; a
Llama layer has nine parameters, gathered in the forward and again in the backward. Now the numbers are left out of
the key, and a layer's gathers take the times of the first layer's gathers of the same shape.

On the CPU, in one process: ZeRO-3 parameters gathered by DeepCompile's allgather_param (its schema read from the
fork's init.cpp, a counting CPU kernel standing in) and multiplied in a chain, 2 and 8 of one shape, then one of
another.
"""

import os

import pytest

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers")

# DeepCompile's profilers in a process of DeepSpeed's CPU accelerator: its ops defined (no kernels), its native handle
# stood in for, no profile kept on disk between graphs. The code of a test follows it.
PROFILERS_ON_CPU = DEFINE_OPS + f"    WORKERS = {WORKERS!r}\n" + """
    import json, sys
    import torch.fx
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch._inductor import config as inductor_config
    from deepspeed.compile.profilers import graph_profile
    sys.path.insert(0, WORKERS)
    from dc_profile_graph_mismatch import NoOpHandle, profile_on_cpu

    inductor_config.fx_graph_cache = False
    accelerator = deepspeed.accelerator.get_accelerator()
    accelerator.current_device = lambda: "cpu"
    profile_on_cpu(accelerator)
    graph_profile.get_deepcompile_handle = NoOpHandle
"""

PROFILE = """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    runs = []

    def allgather_param(a, graph_id, id, dtype=None):
        runs.append(id)
        return a.clone()

    lib.impl("allgather_param", allgather_param, "CPU")

    def zero3_param(shape, ds_id):
        p = torch.nn.Parameter(torch.randn(*shape))
        p.ds_id, p.ds_persist, p.ds_status, p.ds_shape = ds_id, False, ZeroParamStatus.AVAILABLE, p.shape
        return p

    def gathered_chain(count):
        graph = torch.fx.Graph()
        h = graph.placeholder("x")
        for i in range(count):
            g = graph.call_function(torch.ops.dc.allgather_param.default, (graph.placeholder(f"w{i}"), 0, i))
            h = graph.call_function(torch.relu, (graph.call_function(torch.mm, (h, g)), ))
        graph.output((h, ))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    report = {}
    for layers in (2, 8):
        shapes = [(8, 8)] * layers + [(8, 4)]
        gm = gathered_chain(len(shapes))
        params = [zero3_param(shape, i) for i, shape in enumerate(shapes)]
        x = torch.randn(4, 8)
        runs.clear()
        with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
            graph_profile.ProfilingInterpreter(gm).run(x, *params)
        gathers = [n for n in gm.graph.nodes if n.target == torch.ops.dc.allgather_param.default]
        report[layers] = dict(runs=[runs.count(i) for i in range(len(shapes))],
                              times=[n.meta["device_time"] for n in gathers],
                              incomplete=graph_profile.is_profile_incomplete(gm.graph))
    print("GATHER_RUNS " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def by_layers():
    return {int(k): v for k, v in cpu_worker.code_report(PROFILERS_ON_CPU + PROFILE, "GATHER_RUNS ").items()}


def test_a_layers_gathers_are_not_timed_again(by_layers):
    for layers, report in by_layers.items():
        assert not report["incomplete"], report  # the profiler ran every node
        first, *later = report["runs"][:layers]
        assert first > 1, report  # timed
        assert later == [1] * (layers - 1), (layers, report["runs"])
    # One more layer is one more run of its gather, not another timing.
    assert sum(by_layers[8]["runs"]) - sum(by_layers[2]["runs"]) == 6, (by_layers[2]["runs"], by_layers[8]["runs"])


def test_later_gathers_take_the_first_gathers_time(by_layers):
    times = by_layers[8]["times"]
    assert times[1:8] == [times[0]] * 7, times


def test_a_gather_of_another_shape_is_timed_on_its_own(by_layers):
    for layers, report in by_layers.items():
        assert report["runs"][layers] == report["runs"][0] > 1, report
