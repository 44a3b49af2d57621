"""DeepCompile's AOT compiler wrapper, on CPU: with compile_blocks_once, a graph that calls nested compile regions has
Inductor lower each region once, and each run of three or more ops between DeepCompile's (the loss), each on its own;
the rest of the graph, DeepCompile's ops among it, runs as traced (patch
deepcompile-compile-blocks-once-lowers-no-deepcompile-op).

Around the repeated blocks a ZeRO-3 graph holds DeepCompile's gathers, releases and reductions, about 150 of them a
decoder layer; Inductor wrapped each in a fallback kernel, one by one, at a cost that grew with the depth of the model.
Here a model of four blocks, traced by AOTAutograd with Inductor's decompositions, goes through the wrapper as
DeepCompile's backend calls it (DeepCompile's passes stood in for). The compiler that lowers whole graphs is never
called for the graphs calling the regions; Inductor gets each region's graph once (the first block's differs: its
input needs no gradient), forward and backward, at the first size and at a changing one; the loss's log-softmax is
fused, after a head whose weight comes from an op standing in for DeepCompile's gather, and the embedding's gradient
is filled in place, its `full` lowered with its index_put past an op standing in for DeepCompile's release; the graphs
calling the regions clear the list of their arguments, which frees the backward's saved activations as it goes; a run
of ops no larger than the blocks' values is not lowered, a compile of its own (patch
deepcompile-compile-blocks-once-lowers-only-runs-larger-than-a-block). With
Inductor padding the rows of the buffers it lays out (as it does on a GPU), the losses and gradients are eager's: each
graph's outputs keep their traced strides, which the next region and the backward were compiled for. A graph without
regions is lowered whole, as before. The GPU test is
tests/gpu/test_deepcompile_blocks_lower_no_deepcompile_op_on_gpu.py.
"""

import pytest
import torch

import cpu_worker

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

