"""DeepCompile's AOT compiler wrapper, on CPU: a graph of a compile cycle that a later schedule entry replaces runs as
AOT traced it, without Inductor (patch deepcompile-lower-only-the-last-schedule-cycle).

The GPU test (tests/gpu/test_deepcompile_lowers_only_the_last_cycle.py) counts Inductor compiles per step of a real
ZeRO-3 run; this checks the wrapper's contract on every torch of the matrix: with lowering off it hands the rewritten
graph back as a boxed callable (AOT autograd's calling convention) computing what the graph computes, and never calls
the compiler it wraps; with lowering on it calls that compiler, as before.
"""

import cpu_worker

CODE = """
    import torch
    from deepspeed.compile.inductor import patch_compiler

    def f(x, y):
        return (x.sin() * y).sum(dim=0), x + 1

    rewritten = []

    def dc_compiler(gm, inputs):  # stands in for DeepCompile's passes: rewrite the graph in place
        for node in gm.graph.nodes:
            if node.target in (torch.sin, "sin"):
                node.op, node.target = "call_function", torch.cos
        rewritten.append(True)
        return gm.graph

    lowered = []

    def original(gm, inputs):
        lowered.append(True)
        return gm.forward

    x, y = torch.randn(3, 4), torch.randn(3, 4)
    for lower in (False, True):
        rewritten.clear(), lowered.clear()
        gm = torch.fx.symbolic_trace(f)
        compiled = patch_compiler(original, dc_compiler, False, 0, {}, bwd=False, lower_with_inductor=lower)(gm, [x, y])
        assert rewritten == [True]
        if lower:
            assert lowered == [True]
            continue
        assert lowered == [], "the wrapped compiler ran for a cycle that is not lowered"
        assert getattr(compiled, "_boxed_call", False), "AOT autograd calls compiled graphs boxed"
        out = compiled([x, y])
        want = ((x.cos() * y).sum(dim=0), x + 1)
        assert all(torch.equal(a, b) for a, b in zip(out, want)), (out, want)
    print("LOWERING_CONTRACT_OK")
"""


def test_a_cycle_that_is_not_lowered_runs_the_rewritten_graph_without_the_wrapped_compiler():
    # A process of its own: importing deepspeed here would pick the CPU accelerator for the whole pytest process.
    cpu_worker.run_code(CODE, "LOWERING_CONTRACT_OK")
