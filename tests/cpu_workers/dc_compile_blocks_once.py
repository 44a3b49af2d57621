"""Worker for tests/test_deepcompile_compile_blocks_once.py and test_deepcompile_z3_blocks_compile_past_eight_layers.py:
a small transformers model (Llama of 3 decoder layers unless --family and --layers say otherwise) under a DeepCompile
engine, compiled with and without `"compile_blocks_once": true`. One process on CPU (gloo, DS_ACCELERATOR=cpu).

  python tests/cpu_workers/dc_compile_blocks_once.py --stage 3 [--blocks] [--freeze] [--layers 3] [--no-kv-cache]
      [--family llama]

DeepCompile's native op is replaced by a no-op and its backend by a stand-in that keeps each graph Dynamo hands it
and runs it as traced (dc_stand_in.py); deepspeed.initialize and engine.compile() are real. Under ZeRO-3 the
stand-in gathers nothing, so the calls run inside GatheredParameters. Reports (one line, BLOCKS_REPORT): for a call
with labels and for greedy generation with the KV cache, the nested compile regions the graphs call and how many
graphs they have, the loss or tokens against the model run eagerly; or the error engine.compile() raised, and
whether the layers' forward was left as it was. Where Dynamo can reuse a region's trace for the next call (torch >=
2.14), each part also counts the calls that reused one (`reuses`; null where it cannot). The call with labels also
counts the guards Dynamo built for objects it met under two names (`aliasing_guards`: all, and those met in a module's
hook dicts).
"""

import argparse
import functools
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import ensure_dist_env, init_distributed  # noqa: E402
from dc_stand_in import NoOpHandle, stand_in_deepcompile  # noqa: E402

PREFIX = "BLOCKS_REPORT "

# One small config per family: (transformers, layers) -> config.
SMALL = dict(num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
FAMILIES = {
    "llama": lambda t, n: t.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=n, **SMALL),
    "mixtral": lambda t, n: t.MixtralConfig(hidden_size=64, intermediate_size=64, num_local_experts=4,
                                            num_hidden_layers=n, **SMALL),
}


def regions(gm):
    """(calls of nested compile regions, distinct region graphs) in a Dynamo graph module."""
    calls = [n for n in gm.graph.nodes if n.op == "call_function" and "invoke_subgraph" in str(n.target)]
    return len(calls), len({n.args[0].target for n in calls})


def count_region_reuses():
    """A list that gets an item whenever Dynamo stamps out a region's trace for a later call; None where this torch
    reuses no trace."""
    import torch._dynamo.variables as dynamo_variables
    module = getattr(dynamo_variables, "invoke_subgraph", None)
    if not hasattr(module, "stamp_out_subgraph"):
        return None
    reuses, stamp_out = [], module.stamp_out_subgraph
    module.stamp_out_subgraph = lambda *args, **kwargs: (reuses.append(1), stamp_out(*args, **kwargs))[1]
    return reuses


def record_aliasing_guards():
    """A list that gets the two names of every object Dynamo guards to be met under two names (a guard it builds and
    checks in Python); None where this torch has no such guard."""
    from torch._dynamo.guards import GuardBuilder
    duplicate_input = getattr(GuardBuilder, "DUPLICATE_INPUT", None)
    if duplicate_input is None:
        return None
    pairs = []

    @functools.wraps(duplicate_input)  # torch >= 2.14 reuses a region's trace only under guards it knows by name
    def recording(self, guard, source_b):
        pairs.append((guard.name, source_b.name))
        return duplicate_input(self, guard, source_b)

    GuardBuilder.DUPLICATE_INPUT = recording
    return pairs


def aliasing(pairs):
    """The aliasing guards: how many, and how many of objects met in a module's hook dicts."""
    if pairs is None:
        return None
    return {"all": len(pairs), "module_hooks": sum(any("_hooks" in name for name in pair) for pair in pairs)}


def reused(reuses, since=0):
    return None if reuses is None else len(reuses) - since


def start_deepcompile_running_graphs_as_traced():
    """This process as rank 0 of 1 on gloo, DeepCompile's backend stood in for by one that keeps each graph Dynamo
    hands it and runs it as traced. Returns that list of graphs and the region reuse counter (count_region_reuses)."""
    ensure_dist_env()  # one process: rank 0 of 1
    init_distributed("gloo")
    graphs = []

    def compile_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    stand_in_deepcompile(NoOpHandle(), compile_graph)
    return graphs, count_region_reuses()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    ap.add_argument("--blocks", action="store_true", help='"compile_blocks_once": true')
    ap.add_argument("--freeze", action="store_true", help="the layers' q_proj weights frozen (as under LoRA)")
    ap.add_argument("--layers", type=int, default=3)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    ap.add_argument("--no-kv-cache", action="store_true",
                    help="the call with labels passes use_cache=False, as gradient checkpointing sets it")
    args = ap.parse_args()
    import deepspeed
    import transformers

    graphs, reuses = start_deepcompile_running_graphs_as_traced()
    aliased = record_aliasing_guards()
    config = FAMILIES[args.family](transformers, args.layers)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reference = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    reference.load_state_dict(model.state_dict())
    if args.freeze:
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.requires_grad_(False)
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": args.stage},
        "compile": {"deepcompile": True, "compile_blocks_once": args.blocks},
    }
    trained = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trained, config=ds_config)
    report = {"stage": args.stage, "blocks": args.blocks, "error": None}
    try:
        engine.compile()
    except Exception as e:
        report["error"] = f"{type(e).__name__}: {e}"
        report["layers_forward_kept"] = all("forward" not in vars(layer) for layer in model.model.layers)
        print(PREFIX + json.dumps(report), flush=True)
        return

    ids = torch.randint(0, 256, (2, 12))
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params, enabled=args.stage == 3):
        cache = dict(use_cache=False) if args.no_kv_cache else {}
        loss = engine.module(input_ids=ids, labels=ids, **cache).loss
        report["train"] = dict(zip(("region_calls", "region_graphs"), regions(graphs[-1])),
                               loss=float(loss), eager_loss=float(reference(input_ids=ids, labels=ids).loss),
                               reuses=reused(reuses), aliasing_guards=aliasing(aliased))
        seen = len(graphs)
        tokens = engine.module.generate(ids[:1], max_new_tokens=6, do_sample=False, use_cache=True)
        report["generate"] = dict(graphs=len(graphs) - seen, region_calls=sum(regions(g)[0] for g in graphs[seen:]),
                                  tokens=tokens.tolist(),
                                  eager_tokens=reference.generate(ids[:1], max_new_tokens=6, do_sample=False,
                                                                  use_cache=True).tolist(),
                                  reuses=reused(reuses, since=report["train"]["reuses"]))
    print(PREFIX + json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
