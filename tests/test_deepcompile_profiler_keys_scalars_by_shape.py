"""DeepCompile's operator profiler timed a node again for every value of a one-element tensor among its operands
(patch deepcompile-profiler-keys-scalars-by-shape).

The profiler times a node once for each kind of operands and reuses that time for the next node of the same kind
(tests/test_deepcompile_profiler_times_each_gather_shape_once.py). A one-element tensor was keyed by its value, read
from the device. SDPA's attention saves its random-number state for the backward, a seed and an offset in one-element
tensors, the offset new at every layer: under compile_blocks_once each layer's backward region was then timed again,
15 runs of a whole decoder layer's backward. At 16 layers of the Llama-3-8B width on one H200, 12 of the 16 backward
regions were timed where one would do (the timed regions, the forward's one among them, took 2.6 s of the WARMUP
step). A one-element tensor is now keyed by its dtype, device and shape.

On the CPU, in one process: a chain of nodes each taking a one-element int64 tensor of another value (a seed, an
offset), the runs of each node counted.
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

SCALARS = """
    runs = []

    def layer(x, offset):  # stands in for a region whose cost does not depend on the offset's value
        runs.append(int(offset))
        return torch.tanh(x) + 1

    graph = torch.fx.Graph()
    h = graph.placeholder("x")
    offsets = [graph.placeholder(f"offset{i}") for i in range(6)]
    for offset in offsets:
        h = graph.call_function(layer, (h, offset))
    graph.output((h, ))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)
    x = torch.randn(4, 8)
    values = [torch.tensor(1000 + 977 * i, dtype=torch.int64) for i in range(len(offsets))]
    with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
        out = graph_profile.ProfilingInterpreter(gm).run(x, *values)
    expected = x
    for _ in offsets:
        expected = torch.tanh(expected) + 1
    layers = [n for n in gm.graph.nodes if n.target is layer]
    print("SCALARS " + json.dumps(dict(runs=[runs.count(int(v)) for v in values],
                                       times=[n.meta["device_time"] for n in layers],
                                       sizes=[n.meta["tensor_size"] for n in layers],
                                       same=torch.equal(out[0], expected),
                                       incomplete=graph_profile.is_profile_incomplete(gm.graph))))
"""


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + SCALARS, "SCALARS ")


def test_a_node_is_not_timed_again_for_another_scalar_value(report):
    assert not report["incomplete"] and report["same"], report
    first, *later = report["runs"]
    assert first > 1, report  # timed
    assert later == [1] * len(later), report["runs"]


def test_later_nodes_take_the_first_nodes_measurements(report):
    assert report["times"][1:] == [report["times"][0]] * (len(report["times"]) - 1), report
    assert report["sizes"][1:] == [report["sizes"][0]] * (len(report["sizes"]) - 1), report
