"""Worker for tests/test_deepcompile_z3_inductor_size_guards.py: a rank compiles, through DeepCompile's wrapper of
Inductor's compiler (deepspeed.compile.inductor.patch_compiler, ZeRO-3), a graph whose sequence length differs across
ranks and is marked dynamic as the engine marks it; then runs it again at a second length. On CPU (gloo,
DS_ACCELERATOR=cpu); without torchrun it runs alone, at world size 1.

  torchrun --nproc-per-node 2 tests/cpu_workers/dc_inductor_size_guards.py

Inductor's SDPA lowering asks ir.is_aligned_realized_tensor about the attention mask only on CUDA, so the compiler
wrapped here stands in for it: it asks the same Inductor function about a [2, 1, L, L] mask of the graph's sequence
length L, in an Inductor graph of its own, and returns the graph unchanged. Rank 0's lengths are 40 then 37 (aligned to
8, then not), rank 1's 35 then 43 (unaligned both times). Each rank reports how often its compiler ran, what the
question got answered, and the guards on the length's alignment it left.
"""

import datetime
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import reduce_the_final_bucket, run_worker  # noqa: E402

LENGTHS = {0: (40, 37), 1: (35, 43)}


def main(report):
    import torch
    from types import SimpleNamespace
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._inductor import ir
    from torch._inductor.graph import GraphLowering
    from torch._inductor.virtualized import V
    import deepspeed
    from deepspeed.compile.inductor import patch_compiler
    from deepspeed.compile.util import mark_dims_that_differ_across_ranks_dynamic

    if not report["standalone"]:
        deepspeed.init_distributed(dist_backend="gloo", timeout=datetime.timedelta(seconds=60))
    rank = report["rank"]
    answers = report["aligned"] = []
    guards = report["mod_guards"] = []

    def inductor_standin(gm, fake_inputs):
        length = next(s for t in fake_inputs if isinstance(t, torch.Tensor) for s in t.shape
                      if isinstance(s, torch.SymInt))
        shape_env, n = length.node.shape_env, length.node.expr
        with V.set_graph_handler(GraphLowering(gm, shape_env=shape_env)):
            mask = ir.InputBuffer(name="mask", layout=ir.FixedLayout(torch.device("cpu"), torch.float32,
                                                                     size=[2, 1, n, n], stride=[n * n, n * n, n, 1]))
            answers.append(bool(ir.is_aligned_realized_tensor(mask, 8)))
        guards.append(sum("Mod" in str(g.expr) for g in shape_env.guards))
        return make_boxed_func(gm.forward)

    managers = {}

    def backend(gm, example_inputs):
        graph_id = id(gm.graph)
        managers[graph_id] = SimpleNamespace(param_names=[])
        fw = patch_compiler(inductor_standin, lambda g, inputs: g, z3_partition=True, graph_id=graph_id,
                            graph_param_manager=managers, bwd=False)
        return aot_module_simplified(gm, example_inputs, fw_compiler=fw)

    def step(input_ids, attention_mask):
        return (input_ids.float() * attention_mask).sum(-1)

    compiled = torch.compile(step, backend=backend)
    report["outputs"] = []
    for length in LENGTHS[rank]:
        ids = torch.arange(2 * length).reshape(2, length) % 7
        kwargs = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
        if report["standalone"]:
            for t in kwargs.values():  # alone there is no other rank to differ from: mark the length as ranks would
                torch._dynamo.maybe_mark_dynamic(t, 1)
        else:
            mark_dims_that_differ_across_ranks_dynamic(((), kwargs))
        out = compiled(**kwargs)
        report["outputs"].append(torch.equal(out, step(**kwargs)))
    report["compiles"] = len(answers)
    if not report["standalone"]:
        reduce_the_final_bucket(report)


if __name__ == "__main__":
    run_worker("dc_inductor_size_guards", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
