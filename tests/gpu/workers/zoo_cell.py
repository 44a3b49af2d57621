"""Worker for test_model_zoo.py: one zoo cell (model x ZeRO stage x mode) through the loop a Trainer user runs.

  python tests/gpu/workers/zoo_cell.py --model llama --stage 3 --mode deepcompile --ckpt DIR [--phase resume]
  python tests/gpu/workers/zoo_cell.py --model llama --stage 1,2,3 --mode eager --ckpt DIR   (the three in turn)
  torchrun --nproc-per-node 2 tests/gpu/workers/zoo_cell.py ...                            (the same cell on 2 ranks)

A stage is 1, 2 or 3, or ZeRO-2 with its gradient-reduction options changed: `2+oc` (overlap_comm on), `2-cg`
(contiguous_gradients off), `2+oc-cg`; plain `2` leaves both at DeepSpeed's defaults.

Modes: `eager` (the reference), `compile` (`engine.compile()` without DeepCompile: the spread that sets the loss
tolerance), `deepcompile` (`"compile": {"deepcompile": true}` and `engine.compile()`).

The loop, bf16, AdamW, gradient accumulation 2, gradient clipping 1.0 (ZOO_GRAD_ACC and ZOO_CLIP change those two
for diagnosis; the zoo runs the defaults), every micro-batch a new sequence length
with right padding in its second row (as a collator that pads to the longest sequence gives); on several ranks each
rank's micro-batch has a length and a padding of its own in the same step (as each rank's collator gives it):
  train   3 optimizer steps
  eval    engine.eval(): 4 batches under torch.no_grad() with labels, 1 under torch.inference_mode() without labels
          (logits), then engine.train()
  abandon one forward whose loss is never backpropagated
  train   3 optimizer steps, then save_checkpoint
  after   2 optimizer steps (the losses a resumed engine must give)
  generate  greedy generate() with the KV cache (a prefill and one decoding step)
Phase `resume` (a new process, as a user resumes): a fresh engine from a differently seeded model, compiled,
load_checkpoint, then the `after` steps.

Recorded per micro-batch: loss, sequence length, Dynamo graphs compiled so far and DeepCompile profiling runs so far;
allocated memory before each optimizer step; the global gradient norm of each step (before clipping); ZeRO-3
parameters left gathered after each step; seconds per phase; the errors of the backward compiles AOTAutograd dropped.
The report holds one record per stage under "cells" (several stages: eager references, which compile nothing, run
in one process to save its start-up). The rank writes its JSON report to $DIST_RESULT_DIR/rank<RANK>.json after
every phase, so a cell that dies leaves its progress. A deadline prints every thread's stack and exits
if the cell hangs.
"""

import argparse
import gc
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline, cancel_deadline  # noqa: E402
import ds_configs  # noqa: E402
import zoo_models  # noqa: E402

MICRO_BATCH = 2
GRAD_ACC = int(os.environ.get("ZOO_GRAD_ACC", "2"))
# Small enough that training is smooth: at 1e-2 the zoo's Llama spiked at its sixth step (eager ZeRO too, loss 3.55 ->
# 5.86 -> 2.99) and the size of the spike followed rounding, so no tolerance could tell a defect from chaos.
LR = 1e-3
TRAIN_STEPS, TRAIN2_STEPS, AFTER_STEPS = 3, 3, 2
# Under no_grad, the first length compiles a static graph and the second a dynamic one; with activation
# checkpointing the frames that training never ran (it ran them checkpointed) are first compiled at the second
# length and become dynamic at the third. The fourth must compile nothing.
EVAL_BATCHES = 4
# One length per micro-batch, none a multiple of 8: Inductor specializes on divisibility by 8 (alignment), for plain
# torch.compile and DeepCompile alike, and the zoo counts compiles caused by new lengths, not by alignment. Rank r of
# W takes entry index * W + r: one rank keeps the first lengths, several never share one. Up to 239: enough for every
# micro-batch of plan() at 8 ranks, within the zoo models' 256 positions.
LENGTHS = [n for n in range(33, 240) if n % 8]
RANK, WORLD = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
# Options added to DeepCompile's `compile` section of every DeepCompile cell and Trainer run (test_model_zoo.py).
COMPILE_OPTIONS = json.loads(os.environ.get("ZOO_COMPILE", "{}"))
# ZeRO-2's gradient-reduction options a stage name may change (see the docstring).
ZERO2_OPTIONS = {"+oc": ("overlap_comm", True), "-cg": ("contiguous_gradients", False)}


