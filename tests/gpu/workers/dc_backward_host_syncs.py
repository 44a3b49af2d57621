"""Worker for tests/gpu/test_deepcompile_backward_ends_without_a_host_sync.py: the zoo's Llama (fp32) under ZeRO-1, -2
or -3, eagerly or with DeepCompile, trains STEPS steps of GRAD_ACC micro-batches each; from step WATCHED_FROM on (the
graphs compiled for good: DeepCompile ZeRO-3 compiles again at its sixth step), every backward runs under torch's
CUDA sync debug mode, which warns at each call that makes the host wait for the device.

  python tests/gpu/workers/dc_backward_host_syncs.py --stage 3 --mode deepcompile     (one process, one GPU)

The report holds each micro-batch's loss, each step's global gradient norm, each watched backward's host syncs, and
the Python stacks that made them.
"""

import os
import sys
import traceback
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from against_eager_worker import engine_for_stage_and_mode, finish  # noqa: E402
from founding_common import run_worker  # noqa: E402
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
    args, device, engine = engine_for_stage_and_mode(report, MICRO_BATCH, GRAD_ACC, clip=1.0)
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
    finish(report, rec, engine)


if __name__ == "__main__":
    run_worker("dc-backward-host-syncs", main)
