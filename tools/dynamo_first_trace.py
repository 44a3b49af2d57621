"""Worker of tools/dynamo-trace: one process on the CPU (gloo, rank 0 of 1) times the first call with labels of a small
Llama under DeepCompile ZeRO-3 with `"compile_blocks_once": true`, whose seconds are Dynamo's trace: DeepCompile's
backend is stood in for by one that runs each graph as traced (tests/cpu_workers/dc_stand_in.py), so no AOTAutograd,
pass or Inductor time is in it. The width is small; Dynamo's work depends on the node count, which the depth sets.

  python tools/dynamo_first_trace.py --layers 32 [--deadline-s 900]

Prints one line, TRACE_REPORT {"torch", "transformers", "deepspeed", "layers", "first_s", "reuses", "region_calls"}:
reuses counts the layers whose region reused the first layer's trace (torch >= 2.14), null where this torch cannot
reuse one.
"""
import argparse
import faulthandler
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "cpu_workers"))
PREFIX = "TRACE_REPORT "


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--deadline-s", type=float, help="past it, print every thread's stack and exit")
    args = ap.parse_args()
    if args.deadline_s:
        faulthandler.dump_traceback_later(args.deadline_s, exit=True)
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import torch
    import deepspeed
    import transformers
    from dc_compile_blocks_once import regions, reused, start_deepcompile_running_graphs_as_traced

    graphs, reuses = start_deepcompile_running_graphs_as_traced()
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=args.layers,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ds_config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 3},
        "compile": {"deepcompile": True, "compile_blocks_once": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=list(model.parameters()), config=ds_config)
    engine.compile()
    ids = torch.randint(0, 256, (2, 12))
    # The stand-in gathers nothing: the call runs with ZeRO-3's parameters gathered around it.
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        start = time.perf_counter()
        engine.module(input_ids=ids, labels=ids, use_cache=False)  # use_cache=False, as gradient checkpointing sets it
        first_s = time.perf_counter() - start
    print(PREFIX + json.dumps(dict(torch=torch.__version__, transformers=transformers.__version__,
                                   deepspeed=deepspeed.__version__, layers=args.layers, first_s=round(first_s, 3),
                                   reuses=reused(reuses), region_calls=regions(graphs[-1])[0] if graphs else 0)),
          flush=True)


if __name__ == "__main__":
    main()
