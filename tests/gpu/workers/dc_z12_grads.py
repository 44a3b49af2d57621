"""Worker for test_deepcompile_z12_grads.py (run it with torchrun on 2 GPUs).

Trains one small bf16 model with ZeRO stage 1 or 2 twice on identical data, first eagerly (the
reference), then with DeepCompile, and reports the loss of every micro-batch and the global
gradient norm of every optimizer step. The models put parameters where DeepCompile ZeRO-1/2 used
to lose their gradients:

* ``bare_sequential``: the engine's module is an ``nn.Sequential``; Dynamo does not trace its
  forward at all, so every gradient is an eager one.
* ``skipped_frame``: the middle layer runs in a ``torch.compiler.disable``'d function.
* ``tied_across_graph_break``: one weight is used in the graphs on both sides of a graph break.

Each rank writes a JSON report to $DIST_RESULT_DIR/rank<RANK>.json.
"""

import argparse
import json
import os
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import ds_configs

HIDDEN = 512
MICRO_BATCH = 8
GAS = 2
STEPS = 4
LR = 1e-3


class SkippedFrame(nn.Module):

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.middle = nn.Linear(HIDDEN, HIDDEN)
        self.last = nn.Linear(HIDDEN, HIDDEN)

    @torch.compiler.disable
    def run_middle(self, h):
        return torch.relu(self.middle(h))

    def forward(self, x, y):
        h = self.run_middle(torch.relu(self.first(x)))
        return F.mse_loss(self.last(h).float(), y.float())


class TiedAcrossGraphBreak(nn.Module):

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(HIDDEN, HIDDEN)
        self.middle = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x, y):
        h = torch.relu(self.first(x))
        torch._dynamo.graph_break()
        h = torch.relu(self.middle(h))
        # first.weight again, in the second graph
        return F.mse_loss(F.linear(h, self.first.weight).float(), y.float())


def make_model(variant):
    if variant == "bare_sequential":
        return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, HIDDEN))
    return {"skipped_frame": SkippedFrame, "tied_across_graph_break": TiedAcrossGraphBreak}[variant]()


def ds_config(stage, deepcompile):
    return ds_configs.zero(stage, MICRO_BATCH, GAS, LR, deepcompile=deepcompile)


def make_batch(rank, index, device):
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=gen)
    y = 0.5 * x.roll(1, dims=-1)
    return x.to(device, torch.bfloat16), y.to(device, torch.bfloat16)


def train(stage, variant, deepcompile, rank, device):
    import deepspeed
    torch.manual_seed(0)
    model = make_model(variant)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(stage, deepcompile))
    if deepcompile:
        engine.compile()
    rec = {"losses": [], "grad_norms": [], "deepcompile_active": bool(engine.is_deepcompile_active())}
    for index in range(STEPS * GAS):
        x, y = make_batch(rank, index, device)
        if variant == "bare_sequential":
            loss = F.mse_loss(engine(x).float(), y.float())
        else:
            loss = engine(x, y)
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        rec["losses"].append(loss.item())
        if boundary:
            norm = engine.get_global_grad_norm()
            rec["grad_norms"].append(None if norm is None else float(norm))
    engine.destroy()
    return rec


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True, choices=[1, 2])
    parser.add_argument("--variant", required=True)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    import deepspeed
    deepspeed.init_distributed()

    report = {"rank": rank, "stage": args.stage, "variant": args.variant, "error": None,
              "deepspeed_version": deepspeed.__version__, "torch_version": torch.__version__}
    path = os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json")
    try:
        for name, deepcompile in (("eager", False), ("deepcompile", True)):
            report[name] = train(args.stage, args.variant, deepcompile, rank, device)
            torch.cuda.empty_cache()
    except BaseException:
        report["error"] = traceback.format_exc()
        with open(path, "w") as f:
            json.dump(report, f, indent=1)
        print(f"[rank {rank}] worker failed:\n{report['error']}", file=sys.stderr, flush=True)
        os._exit(1)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
