"""DeepCompile's profilers ran every cast of a graph through prims' Python implementation (patch
deepcompile-profilers-run-casts-in-aten).

AOTAutograd's graphs cast with prims.convert_element_type (13 casts a Llama layer, forward and backward). The
profilers run every node eagerly, and eagerly that op calls its meta function first, which builds a class at every
call: 0.3-0.6 ms of host time a cast against 10-20 us for aten's _to_copy. At DeepCompile's WARMUP step the profilers
run each graph three times. Now they run a cast as aten's _to_copy: the same tensor (dtype, strides, values,
requires_grad), without the meta function.

On the CPU, in one process: both profilers over a graph of casts of dense, permuted, expanded and sliced inputs, to a
floating and an integer dtype, with the meta function's stride check counted. The graph's outputs must be what prims'
own cast returns.
"""

import pytest

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU

# Inputs and the dtypes they are cast to, with prims' stride check counted in `checks`; `same(outs)` tells whether outs
# are what prims' own casts of them return. Shared with test_deepcompile_profilers_run_region_casts_in_aten.py.
COUNTED_CASTS = """
    import operator
    import torch._prims_common as prims_common

    checks = []
    check = prims_common.is_non_overlapping_and_dense_or_false

    def counted(a):
        checks.append(1)
        return check(a)

    prims_common.is_non_overlapping_and_dense_or_false = counted
    cast = torch.ops.prims.convert_element_type.default
    base = torch.randn(4, 6, 8)
    inputs = [base.clone().requires_grad_(), base.permute(2, 0, 1), torch.randn(1, 8).expand(5, 8), base[1:, ::2]]
    dtypes = [torch.bfloat16, torch.float64, torch.int32]
    casts = len(inputs) * len(dtypes)
    expected = [cast(x, dtype) for x in inputs for dtype in dtypes]
    assert len(checks) >= casts  # prims' own cast runs its meta function's check, once or twice a cast

    def same(outs):
        return len(outs) == casts and all(
            o.dtype == e.dtype and o.stride() == e.stride() and o.requires_grad == e.requires_grad and torch.equal(o, e)
            for o, e in zip(outs, expected))
"""

CASTS = COUNTED_CASTS + """
    graph = torch.fx.Graph()
    xs = [graph.placeholder(f"x{i}") for i in range(len(inputs))]
    graph.output(tuple(graph.call_function(cast, (x, dtype)) for x in xs for dtype in dtypes))
    gm = torch.fx.GraphModule(torch.nn.Module(), graph)

    report = {}
    for name, profiler in (("operator", graph_profile.ProfilingInterpreter),
                           ("memory", graph_profile.MemoryProfilingInterpreter)):
        checks.clear()
        with FakeTensorMode():  # as in a compile (tests/cpu_workers/dc_profile_graph_mismatch.run_profiler)
            outs = profiler(gm).run(*inputs)
        report[name] = dict(meta_checks=len(checks), same=same(outs),
                            incomplete=graph_profile.is_profile_incomplete(gm.graph))
    print("CASTS " + json.dumps(dict(report, casts=casts)))
"""


@pytest.fixture(scope="module")
def report():
    return cpu_worker.code_report(PROFILERS_ON_CPU + CASTS, "CASTS ")


@pytest.mark.parametrize("profiler", ["operator", "memory"])
def test_profilers_run_casts_without_prims_meta_function(report, profiler):
    assert not report[profiler]["incomplete"], report  # the profiler ran every node
    assert report[profiler]["meta_checks"] == 0, report


@pytest.mark.parametrize("profiler", ["operator", "memory"])
def test_profilers_casts_return_what_prims_cast_returns(report, profiler):
    assert report[profiler]["same"], report