def zero_stage(name):
    """(stage, zero_optimization options) of a stage name: "3" -> (3, {}), "2+oc-cg" -> (2, {overlap_comm: True,
    contiguous_gradients: False}); ValueError for anything else."""
    stage, rest, options = name[:1], name[1:], {}
    for flag, (key, value) in ZERO2_OPTIONS.items():
        if flag in rest:
            options[key] = value
            rest = rest.replace(flag, "", 1)
    if stage not in ("1", "2", "3") or rest or (options and stage != "2"):
        raise ValueError(f"stage {name!r}: 1, 2, 3, or 2 with +oc and/or -cg")
    return int(stage), options


def ds_config(stage, mode):
    stage, options = zero_stage(stage)
    return ds_configs.zero(stage, MICRO_BATCH, GRAD_ACC, LR, optimizer="AdamW", deepcompile=mode == "deepcompile",
                           clip=float(os.environ.get("ZOO_CLIP", "1.0")), stage3_param_persistence_threshold=0,
                           compile_options=COMPILE_OPTIONS, **options)


def make_batch(index, labels=True):
    """Micro-batch `index` of this rank: a length no other micro-batch of the cell has (on any rank), the second row
    right-padded."""
    key = index * WORLD + RANK
    length = LENGTHS[key]
    gen = torch.Generator().manual_seed(1000 + key)
    # Learnable rows: 16 tokens, each row a chain of one fixed bigram map, so losses fall fast from
    # ln(vocab) and a gradient that is lost or wrong shows in them.
    ids = torch.empty(MICRO_BATCH, length, dtype=torch.long)
    ids[:, 0] = torch.randint(0, 16, (MICRO_BATCH, ), generator=gen)
    for t in range(1, length):
        ids[:, t] = (5 * ids[:, t - 1] + 3) % 16
    ids += 3
    mask = torch.ones_like(ids)
    pad = 1 + key % 8
    mask[1, length - pad:] = 0
    ids[1, length - pad:] = 0
    batch = {"input_ids": ids, "attention_mask": mask}
    if labels:
        batch["labels"] = ids.masked_fill(mask == 0, -100)
    return batch


# Micro-batch indices of each phase; every index is a new sequence length.
def plan():
    train = list(range(0, TRAIN_STEPS * GRAD_ACC))
    n = len(train)
    evals = list(range(n, n + EVAL_BATCHES + 1))
    n += len(evals)
    abandon = n
    n += 1
    train2 = list(range(n, n + TRAIN2_STEPS * GRAD_ACC))
    n += len(train2)
    after = list(range(n, n + AFTER_STEPS * GRAD_ACC))
    return dict(train=train, eval=evals, abandon=abandon, train2=train2, after=after)


