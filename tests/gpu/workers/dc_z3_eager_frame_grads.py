"""Worker for test_deepcompile_z3_eager_frame_grads.py (run it with torchrun on 2 GPUs).

Trains one small bf16 model with ZeRO stage 3 twice on identical data, first eagerly (the
reference), then with DeepCompile, and reports the loss of every micro-batch, the global gradient
norm of every optimizer step, and the averaged gradient the optimizer holds for every parameter at
the first accumulation boundary. Every parameter is partitioned (stage3_param_persistence_threshold
0). The models use parameters where Dynamo compiles nothing, so their gradients come from eager
autograd in ``param.grad`` rather than from a compiled backward graph:

* ``bare_sequential``: the engine's module is an ``nn.Sequential``; Dynamo does not trace its
  forward (torch.nn code) at all.
* ``skipped_frame``: the middle layer runs in a ``torch.compiler.disable``'d function.
* ``loop_frame``: the middle layer runs in a function with a graph break inside a loop, which
  Dynamo skips as a whole while still compiling the frames it calls.
* ``tied``: the embedding lookup runs in a ``torch.compiler.disable``'d function and the output
  projection, in the compiled graph, reuses the embedding weight: one parameter gets one share of
  its gradient from the graph and one from eager autograd. Runs in fp32: in bf16 (2xH200) the tied weight's gradient
  matched eager ZeRO-3 within 1% but the compiled-only body's differed by 3.5-5.2% (bf16 rounding of a
  differently fused graph), over the test's tolerance.

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
VOCAB = 256
SEQ = 16
MICRO_BATCH = 8
GAS = 2
STEPS = 4  # optimizer steps; DeepCompile's ZeRO-3 schedule switches passes at step 5
LR = 1e-3
VARIANTS = ("bare_sequential", "skipped_frame", "loop_frame", "tied")


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


class LoopFrame(SkippedFrame):

    def run_middle(self, h):
        for _ in range(1):
            h = torch.relu(self.middle(h))
            torch._dynamo.graph_break()
        return h


class Tied(nn.Module):

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.body = nn.Linear(HIDDEN, HIDDEN)
        # Both shares of the embedding's gradient are of the same size (about 0.13 each at step 0).
        nn.init.normal_(self.embed.weight, std=0.05)

    @torch.compiler.disable
    def embed_tokens(self, ids):
        return self.embed(ids)

    def forward(self, ids, labels):
        h = self.embed_tokens(ids)
        h = h + torch.relu(self.body(h))
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


def make_model(variant):
    if variant == "bare_sequential":
        return nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, HIDDEN), nn.ReLU(),
                             nn.Linear(HIDDEN, HIDDEN))
    return {"skipped_frame": SkippedFrame, "loop_frame": LoopFrame, "tied": Tied}[variant]()


def ds_config(deepcompile, variant):
    return ds_configs.zero(3, MICRO_BATCH, GAS, LR, deepcompile=deepcompile, bf16=variant != "tied",
                           stage3_param_persistence_threshold=0, reduce_bucket_size=1_000_000)


def make_batch(variant, rank, index, device):
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    if variant == "tied":
        ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
        return ids.to(device), ((ids * 7 + 3) % VOCAB).to(device)
    x = torch.randn(MICRO_BATCH, HIDDEN, generator=gen)
    y = 0.5 * x.roll(1, dims=-1)
    return x.to(device, torch.bfloat16), y.to(device, torch.bfloat16)


def optimizer_grads(engine):
    """The averaged gradient the ZeRO-3 optimizer holds for each parameter (full, fp32; collective)."""
    return {
        name: engine.optimizer.get_fp32_grad_for_param(p).detach().float().clone()
        for name, p in engine.module.named_parameters()
    }


def train(variant, deepcompile, rank, device):
    import deepspeed
    torch.manual_seed(0)
    model = make_model(variant)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(deepcompile, variant))
    if deepcompile:
        engine.compile()
    rec = {
        "losses": [],
        "grad_norms": [],
        "deepcompile_active": bool(engine.is_deepcompile_active()),
        # Names of the parameters still holding a gradient in param.grad after each backward.
        "param_grad_left": [],
    }
    first_boundary_grads = None
    for index in range(STEPS * GAS):
        a, b = make_batch(variant, rank, index, device)
        if variant == "bare_sequential":
            loss = F.mse_loss(engine(a).float(), b.float())
        else:
            loss = engine(a, b)
        engine.backward(loss)
        rec["param_grad_left"].append(
            sorted(name for name, p in engine.module.named_parameters() if p.grad is not None))
        boundary = engine.is_gradient_accumulation_boundary()
        if boundary and first_boundary_grads is None:
            first_boundary_grads = optimizer_grads(engine)
        engine.step()
        rec["losses"].append(loss.item())
        if boundary:
            norm = engine.get_global_grad_norm()
            rec["grad_norms"].append(None if norm is None else float(norm))
    if deepcompile:
        rec["compiled_graphs"] = [list(entry[:3]) for entry in engine.get_compile_time()]
    engine.destroy()
    return rec, first_boundary_grads


def compare(got, ref):
    out = {}
    for name, want in ref.items():
        diff = got[name] - want
        out[name] = {
            "rel_err": (diff.norm() / want.norm().clamp_min(1e-12)).item(),
            "norm": got[name].norm().item(),
            "ref_norm": want.norm().item(),
        }
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    import deepspeed
    deepspeed.init_distributed(dist_backend="nccl")

    report = {
        "rank": rank,
        "variant": args.variant,
        "error": None,
        "reached": "start",
        "deepspeed_version": deepspeed.__version__,
        "torch_version": torch.__version__
    }
    path = os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json")
    try:
        grads = {}
        for name, deepcompile in (("eager", False), ("deepcompile", True)):
            report["reached"] = name
            report[name], grads[name] = train(args.variant, deepcompile, rank, device)
            torch.cuda.empty_cache()
        report["grad_compare"] = compare(grads["deepcompile"], grads["eager"])
        report["reached"] = "done"
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
