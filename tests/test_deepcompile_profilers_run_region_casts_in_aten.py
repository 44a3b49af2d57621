"""DeepCompile's profilers ran the casts inside a compile region through prims' Python implementation (patch
deepcompile-profilers-run-region-casts-in-aten).

With `compile_blocks_once` each decoder layer is a compile region: the graph DeepCompile profiles calls it through
`invoke_subgraph`, and the layer's casts (prims.convert_element_type, 13 a Llama layer) lie in the region's own graph,
which the call runs as it is. The profilers already ran the casts of the graph itself as aten's _to_copy
(test_deepcompile_profilers_run_casts_in_aten.py); a region's casts still called prims' meta function first, 0.3-0.6 ms
of host time each, about 3,000 of them while 16 layers of the 8B model's width profile. Now a region is called through
a copy of its graph with aten casts, made once a region, where autograd is off (as while AOTAutograd compiles).

On the CPU, in one process: both profilers over a graph that calls one region twice, the region casting dense,
permuted, expanded and sliced inputs to a floating and an integer dtype, with prims' stride check counted. With
autograd off no cast reaches prims and the outputs are what prims' own casts return; with autograd on (the region then
runs as it is) their dtypes, strides and values are. The copies die with their regions, also a region without casts.
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU
from test_deepcompile_profilers_run_casts_in_aten import COUNTED_CASTS

REGION_CASTS = COUNTED_CASTS + """
    invoke_subgraph = torch.ops.higher_order.invoke_subgraph

    region_graph = torch.fx.Graph()
    xs = [region_graph.placeholder(f"x{i}") for i in range(len(inputs))]
    region_graph.output(tuple(region_graph.call_function(cast, (x, dtype)) for x in xs for dtype in dtypes))
    root = torch.nn.Module()
    root.region = torch.fx.GraphModule(torch.nn.Module(), region_graph)

    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    region = graph.get_attr("region")
    calls = [graph.call_function(invoke_subgraph, (region, "layer", *xs)) for _ in range(2)]
    graph.output(tuple(graph.call_function(operator.getitem, (call, i)) for call in calls for i in range(casts)))
    gm = torch.fx.GraphModule(root, graph)

    def same_values(outs):  # with autograd on, the region's call makes every floating output require gradients
        return len(outs) == casts and all(o.dtype == e.dtype and o.stride() == e.stride() and torch.equal(o.detach(), e)
                                          for o, e in zip(outs, expected))

    report = {}
    for grad in (False, True):
        for name, profiler in (("operator", graph_profile.ProfilingInterpreter),
                               ("memory", graph_profile.MemoryProfilingInterpreter)):
            checks.clear()
            with torch.set_grad_enabled(grad), FakeTensorMode():
                outs = profiler(gm).run(*inputs)
            report[f"{name}, autograd {'on' if grad else 'off'}"] = dict(
                meta_checks=len(checks), same=all(map(same_values if grad else same, (outs[:casts], outs[casts:]))),
                incomplete=graph_profile.is_profile_incomplete(gm.graph))

    # The profilers keep a region's copy only as long as the region lives, also for a region without casts.
    import gc, weakref
    plain = torch.fx.Graph()
    x = plain.placeholder("x")
    plain.output((plain.call_function(torch.ops.aten.mul.Tensor, (x, x)), ))
    root.plain = torch.fx.GraphModule(torch.nn.Module(), plain)
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    graph.output((graph.call_function(invoke_subgraph, (graph.get_attr("plain"), "plain", x)), ))
    with torch.no_grad(), FakeTensorMode():
        graph_profile.MemoryProfilingInterpreter(torch.fx.GraphModule(root, graph)).run(inputs[0])
    refs = {name: weakref.ref(getattr(root, name)) for name in ("region", "plain")}
    del root, gm, graph, region_graph, plain, region, calls, x, xs, outs  # graphs, nodes and outputs refer to them
    gc.collect()
    report["regions alive"] = [name for name, ref in refs.items() if ref() is not None]
    print("REGION_CASTS " + json.dumps(report))
"""


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + REGION_CASTS, "REGION_CASTS ")


@pytest.mark.parametrize("profiler", ["operator", "memory"])
def test_profilers_run_a_regions_casts_without_prims_meta_function(report, profiler):
    run = report[f"{profiler}, autograd off"]
    assert not run["incomplete"], report  # the profiler ran every node
    assert run["meta_checks"] == 0, report


@pytest.mark.parametrize("autograd", ["off", "on"])
@pytest.mark.parametrize("profiler", ["operator", "memory"])
def test_profilers_region_casts_return_what_prims_casts_return(report, profiler, autograd):
    run = report[f"{profiler}, autograd {autograd}"]
    assert not run["incomplete"], report
    assert run["same"], report


def test_profilers_keep_no_region_alive(report):
    assert report["regions alive"] == [], report