class Counters:
    """Dynamo graphs compiled and DeepCompile graph profiling runs, as running totals."""

    def __init__(self):
        import torch._dynamo.utils as dynamo_utils

        self.dynamo_utils = dynamo_utils
        self.profiling_runs = 0
        self.dropped_backward_compiles = []
        self._count_dropped_backward_compiles()
        try:
            import deepspeed.compile.backend as dc_backend
        except ImportError:
            return
        original = dc_backend.run_opt_passes

        def counted(*args, **kwargs):
            self.profiling_runs += 1
            return original(*args, **kwargs)

        dc_backend.run_opt_passes = counted

    def _count_dropped_backward_compiles(self):
        """AOTAutograd compiles a backward that saves symbolic sizes before its first run; where the backend fails
        there it logs a warning, drops that compile and compiles the backward again at its first run. Keep the
        errors (type and message)."""
        import logging

        dropped = self.dropped_backward_compiles

        class Keep(logging.Handler):

            def emit(self, record):
                if "failed to eagerly compile backwards" in record.getMessage():
                    err = record.exc_info[1] if record.exc_info else None
                    dropped.append(f"{type(err).__name__}: {err}"[:300] if err else record.getMessage())

        # where torch._logging stops the propagation of AOTAutograd's records
        logging.getLogger("torch._functorch._aot_autograd").addHandler(Keep())

    def capture_recompile_reasons(self, into, limit=12):
        """Keep the first `limit` reasons Dynamo logs for recompiling (TORCH_LOGS=recompiles)."""
        import logging

        class Keep(logging.Handler):

            def emit(self, record):
                msg = record.getMessage()
                if "ecompil" in msg and len(into) < limit:
                    into.append(msg[:600])

        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo").addHandler(Keep())

    def snapshot(self):
        stats = self.dynamo_utils.counters.get("stats", {})
        return {"graphs": int(stats.get("unique_graphs", 0)), "profiling_runs": self.profiling_runs}


