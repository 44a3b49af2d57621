"""Worker for test_model_zoo.py: the Hugging Face Trainer as DeepSpeed's client, as a user runs it.

  python tests/gpu/workers/zoo_trainer.py --stage 3 --mode deepcompile --out DIR

The zoo's Llama (built after TrainingArguments, so ZeRO-3 builds it under zero.Init as the Trainer's users get it),
a tiny in-memory dataset of sequences of 32-128 tokens padded to the longest in each batch, bf16,
gradient accumulation 2, 8 optimizer steps with an evaluation every 3, `torch_compile=True` (accelerate then calls
`engine.compile()`), and HF's "auto" DeepSpeed config; mode `deepcompile` adds `"compile": {"deepcompile": true}`,
mode `compile` is plain torch.compile of the same run, mode `eager` the same run without torch_compile (the zoo's
reference). Records the wall time of `trainer.train()` (compiles included; tools/bench-trainer compares it across
modes), the logged losses, Dynamo graphs compiled and DeepCompile profiling runs; with ZOO_TRAINER_PHASES=1 also the
seconds of each compile phase (compile_phases.py). ZOO_TRAINER_PAD_MULTIPLE=8 pads each batch to the next multiple of 8
instead (a collator's `pad_to_multiple_of`). ZOO_TRAINER_EVAL_ON_START=1 evaluates once before the first training step
(`eval_on_start`): the Trainer's evaluation calls the model itself, so that call reaches DeepCompile before any call
of the engine's forward.
"""

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline, cancel_deadline  # noqa: E402
from zoo_cell import COMPILE_OPTIONS, Counters  # noqa: E402
import zoo_models  # noqa: E402

MAX_STEPS = 8
EVAL_STEPS = 3
PAD_MULTIPLE = int(os.environ.get("ZOO_TRAINER_PAD_MULTIPLE", "1"))
EVAL_ON_START = os.environ.get("ZOO_TRAINER_EVAL_ON_START", "0") == "1"


def dataset(n, seed):
    gen = torch.Generator().manual_seed(seed)
    vocab = zoo_models.vocab_size("llama")
    rows = []
    for _ in range(n):
        length = int(torch.randint(32, 129, (1, ), generator=gen))
        rows.append({"input_ids": torch.randint(3, vocab, (length, ), generator=gen).tolist()})
    return rows


def pad_to_longest(rows):
    longest = -(-max(len(r["input_ids"]) for r in rows) // PAD_MULTIPLE) * PAD_MULTIPLE
    ids = torch.zeros(len(rows), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, :len(r["input_ids"])] = torch.tensor(r["input_ids"])
        mask[i, :len(r["input_ids"])] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    ap.add_argument("--mode", required=True, choices=["eager", "compile", "deepcompile"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--deadline", type=float, default=400)
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)

    import transformers
    from transformers import Trainer, TrainingArguments

    setup_device()
    describe(report)
    report["transformers_version"] = transformers.__version__
    report.update(stage=args.stage, mode=args.mode, pad_multiple=PAD_MULTIPLE, eval_on_start=EVAL_ON_START)
    rec = report["cell"] = dict(reached="start")
    ds = {
        "bf16": {
            "enabled": "auto"
        },
        "zero_optimization": {
            "stage": args.stage,
            "stage3_param_persistence_threshold": 0
        },
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 1_000_000_000,
    }
    if args.mode == "deepcompile":
        ds["compile"] = {"deepcompile": True, **COMPILE_OPTIONS}
    targs = TrainingArguments(output_dir=args.out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                              gradient_accumulation_steps=2, max_steps=MAX_STEPS, eval_strategy="steps",
                              eval_steps=EVAL_STEPS, eval_on_start=EVAL_ON_START, logging_steps=1, learning_rate=1e-3,
                              bf16=True, torch_compile=args.mode != "eager",
                              deepspeed=ds, report_to=[], save_strategy="no", seed=0, dataloader_num_workers=0)
    torch.manual_seed(0)
    model = zoo_models.build("llama")
    trainer = Trainer(model=model, args=targs, train_dataset=dataset(64, 1), eval_dataset=dataset(6, 2),
                      data_collator=pad_to_longest)
    counters = Counters()
    phases = None
    if os.environ.get("ZOO_TRAINER_PHASES"):
        import compile_phases
        phases = compile_phases.install()
    rec["recompile_reasons"] = []
    counters.capture_recompile_reasons(rec["recompile_reasons"])
    rec["reached"] = "train"
    report.write()
    start = time.time()
    trainer.train()
    rec["train_s"] = round(time.time() - start, 1)
    rec["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    rec["eval_losses"] = [h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h]
    rec["compiles"] = counters.snapshot()
    if phases is not None:
        rec["phases"] = phases.snapshot()
    rec["reached"] = "done"
    report.write()
    cancel_deadline()


if __name__ == "__main__":
    run_worker("model-zoo-trainer", main)
