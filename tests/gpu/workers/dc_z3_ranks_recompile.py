"""Worker for test_deepcompile_z3_ranks_recompile_together.py: the zoo's Llama under ZeRO-3 at 2 ranks, eagerly or
with DeepCompile, whose micro-batch lengths per rank are what a collator padding to the longest row gives when both
ranks' longest rows had one length at first and not later.

  torchrun --nproc-per-node 2 tests/gpu/workers/dc_z3_ranks_recompile.py --mode deepcompile

Lengths by step (rank 0, rank 1): 40/40 (the same on both ranks: a static graph each, for a length aligned to 8),
then 40/45 (rank 0's length unchanged), 36/40, 52/37, 44/52. Each rank reports its losses, the global gradient norm
of each step, and how many Dynamo graphs it had compiled after each step.

--case calls-of-the-module (tests/gpu/test_deepcompile_z3_ranks_recompile_together.py): one training step at 40/45,
then evaluation as the Hugging Face Trainer runs it, calling the engine's module itself under no_grad, at 40/50 and
44/37: rank 0's first evaluation length is the one its frame was compiled for. Each rank reports the evaluation
losses and the Dynamo graphs after each call.

--case padding-benchmarks-disagree (the same test file): the zoo's Llama with GPT-2's vocabulary, 50257 rows, whose
output projection Inductor may pad to a multiple of 8 where a benchmark timed on the rank's GPU finds that faster. In
DeepCompile mode each rank's benchmark answers for it, rank 0 that padding is faster and rank 1 that it is not, as two
ranks timing it apart can; each rank reports how often Inductor asked. Both ranks train at length 40 every step.
"""

import argparse
import functools
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import (answer_inductors_padding_benchmark, cancel_deadline, describe, run_worker,  # noqa: E402
                             setup_device, stacks_at_deadline)
from zoo_cell import Counters  # noqa: E402
import ds_configs  # noqa: E402
import zoo_models  # noqa: E402

MICRO_BATCH = 2
LENGTHS = {0: (40, 40, 36, 52, 44), 1: (40, 45, 40, 37, 52)}
# --case calls-of-the-module: (training length, evaluation lengths) of each rank.
DIRECT = {0: (40, (40, 44)), 1: (45, (50, 37))}
# --case padding-benchmarks-disagree: every rank's length at every step, and the model's vocabulary (GPT-2's).
ONE_LENGTH = {0: (40, 40, 40), 1: (40, 40, 40)}
GPT2_VOCAB = 50257


def make_batch(step, length):
    return zoo_models.token_batch("llama", 3000 + 100 * int(os.environ.get("RANK", "0")) + step, MICRO_BATCH, length)


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["eager", "deepcompile"])
    ap.add_argument("--deadline", type=float, default=300)
    ap.add_argument("--case", default="recompile-together", choices=sorted(CASES))
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)

    device = setup_device()
    describe(report)
    import deepspeed

    torch.manual_seed(0)
    if args.case == "padding-benchmarks-disagree":
        import transformers
        config = transformers.LlamaConfig(**dict(zoo_models.SMALL, vocab_size=GPT2_VOCAB))
        model = transformers.AutoModelForCausalLM.from_config(config)
        if args.mode == "deepcompile":
            report["padding_asked"] = answer_inductors_padding_benchmark(report["rank"] == 0)
    else:
        model = zoo_models.build("llama")
    config = ds_configs.zero(3, MICRO_BATCH, 1, 1e-3, optimizer="AdamW", deepcompile=args.mode == "deepcompile",
                             clip=1.0, stage3_param_persistence_threshold=0)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.mode == "deepcompile":
        engine.compile()
    CASES[args.case](engine, device, report, args.mode, Counters())
    report["run"]["reached"] = "done"
    report.write()
    cancel_deadline()
    engine.destroy()


def on(device, batch):
    return {k: v.to(device) for k, v in batch.items()}


def train_at_each_ranks_lengths(lengths, engine, device, report, mode, counters):
    rec = report["run"] = dict(mode=mode, lengths=[], losses=[], grad_norms=[], graphs=[], reached="start")
    for step, length in enumerate(lengths[report["rank"]]):
        rec["reached"] = f"step {step}"
        report.write()
        loss = engine(**on(device, make_batch(step, length))).loss
        engine.backward(loss)
        engine.step()
        rec["lengths"].append(length)
        rec["losses"].append(loss.item())
        rec["grad_norms"].append(float(engine.get_global_grad_norm()))
        rec["graphs"].append(counters.snapshot()["graphs"])


def train_then_call_the_module(engine, device, report, mode, counters):
    train_length, eval_lengths = DIRECT[report["rank"]]
    rec = report["run"] = dict(mode=mode, eval_lengths=list(eval_lengths), eval_losses=[], graphs=[], reached="train")
    report.write()
    engine.backward(engine(**on(device, make_batch(0, train_length))).loss)
    engine.step()
    rec["graphs"].append(counters.snapshot()["graphs"])
    for i, length in enumerate(eval_lengths):
        rec["reached"] = f"evaluation {i}"
        report.write()
        with torch.no_grad():  # the Trainer's prediction_step calls the model, not the engine
            rec["eval_losses"].append(engine.module(**on(device, make_batch(1 + i, length))).loss.item())
        rec["graphs"].append(counters.snapshot()["graphs"])


CASES = {
    "recompile-together": functools.partial(train_at_each_ranks_lengths, LENGTHS),
    "calls-of-the-module": train_then_call_the_module,
    "padding-benchmarks-disagree": functools.partial(train_at_each_ranks_lengths, ONE_LENGTH),
}

if __name__ == "__main__":
    run_worker("dc-z3-ranks-recompile", main)
