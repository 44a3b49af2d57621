"""Worker for tests/gpu/test_deepcompile_backward_ends_without_a_host_sync.py: the zoo's Llama (fp32) under ZeRO-1, -2
or -3, eagerly or with DeepCompile, trains STEPS steps of GRAD_ACC micro-batches each; from step WATCHED_FROM on (the
graphs compiled for good: DeepCompile ZeRO-3 compiles again at its sixth step), every backward runs under torch's
CUDA sync debug mode, which warns at each call that makes the host wait for the device.

  python tests/gpu/workers/dc_backward_host_syncs.py --stage 3 --mode deepcompile     (one process, one GPU)

The report holds each micro-batch's loss, each step's global gradient norm, each watched backward's host syncs, and
the Python stacks that made them.
"""

import argparse
import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline, cancel_deadline  # noqa: E402
import ds_configs  # noqa: E402
import zoo_models  # noqa: E402

MICRO_BATCH = 2
GRAD_ACC = 2
STEPS = 10
WATCHED_FROM = 7
LENGTH = 40


def syncs_of(call):
    """Run `call` in torch's sync debug mode "warn": (how many times it made the host wait for the device, the Python
    stacks that did, each once)."""
    seen = []
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")  # (a warning given while the mode is set is not counted)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            shown = warnings.showwarning

            def show(message, category, filename, lineno, file=None, line=None):
                if "synchroniz" in str(message):
                    seen.append("".join(traceback.format_stack(limit=14)[:-2]))
                else:
                    shown(message, category, filename, lineno, file, line)

            warnings.showwarning = show
            call()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return len(seen), sorted(set(seen))


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    ap.add_argument("--mode", required=True, choices=["eager", "deepcompile"])
    ap.add_argument("--deadline", type=float, default=400)
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)
    device = setup_device()
    describe(report)
    import deepspeed

    torch.manual_seed(0)
    model = zoo_models.build("llama")
    config = ds_configs.zero(args.stage, MICRO_BATCH, GRAD_ACC, 1e-3, optimizer="AdamW", bf16=False, clip=1.0,
                             deepcompile=args.mode == "deepcompile")
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if args.mode == "deepcompile":
        engine.compile()
    rec = report["run"] = dict(stage=args.stage, mode=args.mode, losses=[], grad_norms=[], syncs=[], sync_stacks=[])
    for step in range(STEPS):
        for micro in range(GRAD_ACC):
            rec["reached"] = f"step {step} micro-batch {micro}"
            report.write()
            batch = {k: v.to(device) for k, v in zoo_models.token_batch("llama", step * GRAD_ACC + micro, MICRO_BATCH,
                                                                        LENGTH).items()}
            loss = engine(**batch).loss
            if step >= WATCHED_FROM:
                count, stacks = syncs_of(lambda: engine.backward(loss))
                rec["syncs"].append(count)
                rec["sync_stacks"] += [s for s in stacks if s not in rec["sync_stacks"]]
            else:
                engine.backward(loss)
            engine.step()
            rec["losses"].append(loss.item())
        rec["grad_norms"].append(float(engine.get_global_grad_norm()))
    rec["reached"] = "done"
    report.write()
    cancel_deadline()
    engine.destroy()


if __name__ == "__main__":
    run_worker("dc-backward-host-syncs", main)
