"""DeepCompile ZeRO-3's WARMUP step compiles the graphs it has again in place, without Dynamo and AOT autograd tracing
the model again (patch deepcompile-z3-warmup-compiles-without-tracing-again), on CPU.

The GPU test (tests/gpu/test_deepcompile_lowers_only_the_last_cycle.py) counts Dynamo's graphs per step of a real
ZeRO-3 run and compares its values with eager ZeRO-3; this checks the contract on every torch of the matrix:
- a graph of an early cycle runs its rewritten graph and keeps AOT's graph as it was before the rewrite;
- the last schedule entry leaves Dynamo's cache alone, and the next call of the graph runs that entry's passes on the
  kept graph, with the call's inputs, then lowers it, once;
- a graph with symbolic shapes is not kept, and the entry then resets Dynamo and traces every graph again, as does an
  entry that is not the last;
- the profile kept for a restart is kept per schedule entry: a graph compiled again in place has the same code as at
  step 0, and the later entry must not plan from a profile taken before the optimizer's states existed;
- a graph holding real tensors is kept under AOT autograd's fake mode, sharing them (0.19.8+fork.41-49 cloned them,
  which failed: the evaluation of a model with activation checkpointing under DeepCompile ZeRO-3 raised).
"""

import cpu_worker

CODE = """
    import functools
    import types

    import torch
    from functorch.compile import make_boxed_func
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch._dynamo.source import ConstantSource

    from deepspeed.compile import backend, cycle_graphs
    from deepspeed.compile.inductor import patch_compiler

    def f(x, y):
        return (torch.sin(x) * y).sum(dim=0), x + 1

    def swap(gm, old, new):
        for node in gm.graph.nodes:
            if node.target is old:
                node.target = new
        gm.recompile()
        return gm.graph

    first_rewrites, later, lowered = [], [], []

    def first_passes(gm, inputs):  # stands in for the first cycle's passes
        first_rewrites.append(True)
        return swap(gm, torch.sin, torch.cos)

    def last_passes(gm, inputs, call_inputs):  # the last entry's passes
        assert any(n.target is torch.sin for n in gm.graph.nodes), "the kept graph is not the graph before the rewrite"
        later.append([t.clone() for t in call_inputs])
        return swap(gm, torch.sin, torch.tanh)

    def inductor(gm, inputs):
        lowered.append(True)
        return make_boxed_func(gm.forward)

    def want(fn, x, y):
        return (fn(x) * y).sum(dim=0), x + 1

    def same(out, ref):
        return all(torch.equal(a, b) for a, b in zip(out, ref))

    # 1. The graph's contract.
    cycle_graphs.forget()
    last = [False]
    x, y = torch.randn(3, 4), torch.randn(3, 4)
    compiled = patch_compiler(inductor, first_passes, False, 0, {}, bwd=False, lower_with_inductor=lambda: last[0],
                              compile_again=last_passes)(torch.fx.symbolic_trace(f), [x, y])
    cycle_graphs.note_graph_compiled()
    assert isinstance(compiled, cycle_graphs.CycleGraph)
    assert functools.wraps(compiled)(lambda args: None)._boxed_call, "a wrapper of the graph calls it unboxed"
    assert same(compiled([x, y]), want(torch.cos, x, y)) and lowered == [] and later == []
    assert cycle_graphs.can_compile_again_in_place()
    last[0] = True
    cycle_graphs.compile_again_at_next_call()
    x2, y2 = torch.randn(3, 4), torch.randn(3, 4)
    assert same(compiled([x2, y2]), want(torch.tanh, x2, y2)), "the call did not run the last entry's graph"
    assert lowered == [True] and len(later) == 1 and same(later[0], [x2, y2]), (lowered, later)
    assert same(compiled([x, y]), want(torch.tanh, x, y)) and lowered == [True] and len(later) == 1, "compiled twice"
    assert first_rewrites == [True]

    # 2. A graph with a symbolic size is not kept: the cycle cannot compile again in place.
    env = ShapeEnv()
    n = env.create_symintnode(env.create_symbol(3, ConstantSource("n")), hint=3)
    cycle_graphs.forget()
    plain = patch_compiler(inductor, first_passes, False, 0, {}, bwd=False, lower_with_inductor=lambda: False,
                           compile_again=last_passes)(torch.fx.symbolic_trace(f), [x, y, n])
    cycle_graphs.note_graph_compiled()
    assert not isinstance(plain, cycle_graphs.CycleGraph) and not cycle_graphs.can_compile_again_in_place()

    # 3. The schedule: Dynamo is reset at every entry but a last one whose graphs were all kept.
    resets = []
    backend.get_deepcompile_handle = lambda: types.SimpleNamespace(reset=lambda: None)
    backend.log_rank0 = lambda *args, **kwargs: None  # no process group here
    torch._dynamo.reset = lambda: resets.append(True)

    def kept_graph():
        gm = torch.fx.symbolic_trace(f)
        graph = patch_compiler(inductor, first_passes, False, 0, {}, bwd=False, lower_with_inductor=lambda: False,
                               compile_again=last_passes)(gm, [x, y])
        cycle_graphs.note_graph_compiled()
        return graph

    def run(schedule, graphs):
        resets.clear()
        backend.init_schedule(schedule)
        made = []
        for step in range(8):
            before = len(resets)
            backend.launch_compile_passes(step)
            if step in dict(schedule):
                made.append((step, len(resets) > before))
            if step in graphs:
                made.append(graphs[step]())
        return made

    made = run([(0, ["a"]), (5, ["b"])], {0: kept_graph})
    assert made[0] == (0, True) and made[2] == (5, False), made
    assert made[1].stale, "the last entry did not mark the kept graph for compiling again"

    def symbolic_graph():
        cycle_graphs.note_graph_compiled()
        return patch_compiler(inductor, first_passes, False, 0, {}, bwd=False, lower_with_inductor=lambda: False,
                              compile_again=last_passes)(torch.fx.symbolic_trace(f), [x, y, n])

    made = run([(0, ["a"]), (5, ["b"])], {0: kept_graph, 1: symbolic_graph})
    assert made[-1] == (5, True), f"a cycle with a symbolic graph was not traced again: {made}"
    assert not made[1].stale

    made = run([(0, ["a"]), (3, ["b"]), (5, ["c"])], {0: kept_graph, 3: kept_graph})
    assert [m for m in made if isinstance(m, tuple)] == [(0, True), (3, True), (5, False)], made

    # 4. A graph compiled again in place has its code of step 0, but is profiled for the later entry: a profile kept
    # for a restart (beside Inductor's cache) is kept per entry, so the later entry never plans from step 0's memory.
    from deepspeed.compile.profilers import graph_profile
    assert graph_profile.schedule_entry == 3, graph_profile.schedule_entry
    gm = torch.fx.symbolic_trace(f)
    paths = []
    for entry in (1, 2, 2):
        graph_profile.schedule_entry = entry
        paths.append(graph_profile._kept_profile_file("time", gm.graph, [x, y], torch.device("cpu")))
    assert paths[0] is not None and paths[0] != paths[1] == paths[2], paths

    # 5. A graph holding real tensors (a submodule's buffer, a plain constant), compiled under AOT autograd's fake mode
    # as every graph is: the inference graph of a model with activation checkpointing holds one. The kept copy is
    # made (cloning a real tensor under the fake mode fails) and shares those tensors, not copies of them; its next
    # call after the last entry runs that entry's passes on the graph before the rewrite, with the same tensors.
    from torch._subclasses.fake_tensor import FakeTensorMode

    class WithTensors(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = torch.nn.Module()
            self.inner.register_buffer("scale", torch.arange(4.0))
            self.shift = torch.full((4, ), 0.5)

        def forward(self, x, y):
            return (torch.sin(x) * y * self.inner.scale + self.shift).sum(dim=0), x + 1

    def want_with_tensors(fn, x, y):
        return (fn(x) * y * torch.arange(4.0) + 0.5).sum(dim=0), x + 1

    cycle_graphs.forget()
    lowered.clear(), later.clear()
    last[0] = False
    gm = torch.fx.symbolic_trace(WithTensors())
    real = {name: t for name, t in [*gm.named_buffers(), *vars(gm).items()] if isinstance(t, torch.Tensor)}
    assert len(real) == 2, real
    with FakeTensorMode(allow_non_fake_inputs=True):
        compiled = patch_compiler(inductor, first_passes, False, 0, {}, bwd=False, lower_with_inductor=lambda: last[0],
                                  compile_again=last_passes)(gm, [x, y])
    cycle_graphs.note_graph_compiled()
    kept = compiled.graph_module
    assert kept is not gm and kept.graph is not gm.graph
    assert any(n.target is torch.sin for n in kept.graph.nodes), "the kept graph is the rewritten one"
    kept_real = {name: t for name, t in [*kept.named_buffers(), *vars(kept).items()] if isinstance(t, torch.Tensor)}
    assert kept_real.keys() == real.keys() and all(kept_real[k] is real[k] for k in real), "tensors were copied"
    assert same(compiled([x, y]), want_with_tensors(torch.cos, x, y))
    last[0] = True
    cycle_graphs.compile_again_at_next_call()
    assert same(compiled([x2, y2]), want_with_tensors(torch.tanh, x2, y2)) and lowered == [True]
    print("COMPILES_IN_PLACE_OK")
"""


def test_the_last_entry_compiles_the_kept_graphs_at_their_next_call_without_resetting_dynamo():
    # A process of its own: importing deepspeed here would pick the CPU accelerator for the whole pytest process.
    cpu_worker.run_code(CODE, "COMPILES_IN_PLACE_OK")
