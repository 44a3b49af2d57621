"""Worker for test_z3_release_memcheck.py: DeepCompile ZeRO-3 training steps to run under
compute-sanitizer memcheck (2 GPUs, torchrun). ZeRO-3 releases a gathered parameter by resizing its
storage to zero bytes while Inductor-generated code may still hold views of it; any read of such an
alias after the release is an out-of-bounds access memcheck reports.

Variants, all bf16 with odd parameter sizes (every shard padded on 2 ranks) and
stage3_param_persistence_threshold 0 (every parameter gathered and released):
* ``dense``: a chain of Linear layers in one compiled graph;
* ``moe_skipped``: a router and experts where the expert dispatch runs in a torch.compiler.disable'd
  frame (the ZeRO-3 eager fallback gathers and releases the experts there);
* ``tied_embedding``: an embedding whose weight is also the output projection;
* ``canary``: no training. Frees a tensor and then reads its memory through a pointer taken before:
  memcheck must report it, or a clean report above proves nothing.
Each rank writes its losses to $DIST_RESULT_DIR/rank<RANK>.json and prints when each phase ends.
"""

import argparse
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

HIDDEN = 515
VOCAB = 1001
EXPERTS = 4
BATCH = 8
SEQ = 16
STEPS = 3


class Dense(nn.Module):

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(4)])

    def forward(self, x, y):
        for layer in self.layers:
            x = torch.relu(layer(x))
        return F.mse_loss(x.float(), y.float())


class MoESkipped(nn.Module):

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(HIDDEN, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS)
        self.experts = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(EXPERTS)])
        self.out = nn.Linear(HIDDEN, HIDDEN)

    @torch.compiler.disable
    def dispatch(self, h, choice):
        out = torch.zeros_like(h)
        for i, expert in enumerate(self.experts):
            mask = choice == i
            out = out + expert(h) * mask.unsqueeze(-1).to(h.dtype)
        return out

    def forward(self, x, y):
        h = torch.relu(self.inp(x))
        choice = self.router(h).argmax(dim=-1)
        h = self.dispatch(h, choice)
        return F.mse_loss(self.out(h).float(), y.float())


class TiedEmbedding(nn.Module):

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.mid = nn.Linear(HIDDEN, HIDDEN)

    def forward(self, ids, labels):
        h = torch.relu(self.mid(self.embed(ids)))
        logits = F.linear(h, self.embed.weight)
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


MODELS = {"dense": Dense, "moe_skipped": MoESkipped, "tied_embedding": TiedEmbedding}
VARIANTS = sorted(MODELS) + ["canary"]
T0 = time.monotonic()


def phase(rank, what):
    print(f"[rank {rank} +{time.monotonic() - T0:.0f}s] {what}", flush=True)


class StaleAlias:
    """A device pointer kept past the free of its memory, as a kernel argument captured before a release
    would be (torch.as_tensor wraps it through the CUDA array interface, without a copy)."""

    def __init__(self, ptr, numel):
        self.__cuda_array_interface__ = {"data": (ptr, False), "shape": (numel, ), "typestr": "<f4", "version": 3}


def read_after_release(device):
    """Needs PYTORCH_NO_CUDA_MEMORY_CACHING=1, so that the free returns the memory to the driver."""
    gathered = torch.randn(HIDDEN * HIDDEN, device=device)
    alias = StaleAlias(gathered.data_ptr(), gathered.numel())
    del gathered
    return float(torch.as_tensor(alias, device=device).sum())


def batch(variant, rank, step, device):
    gen = torch.Generator().manual_seed(100 * rank + step)
    if variant == "tied_embedding":
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
        return ids.to(device), ids.roll(1, dims=-1).to(device)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=gen)
    return x.to(device, torch.bfloat16), (0.5 * x.roll(1, dims=-1)).to(device, torch.bfloat16)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    device = torch.device("cuda", torch.cuda.current_device())
    report = {"rank": rank, "variant": args.variant, "losses": [], "error": None}
    path = os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json")
    try:
        if args.variant == "canary":
            report["canary_sum"] = read_after_release(device)
            torch.cuda.synchronize()
            raise AssertionError("the read after the release went unnoticed")
        import deepspeed
        deepspeed.init_distributed()
        report["deepspeed_version"] = deepspeed.__version__
        phase(rank, "initialized")
        torch.manual_seed(0)
        model = MODELS[args.variant]()
        config = {
            "train_micro_batch_size_per_gpu": BATCH,
            "bf16": {
                "enabled": True
            },
            "optimizer": {
                "type": "Adam",
                "params": {
                    "lr": 1e-3,
                    "torch_adam": True
                }
            },
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {
                "stage": 3,
                "stage3_param_persistence_threshold": 0
            },
            "compile": {
                "deepcompile": True
            },
        }
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        engine.compile()
        for step in range(STEPS):
            loss = engine(*batch(args.variant, rank, step, device))
            engine.backward(loss)
            engine.step()
            report["losses"].append(loss.item())
            phase(rank, f"step {step} loss {report['losses'][-1]:.4f}")
        torch.cuda.synchronize()
        report["deepcompile_active"] = bool(engine.is_deepcompile_active())
    except BaseException:
        report["error"] = traceback.format_exc()
        print(f"[rank {rank}] worker failed:\n{report['error']}", file=sys.stderr, flush=True)
    with open(path, "w") as f:
        json.dump(report, f)
    if report["error"]:
        os._exit(1)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
