"""Worker of tests/test_zero_compile_diff.py: plain `engine.compile()` (torch.compile, no DeepCompile) under eager
ZeRO, reached as users reach it: Hugging Face's Trainer with `torch_compile=True` and a DeepSpeed config dict
(accelerate then calls `engine.compile(backend=...)`).

Runs with whichever deepspeed is importable (the fork installed here, or upstream 0.19.8 first on PYTHONPATH), one
process per rank (tests/gpu/dist.py), DeepSpeed's CPU accelerator with gloo (DS_ACCELERATOR=cpu). Per cell (a ZeRO
stage): the zoo's Llama (tests/gpu/zoo_models.py, random weights from seed 0, built after TrainingArguments so that
ZeRO-3 builds it under zero.Init), bf16, gradient accumulation 2, clipping 1.0, STEPS optimizer steps over batches
padded to their longest row (rows of 6 to 40 tokens: the compiled forward meets a new sequence length after its
first batch), an evaluation after step EVAL_STEPS (the Trainer calls the compiled module itself there, not through
the engine's forward).

Recorded as tests/gpu/workers/zero_diff.py records a cell, so that tools/zero-diff's comparison applies: the loss of
every training micro-batch (float.hex, as compute_loss returned it), per optimizer step the gradient norm the Trainer
logged (engine.get_global_grad_norm), the evaluation losses, and a sha256 prefix of every final parameter's bytes
(ZeRO-3 gathered); besides, the sequence lengths of the micro-batches, whether the engine says it is compiled and
Dynamo's count of frames it compiled (so that a run that never compiled cannot pass for one that did).

  python tests/cpu_workers/zero_compile_diff.py --stages 1 3 [--backend inductor] [--perturb STAGE] [--control STAGE]
                                                [--deadline S]

--perturb STAGE raises that cell's learning rate by 2**-10 of itself (the control: it must differ). --control STAGE
runs, after the cells of --stages, that stage's cell once more so perturbed, recorded as the cell `control` (the
control in the process of the cells, instead of a process of its own). A cell that raises records its exception and
the next one runs.
"""

import argparse
import os
import sys
import tempfile
import time
import traceback

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "gpu", "workers"), os.path.join(TESTS, "gpu")]
from founding_common import run_worker, stacks_at_deadline, cancel_deadline  # noqa: E402
import zero_diff  # noqa: E402  (its digest and float.hex of a record)
import zoo_models  # noqa: E402
from zoo_trainer import pad_to_longest  # noqa: E402

STEPS = 3
GRAD_ACCUM = 2
MICRO_BATCH = 2
EVAL_STEPS = 2
LR = 1e-3


def rows(n, seed, lo=6, hi=40):
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(lo, hi + 1, (1, ), generator=gen))
        out.append({"input_ids": torch.randint(3, zoo_models.vocab_size("llama"), (length, ), generator=gen).tolist()})
    return out


def ds_config(stage):
    zero = {"stage": stage, "overlap_comm": True, "contiguous_gradients": True}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {
        "zero_optimization": zero,
        "bf16": {"enabled": "auto"},
        "train_micro_batch_size_per_gpu": "auto",
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "steps_per_print": 10**9,
    }


def run_cell(stage, backend, perturb):
    import deepspeed
    import torch._dynamo
    from torch._dynamo.utils import counters
    from transformers import Trainer, TrainingArguments

    torch._dynamo.reset()
    counters.clear()
    losses, lengths = [], []

    class Recording(Trainer):

        def compute_loss(self, model, inputs, *args, **kwargs):
            loss = super().compute_loss(model, inputs, *args, **kwargs)
            if model.training:
                value = loss[0] if isinstance(loss, tuple) else loss
                losses.append(zero_diff.hexf(value.detach().float().item()))
                lengths.append(int(inputs["input_ids"].shape[1]))
            return loss

    with tempfile.TemporaryDirectory(prefix="zero_compile_diff_") as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=MICRO_BATCH, per_device_eval_batch_size=2,
                                 gradient_accumulation_steps=GRAD_ACCUM, max_steps=STEPS, eval_strategy="steps",
                                 eval_steps=EVAL_STEPS, logging_steps=1, max_grad_norm=1.0,
                                 learning_rate=LR * (1 + 2**-10) if perturb else LR, bf16=True, torch_compile=True,
                                 torch_compile_backend=backend, deepspeed=ds_config(stage), report_to=[],
                                 save_strategy="no", seed=0, dataloader_num_workers=0, use_cpu=True)
        torch.manual_seed(0)
        model = zoo_models.build("llama")
        trainer = Recording(model=model, args=args, train_dataset=rows(STEPS * GRAD_ACCUM * MICRO_BATCH, 1),
                            eval_dataset=rows(2, 2), data_collator=pad_to_longest)
        trainer.train()
    engine = trainer.model_wrapped
    logged = [h for h in trainer.state.log_history if "loss" in h]
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=stage == 3):
        digests = {name: zero_diff.digest(p) for name, p in params.items()}
    return {
        "losses": losses,
        "eval_losses": [zero_diff.hexf(h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h],
        "steps": [{"grad_norm": zero_diff.hexf(h.get("grad_norm")), "loss_scale": None, "skipped": 0} for h in logged],
        "params": digests,
        "lengths": lengths,
        "engine_compiled": bool(getattr(engine, "is_compiled", False)),
        "compiled_frames": int(counters["frames"]["ok"]),
        "global_steps": int(engine.global_steps),
    }


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", nargs="+", type=int, required=True)
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--perturb", type=int, default=None)
    parser.add_argument("--control", type=int, default=None)
    parser.add_argument("--deadline", type=float, default=300)
    args = parser.parse_args()
    stacks_at_deadline(args.deadline)
    import transformers

    zero_diff.start_run(report, transformers_version=transformers.__version__, backend=args.backend)
    cells = [(f"z{stage}", stage, args.perturb == stage) for stage in args.stages]
    if args.control is not None:
        cells.append(("control", args.control, True))
    for name, stage, perturb in cells:
        report["cells"][name] = {"reached": "start"}
        report.write()
        start = time.time()
        try:
            rec = run_cell(stage, args.backend, perturb)
        except Exception as exc:
            rec = {"error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()[-3000:]}
        rec["seconds"] = round(time.time() - start, 1)
        report["cells"][name] = rec
        report.write()
    cancel_deadline()


if __name__ == "__main__":
    run_worker("zero_compile_diff", main, hard_exit=True)
