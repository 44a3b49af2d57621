"""Worker for test_deepcompile_z3_skipped_frames.py (run it with torchrun on 2 GPUs).

ZeRO-3 with DeepCompile, parameters used in frames Dynamo skips. Every job trains the same bf16 model twice on
identical data, first with eager ZeRO-3 (the reference), then with DeepCompile ZeRO-3, and reports per rank:

job "peak"      LAYERS Block modules (Linear(H, H) + ReLU, residual) called from a torch.compiler.disable'd
                function between two compiled LayerNorms. Per step: allocated bytes at the start, the peak of
                forward + backward above it (torch.cuda.max_memory_allocated), full gradients after the first
                backward (assembled from the gradient partitions the optimizer reads), losses.
job "abandon"   the "peak" model plus a weight the skipped function reads directly (outside a module forward).
                Between training steps: forwards whose output requires grad but whose backward never comes
                (the loss is dropped), one after engine.eval() with grad enabled, one under torch.no_grad().
                Allocated bytes and the parameters left gathered after every operation, losses.
job "tied"      one Linear used in the skipped function (called as a module) and again, after it, in a compiled
                region; gradient accumulation 2. Full gradients after every optimizer-step boundary, losses.
                In fp32: from the second boundary on the two runs compare gradients at their own weights, and bf16
                weights that rounded differently after one step differ by whole ulps (gradients then differ by
                several percent for every parameter, tied or not).
job "loop"      the skipped frame is skipped because of a graph break inside a loop; it reads the weights
                directly. Losses, full gradients after the first backward.

Each rank writes its JSON report to $DIST_RESULT_DIR/rank<RANK>.json, rewritten after every phase, so a rank that
dies leaves the phase it reached.
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

import ds_configs

HIDDEN = 4096
LAYERS = 8
MICRO_BATCH = 4
SEQ = 16
LR = 1e-3
STEPS = 4  # DeepCompile's ZeRO-3 schedule switches passes at step 5 (WARMUP); stay below it
# Eager ZeRO-3: gradients go to a preallocated bucket of one layer, so they are freed as they arrive.
EAGER_REDUCE_BUCKET = HIDDEN * HIDDEN
# DeepCompile allocates its reduce bucket in the backward; the compiled regions only reduce LayerNorm gradients.
DC_REDUCE_BUCKET = 1_000_000
GRAD_COMPARE_ELEMS = 1 << 20  # of each full gradient, enough to tell a reduced gradient from a missing one


class Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, h):
        return h + torch.relu(self.fc(h))


class Net(nn.Module):

    def __init__(self, job):
        super().__init__()
        self.job = job
        self.norm_in = nn.LayerNorm(HIDDEN)
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS if job in ("peak", "abandon") else 2)])
        if job == "abandon":
            self.mix = nn.Linear(HIDDEN, HIDDEN, bias=False)
        if job == "tied":
            self.shared = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.norm_out = nn.LayerNorm(HIDDEN)

    @torch.compiler.disable
    def skipped(self, h):
        for block in self.blocks:
            h = block(h)
        if self.job == "abandon":
            # Read directly: no module forward of its own scopes this use.
            h = h + F.linear(h, self.mix.weight)
        if self.job == "tied":
            h = h + torch.relu(self.shared(h))
        return h

    def skipped_by_loop(self, h):
        # A graph break inside a loop: Dynamo skips this whole frame and runs it eagerly.
        for block in self.blocks:
            h = h + torch.relu(F.linear(h, block.fc.weight))
            torch._dynamo.graph_break()
        return h

    def forward(self, x, y):
        h = self.norm_in(x)
        h = self.skipped_by_loop(h) if self.job == "loop" else self.skipped(h)
        if self.job == "tied":
            # The same weight again, now in a compiled region (after its skipped use).
            h = h + F.linear(h, self.shared.weight)
        h = self.norm_out(h)
        return F.mse_loss(h.float(), y.float())


# (operation, batch index). "train" is one micro-batch: forward, backward, engine.step().
PLANS = {
    "peak": [("train", i) for i in range(STEPS)],
    "abandon": [("train", 0), ("train", 1), ("abandon", 2), ("train", 3), ("abandon", 4), ("abandon", 5),
                ("abandon", 6), ("abandon", 7), ("eval_grad", 8), ("no_grad", 9), ("train", 10)],
    "tied": [("train", i) for i in range(6)],
    "loop": [("train", i) for i in range(3)],
}
GAS = {"peak": 1, "abandon": 1, "tied": 2, "loop": 1}


def dtype_of(job):
    return torch.float32 if job == "tied" else torch.bfloat16


def make_batch(rank, index, device, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(1000 * (rank + 1) + index)
    x = torch.randn(MICRO_BATCH, SEQ, HIDDEN, generator=gen)
    y = 0.5 * x.roll(1, dims=-1)
    return x.to(device, dtype), y.to(device, dtype)


def ds_config(job, deepcompile):
    # Eager ZeRO-3 at its leanest: no prefetch, release every parameter after its use.
    return ds_configs.zero(3, MICRO_BATCH, GAS[job], LR, deepcompile=deepcompile, bf16=dtype_of(job) == torch.bfloat16,
                           stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=0,
                           stage3_max_reuse_distance=0,
                           reduce_bucket_size=DC_REDUCE_BUCKET if deepcompile else EAGER_REDUCE_BUCKET)


def gathered(module):
    """Names of parameters holding gathered data (DeepCompile makes none persistent)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [
        name for name, p in module.named_parameters()
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.data.numel() != 0
    ]