def gathered_params(engine):
    """Names of ZeRO-3 parameters still gathered (persistent ones excepted)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        name for name, p in engine.module.named_parameters()
        if hasattr(p, "ds_status") and p.ds_status != ZeroParamStatus.NOT_AVAILABLE and not getattr(p, "ds_persist", False)
    ]


def new_engine(model_name, stage, mode, seed):
    import deepspeed

    torch.manual_seed(seed)
    model = zoo_models.build(model_name)
    params = [p for p in model.parameters() if p.requires_grad]
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=ds_config(stage, mode))
    if mode != "eager":
        engine.compile()
    return engine


def to(batch, device):
    return {k: v.to(device) for k, v in batch.items()}


def train_steps(engine, indices, device, rec, counters, report, phase):
    stage3 = engine.zero_optimization_stage() == 3
    for i in indices:
        rec["reached"] = f"{phase} micro-batch {i}"
        report.write()
        batch = make_batch(i)
        loss = engine(**to(batch, device)).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary:
            rec["mem_before_step"].append(torch.cuda.memory_allocated())
        engine.step()
        if boundary:
            norm = engine.get_global_grad_norm()
            rec["grad_norms"].append(None if norm is None else float(norm))
        rec["losses"].append(loss.item())
        rec["lengths"].append(batch["input_ids"].shape[1])
        rec["compiles"].append(counters.snapshot())
        if stage3 and boundary:
            rec["gathered_after_step"].append(len(gathered_params(engine)))


def evaluate(engine, indices, device, rec, counters, report):
    engine.eval()
    for j, i in enumerate(indices):
        rec["reached"] = f"eval batch {i}"
        report.write()
        if j < EVAL_BATCHES:
            with torch.no_grad():
                out = engine(**to(make_batch(i), device))
            rec["eval_losses"].append(out.loss.item())
        else:
            with torch.inference_mode():
                out = engine(**to(make_batch(i, labels=False), device))
            rec["eval_logits_mean_abs"] = out.logits.float().abs().mean().item()
        rec["eval_compiles"].append(counters.snapshot())
    engine.train()


def generate(engine, device, rec):
    engine.eval()
    prompt = make_batch(0, labels=False)
    ids = prompt["input_ids"][:1, :8].to(device)
    with torch.no_grad():
        out = engine.module.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=2,
                                     do_sample=False, use_cache=True)
    rec["generated"] = out[0, ids.shape[1]:].tolist()
    engine.train()


def run_cell(args, stage, device, report, counters, reasons):
    rec = report["cell"] = report["cells"][str(stage)] = dict(
        model=args.model, stage=stage, reached="start", losses=[], lengths=[], grad_norms=[], compiles=[],
        mem_before_step=[],
        gathered_after_step=[], eval_losses=[], eval_compiles=[], recompile_reasons=reasons, phase_s={},
        eval_no_grad_batches=EVAL_BATCHES, dropped_backward_compiles=counters.dropped_backward_compiles)
    steps = plan()
    start = phase_start = time.time()

    def phase_done(name):
        nonlocal phase_start
        now = time.time()
        rec["phase_s"][name] = round(now - phase_start, 1)
        phase_start = now

    ckpt = os.path.join(args.ckpt, f"z{stage}")
    if args.phase == "resume":
        engine = new_engine(args.model, stage, args.mode, seed=1)
        rec["reached"] = "load_checkpoint"
        report.write()
        engine.load_checkpoint(ckpt, tag="mid")
        phase_done("load")
        train_steps(engine, steps["after"], device, rec, counters, report, "after")
        phase_done("after")
    else:
        engine = new_engine(args.model, stage, args.mode, seed=0)
        rec["deepcompile_active"] = bool(getattr(engine, "is_deepcompile_active", lambda: False)())
        # blocks whose class compile_blocks_once made one with a nested compile region for forward (ZOO_COMPILE)
        rec["region_blocks"] = sum(hasattr(type(m), "compiled_once_from") for m in engine.module.modules())
        phase_done("engine")
        train_steps(engine, steps["train"], device, rec, counters, report, "train")
        phase_done("train")
        evaluate(engine, steps["eval"], device, rec, counters, report)
        phase_done("eval")
        rec["reached"] = "abandoned forward"
        report.write()
        engine(**to(make_batch(steps["abandon"]), device))  # loss never backpropagated
        rec["abandon_compiles"] = counters.snapshot()
        phase_done("abandon")
        train_steps(engine, steps["train2"], device, rec, counters, report, "train2")
        phase_done("train2")
        rec["reached"] = "save_checkpoint"
        report.write()
        engine.save_checkpoint(ckpt, tag="mid")
        phase_done("save")
        train_steps(engine, steps["after"], device, rec, counters, report, "after")
        phase_done("after")
        rec["reached"] = "generate"
        report.write()
        generate(engine, device, rec)
        phase_done("generate")
    rec["reached"] = "done"
    rec["seconds"] = round(time.time() - start, 1)
    report.write()
    engine.destroy()
    del engine
    gc.collect()
    torch.cuda.empty_cache()


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=sorted(zoo_models.ZOO))
    ap.add_argument("--stage", required=True, help="1, 2, 3, 2+oc, 2-cg or 2+oc-cg; eager cells may list several "
                    "(1,2,3), run in turn")
    ap.add_argument("--mode", required=True, choices=["eager", "compile", "deepcompile"])
    ap.add_argument("--phase", default="train", choices=["train", "resume"])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (written by train, read by resume)")
    ap.add_argument("--deadline", type=float, default=400, help="seconds before every stack is printed and the cell exits")
    args = ap.parse_args()
    stages = args.stage.split(",")
    try:
        [zero_stage(s) for s in stages]
    except ValueError as e:
        ap.error(str(e))
    if len(stages) > 1 and args.mode != "eager":
        ap.error(f"--stage {args.stage}: several stages only for eager cells (compiled cells would share one "
                 f"process's Dynamo caches)")
    stacks_at_deadline(args.deadline)

    device = setup_device()
    describe(report)
    import transformers
    report["transformers_version"] = transformers.__version__
    report.update(model=args.model, stages=stages, mode=args.mode, phase=args.phase, cells={})
    counters = Counters()
    reasons = []
    counters.capture_recompile_reasons(reasons)
    for stage in stages:
        run_cell(args, stage, device, report, counters, reasons)
    cancel_deadline()


if __name__ == "__main__":
    run_worker("model-zoo", main)