CODE = """
    import torch
    import torch.nn as nn
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor import compile_fx
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor import config as inductor_config
    from deepspeed.compile.inductor import patch_compiler

    # Inductor pads the strides of a buffer whose layout is its to choose (a GPU's rule: rows of more than 1024
    # elements to multiples of 128 bytes), on the CPU too and from rows of 16 elements on: a region's outputs of 24
    # and 40 features (activations the backward region reads among them) are then padded unless kept as traced.
    inductor_config.padding_stride_threshold = 16

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm, self.up, self.down = nn.LayerNorm(24), nn.Linear(24, 40), nn.Linear(40, 24)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))

    class Region(Block):
        forward = torch.compiler.nested_compile_region(Block.forward)

    # Stands in for DeepCompile's gather of the head's weight: an op of DeepCompile's namespace, whose output the
    # graph's traced value does not describe under ZeRO-3.
    @torch.library.custom_op("dc::gathered_stand_in", mutates_args=())
    def gathered(w: torch.Tensor) -> torch.Tensor:
        return w.clone()

    @gathered.register_fake
    def _(w):
        return torch.empty_like(w)

    gathered.register_autograd(lambda ctx, grad: grad)

    # Stands in for DeepCompile's release of a gathered parameter, which its passes put between AOTAutograd's ops: here
    # right after each `full` of a backward (the embedding's gradient, which an index_put then fills).
    @torch.library.custom_op("dc::release_stand_in", mutates_args=())
    def release(x: torch.Tensor) -> None:
        pass

    release.register_fake(lambda x: None)

    def passes_stand_in(gm, inputs):
        first = next(n for n in gm.graph.nodes
                     if n.op == "placeholder" and isinstance(n.meta.get("val"), torch.Tensor))
        for node in [n for n in gm.graph.nodes if n.target is torch.ops.aten.full.default]:
            with gm.graph.inserting_after(node):
                gm.graph.call_function(torch.ops.dc.release_stand_in.default, (first,))
        return gm.graph

    class Model(nn.Module):
        def __init__(self, regions):
            super().__init__()
            self.blocks = nn.ModuleList((Region if regions else Block)() for _ in range(4))
            # more classes than a block has weights: the loss's values are larger than the blocks'
            self.head = nn.Linear(24, 256)
            self.embed = nn.Embedding(256, 24)

        def forward(self, x, y):
            # a run of three ops no larger than the blocks' values (as a model's rotary tables are)
            x = torch.tanh(x) * 2.0 + 1.0
            for block in self.blocks:
                x = block(x)
            # scaled: an op after the embedding's backward, as the conversion of a bf16 table's fp32 gradient is
            x = x + torch.nn.functional.embedding(y, gathered(self.embed.weight) * 1.5)
            logits = torch.nn.functional.linear(x, gathered(self.head.weight), self.head.bias)
            return torch.nn.functional.cross_entropy(logits, y)

    whole, lowered, args_kept = [], [], []

    def lower_whole(gm, inputs):  # stands in for Inductor's compiler of whole graphs
        whole.append(len(gm.graph.nodes))
        return compile_fx.compile_fx_inner(gm, inputs)

    real_inner = compile_fx.compile_fx_inner

    def counting_inner(gm, inputs, *args, **kwargs):
        lowered.append({str(n.target) for n in gm.graph.nodes if n.op == "call_function"})
        return real_inner(gm, inputs, *args, **kwargs)

    compile_fx.compile_fx_inner = counting_inner

    def backend(regions_only):
        def compiler(bwd):
            inner = patch_compiler(lower_whole, passes_stand_in, False, 0, {}, bwd=bwd, regions_only=regions_only)

            def compile(gm, inputs):
                calls_regions = any(n.target is torch.ops.higher_order.invoke_subgraph for n in gm.graph.nodes)
                fn = inner(gm, inputs)

                def run(args):
                    out = fn(args)
                    if calls_regions:
                        args_kept.append(len(args))
                    return out

                run._boxed_call = True
                return run

            return compile
        return aot_autograd(fw_compiler=compiler(False), bw_compiler=compiler(True),
                            decompositions=select_decomp_table())

    def batches():
        g = torch.Generator().manual_seed(1)
        return [(torch.randn(n, 24, generator=g), torch.randint(0, 256, (n,), generator=g)) for n in (8, 8, 5, 11)]

    def train(model, compiled):
        losses = []
        for x, y in batches():
            loss = compiled(x, y)
            loss.backward()
            losses.append(loss.item())
        return losses, [p.grad.clone() for p in model.parameters()]

    torch.manual_seed(0)
    state = Model(True).state_dict()

    eager = Model(True)
    eager.load_state_dict(state)
    want_losses, want_grads = train(eager, eager)

    for regions_only, regions in ((True, True), (True, False), (False, True)):
        # lower_whole stands in for Inductor's compiler of whole graphs with compile_fx_inner alone, which does not
        # mark the regions' outputs to keep their strides as Inductor's compiler does: the padding is left to the
        # CPU's rule there.
        inductor_config.disable_padding_cpu = not regions_only
        torch._dynamo.reset()
        whole.clear(), lowered.clear(), args_kept.clear()
        model = Model(regions)
        model.load_state_dict(state)
        losses, grads = train(model, torch.compile(model, backend=backend(regions_only)))
        assert all(abs(a - b) <= 1e-5 * abs(b) for a, b in zip(losses, want_losses)), (losses, want_losses)
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(grads, want_grads))
        if regions_only and regions:
            assert whole == [], f"graphs calling the regions were lowered whole: {whole}"
            # forward and backward, at the first size and then at a symbolic one: the first block's region and the
            # others' each time (GELU's erf is the blocks')
            assert sum("aten.erf.default" in ops for ops in lowered) == 8, lowered
            # the loss's log-softmax, fused at each size, not run op by op: the head's matrix multiply, reading the
            # stand-in gather, runs as traced, and the loss after it is lowered
            assert sum("aten.amax.default" in ops for ops in lowered) == 2, lowered
            assert not any("dc.gathered_stand_in.default" in ops for ops in lowered), lowered
            # the embedding's gradient: its `full` lowered with the index_put filling it (in place), past the release
            # standing in between them
            assert sum({"aten.full.default", "aten.index_put.default"} <= ops for ops in lowered) == 2, lowered
            # a run no larger than the blocks' values runs as traced: a compile of its own would cost more than it saves
            # (patch deepcompile-compile-blocks-once-lowers-only-runs-larger-than-a-block)
            assert not any("aten.tanh.default" in ops for ops in lowered), lowered
            # a graph calling the regions frees its arguments (the backward's saved activations) as it goes: it
            # clears the list AOTAutograd calls it with
            assert args_kept and not any(args_kept), args_kept
        else:
            assert len(whole) == 4 and len(lowered) == 4, (whole, lowered)
    print("REGIONS_ONLY_OK")
"""


def test_graphs_calling_regions_lower_only_the_regions_and_keep_eager_values():
    # A process of its own: importing deepspeed here would pick the CPU accelerator for the whole pytest process.
    cpu_worker.run_code(CODE, "REGIONS_ONLY_OK", timeout=600)