def full_grads(module):
    """The full gradients the optimizer will use: assembled from the ZeRO-3 gradient partitions (not from a
    param.grad eager autograd may have left on the parameter, which safe_get_full_grad would return)."""
    out = {}
    for name, p in module.named_parameters():
        g = p._z3_optimizer.get_fp32_grad_for_param(p)
        if g is None:
            out[name] = None
            continue
        flat = g.detach().float().flatten()
        # A strided sample covers every rank's partition.
        out[name] = flat[::max(1, flat.numel() // GRAD_COMPARE_ELEMS)].cpu()
    return out


class Reporter:

    def __init__(self, path, payload):
        self.path = path
        self.payload = payload

    def write(self):
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.payload, f, indent=1)
        os.replace(tmp, self.path)


def run(job, deepcompile, rank, device, rec, reporter):
    import deepspeed

    torch.manual_seed(0)
    model = Net(job)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(job, deepcompile))
    if deepcompile:
        engine.compile()
        rec["deepcompile_active"] = bool(engine.is_deepcompile_active())
    grads = []
    for op, index in PLANS[job]:
        rec["reached"] = f"{op} {index}"
        reporter.write()
        x, y = make_batch(rank, index, device, dtype_of(job))
        torch.cuda.synchronize()
        gc.collect()
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if op == "train":
            boundary = engine.is_gradient_accumulation_boundary()
            loss = engine(x, y)
            torch.cuda.synchronize()
            fwd_peak = torch.cuda.max_memory_allocated()
            engine.backward(loss)
            torch.cuda.synchronize()
            step_peak = torch.cuda.max_memory_allocated()
            # Full-size gradients left on parameters: nothing reduced them into their partitions.
            rec["left_grads"].append([n for n, p in engine.module.named_parameters() if p.grad is not None])
            rec["steps"].append({
                "index": index,
                "alloc_start": start,
                "fwd_peak_above_start": fwd_peak - start,
                "peak_above_start": step_peak - start,
                "alloc_after_backward": torch.cuda.memory_allocated(),
            })
            if boundary and (job != "peak" or not grads):
                grads.append(full_grads(engine.module))
            engine.step()
            rec["train_losses"].append(loss.item())
            del loss
        elif op in ("abandon", "eval_grad"):
            if op == "eval_grad":
                engine.eval()
            loss = engine(x, y)
            rec["abandoned_requires_grad"].append(bool(loss.requires_grad))
            rec["eval_losses"].append(loss.item())
            del loss
            if op == "eval_grad":
                engine.train()
        elif op == "no_grad":
            with torch.no_grad():
                rec["eval_losses"].append(engine(x, y).item())
        else:
            raise ValueError(op)
        torch.cuda.synchronize()
        gc.collect()
        rec["after_op"].append({
            "op": f"{op} {index}",
            "allocated": torch.cuda.memory_allocated(),
            "gathered": gathered(engine.module),
        })
    if deepcompile:
        fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
        stats = fallback.stats() if fallback is not None else {}
        rec["fallback_totals"] = {k: v for k, v in stats.items() if k.startswith("total_")}
        from torch._dynamo.utils import counters
        rec["graph_breaks"] = sorted(str(k).splitlines()[0][:120] for k in counters["graph_break"])
    rec["reached"] = "done"
    reporter.write()
    engine.destroy()
    return grads


def compare_grads(ref, got):
    out = []
    for step, (a, b) in enumerate(zip(ref, got)):
        row = {}
        for name, ga in a.items():
            gb = b.get(name)
            if ga is None or gb is None:
                row[name] = {"missing": [ga is None, gb is None]}
                continue
            ref_norm = ga.norm().item()
            row[name] = {
                "rel_err": (gb - ga).norm().item() / max(ref_norm, 1e-30),
                "ref_norm": ref_norm,
                "norm": gb.norm().item(),
            }
        out.append(row)
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--job", required=True, choices=sorted(PLANS))
    args = parser.parse_args()

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)

    import deepspeed
    deepspeed.init_distributed()

    layer_bytes = HIDDEN * HIDDEN * 2
    payload = {
        "rank": rank,
        "world_size": int(os.environ["WORLD_SIZE"]),
        "job": args.job,
        "deepspeed_version": deepspeed.__version__,
        "deepspeed_file": deepspeed.__file__,
        "torch_version": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "hidden": HIDDEN,
        "layers": len(Net(args.job).blocks),
        # One Block's weight, gathered (bf16).
        "layer_bytes": layer_bytes,
        "gradient_accumulation_steps": GAS[args.job],
        "plan": [list(p) for p in PLANS[args.job]],
        "error": None,
    }
    reporter = Reporter(os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json"), payload)

    try:
        grads = {}
        for name, deepcompile in (("eager", False), ("deepcompile", True)):
            rec = payload[name] = {
                "reached": None,
                "seconds": None,
                "train_losses": [],
                "eval_losses": [],
                "abandoned_requires_grad": [],
                "steps": [],
                "after_op": [],
                "left_grads": [],
            }
            start = time.time()
            grads[name] = run(args.job, deepcompile, rank, device, rec, reporter)
            rec["seconds"] = round(time.time() - start, 1)
            reporter.write()
            gc.collect()
            torch.cuda.empty_cache()
        payload["grad_compare"] = compare_grads(grads["eager"], grads["deepcompile"])
        reporter.write()
    except BaseException:
        payload["error"] = traceback.format_exc()
        reporter.write()
        print(f"[rank {rank}] worker failed:\n{payload['error']}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Leave at once: the other rank may be blocked in a collective, torchrun stops it.
        os._exit(1)

    torch.distributed.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
