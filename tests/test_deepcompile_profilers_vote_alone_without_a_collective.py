"""DeepCompile's profilers voted at one rank as at several (patch
deepcompile-profilers-vote-alone-without-a-collective).

Before a node that may communicate, the profilers' ranks vote: an all-reduce whose result the host reads, waiting for
the device to finish all it was given. A rank alone in its group has nothing to agree on, yet voted: 4,154 votes at
the WARMUP step of 16 layers of the Llama-3-8B width on one H200. Now a rank alone answers for itself.

On the CPU, one gloo rank: both profilers over graphs of 2 and of 6 DeepCompile ops that may communicate, the
all-reduces counted. What each profile still reduces once a graph stays; nothing a node.
"""

import pytest

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import ONE_GLOO_RANK, free_port
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

VOTES = """
    lib.impl("test_call", lambda a: a + 1, "CPU")  # one of DeepCompile's ops: the profilers vote before it
    reduces = []
    all_reduce = graph_profile.dist.all_reduce

    def counted(*args, **kwargs):
        reduces.append(1)
        return all_reduce(*args, **kwargs)

    graph_profile.dist.all_reduce = counted

    def chain(n):
        graph = torch.fx.Graph()
        h = graph.placeholder("x")
        for _ in range(n):
            h = graph.call_function(torch.ops.dc.test_call.default, (h, ))
        graph.output((h, ))
        return torch.fx.GraphModule(torch.nn.Module(), graph)

    report = {}
    for name, profiler in (("operator", graph_profile.ProfilingInterpreter),
                           ("memory", graph_profile.MemoryProfilingInterpreter)):
        for n in (2, 6):
            gm, x = chain(n), torch.zeros(3)
            reduces.clear()
            with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
                out = profiler(gm).run(x)
            report[f"{name}-{n}"] = dict(reduces=len(reduces), out=out[0].tolist(),
                                         incomplete=graph_profile.is_profile_incomplete(gm.graph))
    print("VOTES " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + ONE_GLOO_RANK.format(port=free_port()) + VOTES, "VOTES ")


@pytest.mark.parametrize("profiler", ["operator", "memory"])
def test_a_rank_alone_takes_no_collective_a_node(report, profiler):
    two, six = report[f"{profiler}-2"], report[f"{profiler}-6"]
    assert not two["incomplete"] and not six["incomplete"], report
    assert two["out"] == [2.0] * 3 and six["out"] == [6.0] * 3, report
    assert six["reduces"] == two["reduces"], report  # four more ops, no more collectives
