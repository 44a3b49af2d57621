"""Worker for tests/gpu/test_deepcompile_evaluation_before_training.py: the zoo's Llama (fp32) under ZeRO-1, -2 or -3,
eagerly or with DeepCompile, evaluated before its first training step as the Hugging Face Trainer evaluates with
eval_on_start: the model itself is called under no_grad (prediction_step calls the model, not the engine).

  python tests/gpu/workers/dc_evaluation_first.py --stage 3 --mode deepcompile     (one process, one GPU)

Plan (PLAN): evaluate, train, train at another length, evaluate, train. The report holds the evaluation and training
losses and each step's global gradient norm, and how far the plan got.
"""

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from against_eager_worker import engine_for_stage_and_mode, finish  # noqa: E402
from founding_common import run_worker  # noqa: E402
import zoo_models  # noqa: E402

MICRO_BATCH = 2
PLAN = (("evaluate", 40), ("train", 40), ("train", 48), ("evaluate", 44), ("train", 40))


def make_batch(index, length):
    return zoo_models.token_batch("llama", 4000 + index, MICRO_BATCH, length)


def main(report):
    args, device, engine = engine_for_stage_and_mode(report, MICRO_BATCH, 1)
    rec = report["run"] = dict(stage=args.stage, mode=args.mode, eval_losses=[], losses=[], grad_norms=[])
    for index, (op, length) in enumerate(PLAN):
        rec["reached"] = f"{op} {index}"
        report.write()
        batch = {k: v.to(device) for k, v in make_batch(index, length).items()}
        if op == "evaluate":
            engine.eval()
            with torch.no_grad():
                rec["eval_losses"].append(engine.module(**batch).loss.item())
            engine.train()
        else:
            loss = engine(**batch).loss
            engine.backward(loss)
            engine.step()
            rec["losses"].append(loss.item())
            rec["grad_norms"].append(float(engine.get_global_grad_norm()))
    finish(report, rec, engine)


if __name__ == "__main__":
    run_worker("dc-evaluation-first", main)
