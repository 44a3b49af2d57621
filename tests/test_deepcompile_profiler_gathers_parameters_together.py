"""DeepCompile's operator profiler gathered every ZeRO-3 parameter three times a profile, one at a time (patches
deepcompile-profiler-gathers-parameters-together, deepcompile-profiler-gathers-only-where-values-are-read).

The profiler gathers, through ZeRO-3's Python all_gather, each partitioned parameter a node reads, and partitions it
again after the node. DeepCompile's pass has each parameter gathered by its allgather_param, waited for, then read;
the profiler takes the parameter itself as the gather's output, and the wait passes it on. The profiler gathered it
for the gather too, whose op gathers from the partition by itself, then for the wait, then for the node reading it;
and a node reading several parameters (a compile region's call reads all of a layer's) gathered them one by one,
each a collective and a device synchronization. At 16 layers of the Llama-3-8B width on 2 H200s the WARMUP step's
profiling made 3,471 single-parameter gathers. Now the node reading the parameters gathers them, all in one call, and
nodes that pass them on (the wait, the release, an index into a region's outputs, which hold the parameters the
region's backward reads) gather none.

On the CPU, in one process: layers of three ZeRO-3 parameters, each gathered, waited for and released by DeepCompile's
ops (their schemas read from the fork's init.cpp, CPU kernels standing in) and the three read by one node, as a
region's call reads them. The parameters stand in for ZeRO-3's (their all_gather and partition counted).
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

PROFILE = """
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    FULL = {}
    calls = []

    def allgather_param(a, graph_id, id, dtype=None):  # gathers from the partition, as DeepCompile's op does
        return FULL[id].to(dtype).clone()

    lib.impl("allgather_param", allgather_param, "CPU")
    lib.impl("wait_allgather", lambda a, graph_id, id: a, "CPU")
    lib.impl("release_param", lambda a, graph_id, id, n_users: a, "CPU")

    def all_gather(param_list):
        calls.append(("gather", sorted(p.ds_id for p in param_list)))
        for p in param_list:
            p.data, p.ds_status = FULL[p.ds_id].clone(), ZeroParamStatus.AVAILABLE

    def partition(param_list, has_been_updated=False):
        calls.append(("partition", sorted(p.ds_id for p in param_list)))
        for p in param_list:
            p.data, p.ds_status = torch.empty(0), ZeroParamStatus.NOT_AVAILABLE

    def zero3_param(ds_id, shape, persist):
        FULL[ds_id] = torch.randn(*shape)
        p = torch.nn.Parameter(torch.empty(0))
        p.ds_id, p.ds_persist, p.ds_status, p.ds_shape = ds_id, persist, ZeroParamStatus.NOT_AVAILABLE, shape
        p.all_gather, p.partition = all_gather, partition
        return p

    def block(h, up, gate, down):
        return h + torch.mm(torch.relu(torch.mm(h, up)) * torch.mm(h, gate), down)

    def region(h, up, gate, down):  # a compile region's forward: its output and what its backward reads
        return block(h, up, gate, down), up, gate, down

    # As DeepCompile's ZeRO-3 pass writes a graph: each parameter gathered, waited for, read, then released; a
    # layer's three read by one node, as a compile region's call reads them, which returns them beside its output.
    # The parameters' dtype is the one gathered (a bf16 model's), so the wait gives the node the parameter itself.
    LAYERS = 3
    import operator
    graph, outputs = torch.fx.Graph(), []
    h = x = graph.placeholder("x")
    for layer in range(LAYERS):
        ids = [3 * layer + i for i in range(3)]
        placeholders = [graph.placeholder(f"w{i}") for i in ids]
        waited = []
        for i, w in zip(ids, placeholders):
            gathered = graph.call_function(torch.ops.dc.allgather_param.default, (w, 0, i),
                                           {"dtype": torch.float32})
            waited.append(graph.call_function(torch.ops.dc.wait_allgather.default, (gathered, 0, i)))
        out = graph.call_function(region, (h, *waited))
        h = graph.call_function(operator.getitem, (out, 0))
        saved = [graph.call_function(operator.getitem, (out, k)) for k in (1, 2, 3)]
        for i in ids:
            graph.call_function(torch.ops.dc.release_param.default, (h, 0, i, 1))
        outputs += saved
    graph.output((h, *outputs))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    # The last layer's down projection stays gathered (ZeRO-3's persistent parameters).
    params = [zero3_param(i, (8, 16) if i % 3 < 2 else (16, 8), persist=i == 3 * LAYERS - 1)
              for i in range(3 * LAYERS)]
    x = torch.randn(4, 8)
    expected = x
    for layer in range(LAYERS):
        expected = block(expected, *(FULL[3 * layer + i] for i in range(3)))

    with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
        out = graph_profile.ProfilingInterpreter(gm).run(x, *params)
    report = dict(calls=calls, incomplete=graph_profile.is_profile_incomplete(gm.graph),
                  max_error=float((out[0] - expected).abs().max().detach()),
                  status=[p.ds_status.name for p in params])
    print("GATHERS " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + PROFILE, "GATHERS ")


def test_the_profile_ran_every_node_on_the_gathered_values(report):
    assert not report["incomplete"], report
    assert report["max_error"] < 1e-5, report


def test_only_the_node_reading_a_parameter_gathers_it(report):
    # Not DeepCompile's gather (its op gathers from the partition), its wait or its release, nor the indexes into the
    # region's outputs: the region's call alone, once a parameter.
    gathered = [i for kind, ids in report["calls"] if kind == "gather" for i in ids]
    assert {i: gathered.count(i) for i in range(9)} == {i: 1 for i in range(9)}, report["calls"]


def test_a_nodes_parameters_are_gathered_in_one_call_and_partitioned_in_one(report):
    assert report["calls"] == [["gather", [0, 1, 2]], ["partition", [0, 1, 2]], ["gather", [3, 4, 5]],
                               ["partition", [3, 4, 5]], ["gather", [6, 7, 8]], ["partition", [6, 7]]], report["calls"]


def test_parameters_are_partitioned_after_the_profile_except_persistent_ones(report):
    assert report["status"] == ["NOT_AVAILABLE"] * 8 + ["AVAILABLE"], report["status"]
