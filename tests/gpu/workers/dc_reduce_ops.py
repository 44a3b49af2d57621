"""Worker for test_deepcompile_z1_bucket_reduction.py and test_deepcompile_bucket_division.py: the host ops of
DeepCompile's gradient reduction at ZeRO stage `--stage` (1 by default).

Trains a stack of `--layers` linear layers (fp32, torch's Adam) with eager ZeRO and with DeepCompile ZeRO on
identical data, reports every loss and every step's global gradient norm, and profiles one more DeepCompile step: how
many times DeepCompile's ops (`dc::reduce_grad`, `dc::end_backward`) call each aten op directly, so that the work of a
bucket's flush can be told from the work of a gradient.

Each rank writes a JSON report to $DIST_RESULT_DIR/rank<RANK>.json (founding_common.run_worker).
"""

import argparse
import collections
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline  # noqa: E402
import ds_configs  # noqa: E402

HIDDEN = 256
MICRO_BATCH = 4
GAS = 1  # accumulating micro-batches adds each gradient to the last one's, by design: one micro-batch a step
STEPS = 4
LR = 1e-3
DC_OPS = ("dc::reduce_grad", "dc::end_backward")


class Stack(nn.Module):

    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(layers))

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.mse_loss(x, y)


def make_batch(rank, index, device):
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=gen)
    return x.to(device), (0.5 * x.roll(1, dims=-1)).to(device)


def ops_called_by_deepcompile(prof):
    """{aten op: calls} made directly by DeepCompile's ops (nested calls of those ops not counted again)."""
    calls = collections.Counter()
    for event in prof.events():
        parent = event.cpu_parent
        if parent is not None and parent.name in DC_OPS:
            calls[event.name] += 1
    calls.update({name: 0 for name in DC_OPS})
    for event in prof.events():
        if event.name in DC_OPS:
            calls[event.name] += 1
    return dict(calls)


def train(stage, layers, deepcompile, rank, device):
    import deepspeed
    torch.manual_seed(0)
    model = Stack(layers)
    # ZeRO-3: every parameter partitioned, so that every gradient goes through DeepCompile's reduction
    options = {"stage3_param_persistence_threshold": 0} if stage == 3 else {}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=ds_configs.zero(stage, MICRO_BATCH, GAS, LR, deepcompile=deepcompile,
                                                                  bf16=False, **options))
    if deepcompile:
        engine.compile()
    rec = {"losses": [], "grad_norms": [], "deepcompile_active": bool(engine.is_deepcompile_active()),
           "params": sum(1 for _ in model.parameters())}

    def step(index):
        x, y = make_batch(rank, index, device)
        loss = engine(x, y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        return loss.item(), boundary

    for index in range(STEPS * GAS):
        loss, boundary = step(index)
        rec["losses"].append(loss)
        if boundary:
            rec["grad_norms"].append(float(engine.get_global_grad_norm()))
    if deepcompile:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for index in range(STEPS * GAS, (STEPS + 1) * GAS):
                step(index)
            torch.cuda.synchronize()
        rec["ops_of_one_step"] = ops_called_by_deepcompile(prof)
    engine.destroy()
    return rec


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--stage", type=int, default=1, choices=[1, 2, 3])
    parser.add_argument("--deadline", type=float, default=240)
    args = parser.parse_args()
    stacks_at_deadline(args.deadline)

    device = setup_device()
    describe(report)
    report["layers"], report["stage"] = args.layers, args.stage
    for name, deepcompile in (("eager", False), ("deepcompile", True)):
        report[name] = train(args.stage, args.layers, deepcompile, report["rank"], device)
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run_worker("dc_reduce_ops", main)
