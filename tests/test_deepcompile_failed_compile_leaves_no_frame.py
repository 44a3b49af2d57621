"""A graph DeepCompile's backend fails to compile leaves nothing behind (patch
deepcompile-failed-compile-leaves-no-frame).

When AOT autograd cannot trace a graph (the backward of transformers' grouped_mm fallback for MoE experts in fp32
reads a value on the host), Dynamo answers the backend's error with a graph break and compiles the rest of the model.
0.19.8 had put the failed graph's frame in its graph order before compiling, and never learnt whether it needs a
backward: the next graph's compile then failed on that frame (`GraphOrder.get_graph_order`'s assertion), and the
first step of a Qwen2-MoE or Mixtral in fp32 under DeepCompile ZeRO-3 raised.

Here DeepCompile's backend (make_backend, world size 1 on gloo, the compiled extension stood in for) compiles a graph
whose AOT autograd call fails, then another: the second compiles, and the graph order and the profiling results hold
the second graph only.
"""

import textwrap

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS, ONE_RANK_BACKEND, free_port

CODE = """
    import types
    compile_graph = backend.make_backend("eager", CompileConfig())

    trace = backend.aot_module_simplified

    def fails_once(*args, **kwargs):
        backend.aot_module_simplified = trace
        raise RuntimeError("AOT autograd cannot trace this graph")

    def graph(frame_id):
        gm = torch.fx.symbolic_trace(lambda x, w: ((x @ w).relu().sum(), ))
        gm.meta["dynamo_compile_id"] = types.SimpleNamespace(frame_id=frame_id)
        return gm

    x, w = torch.randn(4, 8), torch.randn(8, 3, requires_grad=True)
    backend.aot_module_simplified = fails_once
    try:
        compile_graph(graph(0), [x, w])
        raise AssertionError("the first compile did not fail")
    except RuntimeError as e:
        assert "cannot trace" in str(e), e
    compiled = compile_graph(graph(1), [x, w])
    compiled(x, w)[0].backward()
    assert [frame for frame in backend.graph_order_with_frame_id.frames] == [1], backend.graph_order_with_frame_id.frames
    assert len(backend.profiling_results) == 1, list(backend.profiling_results)
    print("FAILED_COMPILE_FORGOTTEN")
"""


def test_the_graph_after_a_failed_compile_compiles():
    code = ONE_RANK_BACKEND.format(port=free_port()) + CODE
    cpu_worker.run_code(textwrap.dedent(DEFINE_OPS) + textwrap.dedent(code), "FAILED_COMPILE_FORGOTTEN", timeout=600)
