"""Worker for test_deepcompile_grad_accumulation.py: the zoo's Llama (or --model, another zoo row) trained in fp32
with gradient accumulation, eagerly or under DeepCompile, reporting the global gradient norm of every optimizer step
and every loss, and how many parameters DeepCompile ZeRO-3 kept gathered.

  python tests/gpu/workers/dc_grad_accumulation.py --stage 1 --mode deepcompile --variant new_length_each_micro_batch

Variants (micro-batch lengths are what a collator that pads to the longest sequence of a batch produces):
  new_length_each_micro_batch  accumulation 2, every micro-batch a new length: the second micro-batch of the first
                               window runs a graph Dynamo recompiled (dynamic length), the first one a static graph
  same_length                  accumulation 2, one length throughout: one graph for every micro-batch
  past_warmup                  accumulation 1, a new length every step, 8 steps: past DeepCompile ZeRO-3's WARMUP
                               step (5), where every graph is compiled again with prefetching and selective gathering
  past_warmup_same_length      the same, one length throughout: static graphs, compiled again in place at WARMUP

fp32, so that DeepCompile and eager ZeRO agree to rounding and a lost or doubled micro-batch stands out. Also
records how many graphs Dynamo traced and Inductor lowered in each optimizer step
(test_deepcompile_lowers_only_the_last_cycle.py),
and with --profile-last-step how many times the last step called each of DeepCompile's ops (`dc::...`, as the
dispatcher records them for torch.profiler; test_deepcompile_z3_prefetches.py). --blocks compiles with
`compile_blocks_once` and counts DeepCompile's ops in the graphs handed to Inductor with the blocks
(test_deepcompile_blocks_lower_no_deepcompile_op_on_gpu.py).
DCGA_SCHEDULE (diagnosis only; the test does not set it) replaces DeepCompile ZeRO-3's schedule:
`recompile_only`, `prefetch`, `selective_gather` (each the WARMUP entry's extra pass).
"""

import argparse
import contextlib
import os
import re
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline, cancel_deadline  # noqa: E402
import compile_phases  # noqa: E402
import ds_configs  # noqa: E402
import zoo_models  # noqa: E402
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
from bench_step import SelectiveGatherLog  # noqa: E402

MICRO_BATCH = 2
LR = 1e-3
VARIANTS = {
    # name: (gradient accumulation steps, optimizer steps, lengths by micro-batch index)
    "new_length_each_micro_batch": (2, 3, lambda i: 33 + 3 * i),
    "same_length": (2, 3, lambda i: 37),
    "past_warmup": (1, 8, lambda i: 33 + 3 * i),
    "past_warmup_same_length": (1, 8, lambda i: 37),
}


def ds_config(stage, grad_acc, deepcompile, compile_options=None):
    return ds_configs.zero(stage, MICRO_BATCH, grad_acc, LR, optimizer="AdamW", deepcompile=deepcompile, bf16=False,
                           compile_options=compile_options, stage3_param_persistence_threshold=0)


def schedule(name):
    if not name:
        return None
    from deepspeed.compile.init_z3 import WARMUP
    from deepspeed.compile.passes import zero3_compile, prefetch, selective_gather

    extra = {"recompile_only": [], "prefetch": [prefetch.schedule_prefetch],
             "selective_gather": [selective_gather.selective_gather]}[name]
    return [(0, [zero3_compile.add_z3_gather_release]), (WARMUP, [zero3_compile.add_z3_gather_release] + extra)]


@contextlib.contextmanager
def _dc_op_calls(rec):
    """Count the calls of each of DeepCompile's ops inside the block into rec["dc_op_calls"]."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield
        torch.cuda.synchronize()
    rec["dc_op_calls"] = {e.key: e.count for e in prof.key_averages() if e.key.startswith("dc::")}


def make_batch(model, index, length):
    return zoo_models.token_batch(model, 2000 + index, MICRO_BATCH, length)


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    ap.add_argument("--mode", required=True, choices=["eager", "deepcompile"])
    ap.add_argument("--variant", required=True, choices=sorted(VARIANTS))
    ap.add_argument("--model", default="llama", choices=sorted(zoo_models.ZOO))
    ap.add_argument("--deadline", type=float, default=400)
    ap.add_argument("--profile-last-step", action="store_true")
    ap.add_argument("--blocks", action="store_true")
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)

    device = setup_device()
    describe(report)
    import deepspeed
    selective_gather = SelectiveGatherLog()

    grad_acc, steps, length_of = VARIANTS[args.variant]
    torch.manual_seed(0)
    model = zoo_models.build(args.model)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_config(args.stage, grad_acc, args.mode == "deepcompile",
                                                            {"compile_blocks_once": True} if args.blocks else None))
    if args.mode == "deepcompile":
        kwargs = {}
        if args.stage == 3 and os.environ.get("DCGA_SCHEDULE"):
            kwargs["schedule"] = schedule(os.environ["DCGA_SCHEDULE"])
        engine.compile(**kwargs)
    rec = report["run"] = dict(stage=args.stage, mode=args.mode, variant=args.variant, model=args.model, losses=[],
                               lengths=[],
                               grad_norms=[], deepcompile_active=bool(engine.is_deepcompile_active()),
                               inductor_graphs_by_step=[], dynamo_graphs_by_step=[])
    # Graphs handed to Inductor, and graphs Dynamo traced, summed per optimizer step.
    lowered = compile_phases.InductorGraphs()
    traced = compile_phases.DynamoGraphs()
    dc_ops_lowered = compile_phases.DeepCompileOpsLowered()
    for i in range(steps * grad_acc):
        batch = make_batch(args.model, i, length_of(i))
        last = i == steps * grad_acc - 1
        with _dc_op_calls(rec) if args.profile_last_step and last else contextlib.nullcontext():
            loss = engine(**{k: v.to(device) for k, v in batch.items()}).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
        rec["losses"].append(loss.item())
        rec["lengths"].append(batch["input_ids"].shape[1])
        if boundary:
            norm = engine.get_global_grad_norm()
            rec["grad_norms"].append(None if norm is None else float(norm))
            rec["inductor_graphs_by_step"].append(lowered.since_last())
            rec["dynamo_graphs_by_step"].append(traced.since_last())
            rec["dc_ops_lowered"] = dc_ops_lowered.count
            rec["kept_gathered"] = sum(
                int(m.group(1)) for line in selective_gather.lines
                for m in [re.search(r"selective_gather selected_count=(\d+)", line)] if m)
        report.write()
    cancel_deadline()
    engine.destroy()


if __name__ == "__main__":
    run_worker("dc-grad-accumulation", main)
