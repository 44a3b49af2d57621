"""Worker for tests/test_deepcompile_z3_skipped_frames_cpu.py: DeepCompile ZeRO-3's eager fallback on CPU.

Run with torchrun on 2 CPU processes (DS_ACCELERATOR=cpu). DeepCompile's native op needs CUDA, so it is replaced by
a no-op stand-in and the compiled regions get torch.compile's "aot_eager" backend instead of DeepCompile's; the
model keeps every parameter out of the compiled regions (they would need DeepCompile's gather ops). Everything
else is real: engine.compile() runs DeepCompile's init_z3 (ZeRO-3 hooks removed, the fallback installed), Dynamo
skips the frames that use the parameters, ZeRO-3 partitions, gathers and reduce-scatters across the 2 processes,
and the engine's forward, backward and optimizer step run as they do on GPUs.

Variants ("--variant"):
  modules  the skipped frame (torch.compiler.disable) calls L Block modules and reads one more weight directly;
           gradient accumulation 2; the plan also runs forwards whose backward never comes (grad enabled, after
           engine.eval() with grad enabled), a no_grad forward between training steps, and a Block called on its
           own under no_grad, outside the engine's forward.
  loop     the skipped frame is skipped for a graph break inside a loop and reads every weight directly.
  checkpoint  as "modules", two of the blocks run under activation checkpointing (reentrant, non-reentrant).

The same steps run on eager ZeRO-3 (no compile) for reference; both use eager ZeRO-3's leanest settings (no
prefetch, no reuse). Recorded per training step: the peak of gathered parameter storage alive at once
(GatheredStorageCensus), and the gradients, losses and parameters left gathered. Each rank writes a JSON report to
$DIST_RESULT_DIR/rank<RANK>.json.
"""

import argparse
import gc
import json
import os
import sys
import time
import traceback

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import init_distributed  # noqa: E402

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

HIDDEN = 64
LAYERS = 4
BATCH = 2
SEQ = 8
LR = 1e-2


class Block(nn.Module):

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(HIDDEN, HIDDEN, bias=False)

    def forward(self, h):
        return h + torch.relu(self.fc(h))


class Net(nn.Module):

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.blocks = nn.ModuleList([Block() for _ in range(LAYERS)])
        self.mix = nn.Linear(HIDDEN, HIDDEN, bias=False)

    @torch.compiler.disable
    def run_modules(self, h):
        for i, block in enumerate(self.blocks):
            if self.variant == "checkpoint" and i in (1, 2):
                # Recomputed in the backward: reentrant (forward under no_grad) and non-reentrant.
                h = torch.utils.checkpoint.checkpoint(block, h, use_reentrant=i == 1)
            else:
                h = block(h)
        # Read outside any module forward of its own.
        return h + F.linear(h, self.mix.weight)

    def run_loop(self, h):
        for block in self.blocks:
            h = h + torch.relu(F.linear(h, block.fc.weight))
            torch._dynamo.graph_break()
        return h + F.linear(h, self.mix.weight)

    def forward(self, x, y):
        h = x * 1.5
        h = self.run_loop(h) if self.variant == "loop" else self.run_modules(h)
        return F.mse_loss(h, y)


PLANS = {
    # (operation, batch index); "train" is one micro-batch: forward, backward, engine.step().
    "modules": [("train", 0), ("train", 1), ("abandon", 2), ("train", 3), ("train", 4), ("no_grad", 5), ("abandon", 6),
                ("abandon", 7), ("abandon", 8), ("eval_grad", 9), ("outside", 10), ("train", 11), ("train", 12),
                ("outside", 13)],
    "loop": [("train", 0), ("abandon", 1), ("train", 2), ("train", 3)],
    "checkpoint": [("train", 0), ("abandon", 1), ("train", 2), ("train", 3)],
}
GAS = {"modules": 2, "loop": 1, "checkpoint": 1}


class _FakeDeepCompileOp:
    """Stands in for the CUDA-only DeepCompile op: every call does nothing."""

    def __getattr__(self, name):
        return lambda *args, **kwargs: None


def use_fake_deepcompile_op():
    fake = _FakeDeepCompileOp()
    for name, module in list(sys.modules.items()):
        if name.startswith("deepspeed") and hasattr(module, "get_deepcompile_handle"):
            setattr(module, "get_deepcompile_handle", lambda: fake)
    import deepspeed.compile.init_z3 as init_z3
    init_z3.make_backend = lambda *args, **kwargs: "aot_eager"


def batch(rank, index):
    gen = torch.Generator().manual_seed(100 * rank + index)
    return torch.randn(BATCH, SEQ, HIDDEN, generator=gen), torch.randn(BATCH, SEQ, HIDDEN, generator=gen)


def gathered(module):
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    return [n for n, p in module.named_parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]


class GatheredStorageCensus:
    """Bytes of gathered parameter storage still alive, whoever holds it.

    Releasing a ZeRO-3 parameter only swaps its .data for an empty tensor; the gathered storage is freed when nothing
    else references it. A tensor autograd saved for the backward (a view of the weight, say) keeps it alive. Every
    storage a gather gives a parameter is watched through a weak reference to the storage itself, so the census counts
    exactly the gathered storages not yet freed, by anyone. Memory only grows at a gather, so sampling right after
    each gather finds the peak.
    """

    def __init__(self, params):
        from torch.multiprocessing.reductions import StorageWeakRef
        self._weak_ref = StorageWeakRef
        self.params = params
        self.watched = {}  # storage address -> (weak reference, bytes)
        self.peak = 0

    def live_bytes(self):
        for key, (ref, _) in list(self.watched.items()):
            if ref.expired():
                del self.watched[key]
        return sum(nbytes for _, nbytes in self.watched.values())

    def after_gather(self):
        live = self.live_bytes()
        for p in self.params:
            if p.data.numel() == 0:
                continue
            storage = p.data.untyped_storage()
            ref = self._weak_ref(storage)
            if ref.cdata not in self.watched:
                self.watched[ref.cdata] = (ref, storage.nbytes())
                live += storage.nbytes()
        self.peak = max(self.peak, live)

    def start(self, settle_s=2.0):
        """Begin a step's census. A gather's storage can outlive its last Python reference by a moment: gloo's worker
        thread drops the completed work object, which references its output tensors, asynchronously. Storage still
        alive after settle_s of garbage collection is reported as held."""
        deadline = time.monotonic() + settle_s
        while self.live_bytes() and time.monotonic() < deadline:
            gc.collect()
            time.sleep(0.01)
        self.peak = self.live_bytes()


def watch_gathers(module, rec):
    """Record the most parameters gathered at once, and the census of gathered storage, after every ZeRO-3 gather
    (single parameters, coalesced groups as eager ZeRO-3 fetches them)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus
    params = list(module.parameters())
    census = GatheredStorageCensus(params)

    def wrap(param, name):
        original = getattr(param, name)

        def gathered():
            count = sum(1 for p in params if p.ds_status == ZeroParamStatus.AVAILABLE)
            rec["max_gathered"] = max(rec["max_gathered"], count)
            census.after_gather()

        def gather(*args, **kwargs):
            result = original(*args, **kwargs)
            gathered()
            wait = getattr(result, "wait", None)
            if wait is not None:
                # An asynchronous gather (eager ZeRO-3's fetch) may give the parameters their data when it completes.
                def wait_and_count(*args, **kwargs):
                    # Drop the reference cycle handle -> this function -> handle, which would keep the handle and
                    # the gathered buffers it references alive until the garbage collector runs.
                    del result.wait
                    out = wait(*args, **kwargs)
                    gathered()
                    return out

                result.wait = wait_and_count
            return result

        setattr(param, name, gather)

    for param in params:
        wrap(param, "all_gather")
        wrap(param, "all_gather_coalesced")
    return census


def run(variant, deepcompile, rank, rec):
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    torch.manual_seed(0)
    model = Net(variant)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GAS[variant],
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": LR,
                "torch_adam": True
            }
        },
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 0,
            # Eager ZeRO-3 at its leanest (no prefetch, every parameter released after its use): the reference for
            # the peak of gathered storage.
            "stage3_prefetch_bucket_size": 0,
            "stage3_max_reuse_distance": 0,
        },
        "steps_per_print": 1_000_000,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    if deepcompile:
        engine.compile(backend="eager")
        rec["deepcompile_active"] = engine.is_deepcompile_active()
    census = watch_gathers(engine.module, rec)
    names = [n for n, _ in engine.module.named_parameters()]
    for op, index in PLANS[variant]:
        rec["reached"] = f"{op} {index}"
        x, y = batch(rank, index)
        if op == "train":
            boundary = engine.is_gradient_accumulation_boundary()
            census.start()
            rec["gathered_bytes_at_start"].append(census.peak)
            loss = engine(x, y)
            engine.backward(loss)
            # The most gathered parameter storage alive at once during the forward and backward.
            rec["gathered_bytes_peak"].append(census.peak)
            # Full-size gradients left on parameters: nothing reduced them into their ZeRO-3 partitions.
            rec["left_grads"].append([n for n, p in engine.module.named_parameters() if p.grad is not None])
            if boundary:
                params = dict(engine.module.named_parameters())
                rec["grads"].append({n: safe_get_full_grad(params[n]).flatten()[:64].tolist() for n in names})
            engine.step()
            rec["train_losses"].append(loss.item())
        elif op == "abandon":
            loss = engine(x, y)
            rec["abandoned_requires_grad"].append(loss.requires_grad)
            del loss
        elif op == "eval_grad":
            engine.eval()
            loss = engine(x, y)
            rec["abandoned_requires_grad"].append(loss.requires_grad)
            del loss
            engine.train()
        elif op == "no_grad":
            with torch.no_grad():
                engine(x, y)
        elif op == "outside":
            # A submodule called outside the engine's forward, as generate() of a PEFT model calls its base model.
            with torch.no_grad():
                out = engine.module.blocks[1](x)
            rec["outside_outputs"].append(out.flatten()[:32].tolist())
        rec["gathered_after"].append([f"{op} {index}", gathered(engine.module)])
    rec["reached"] = "done"
    if deepcompile:
        fallback = getattr(engine, "_deepcompile_z3_eager_fallback", None)
        rec["fallback_stats"] = {
            k: v
            for k, v in (fallback.stats() if fallback is not None else {}).items() if k.startswith("total_")
        }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", choices=sorted(PLANS), required=True)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    report = {
        "rank": rank,
        "variant": args.variant,
        "plan": [list(step) for step in PLANS[args.variant]],
        "layers": LAYERS,
        # One gathered Block weight (fp32).
        "layer_bytes": HIDDEN * HIDDEN * 4,
        "error": None,
    }
    path = os.path.join(os.environ["DIST_RESULT_DIR"], f"rank{rank}.json")
    try:
        import deepspeed
        init_distributed("gloo")
        report["deepspeed_version"] = deepspeed.__version__
        use_fake_deepcompile_op()
        for name, deepcompile in (("eager", False), ("deepcompile", True)):
            rec = report[name] = {
                "reached": None,
                "train_losses": [],
                "grads": [],
                "gathered_after": [],
                "abandoned_requires_grad": [],
                "left_grads": [],
                "max_gathered": 0,
                "gathered_bytes_at_start": [],
                "gathered_bytes_peak": [],
                "outside_outputs": [],
            }
            run(args.variant, deepcompile, rank, rec)
    except BaseException:
        report["error"] = traceback.format_exc()
        print(f"[rank {rank}] {report['error']}", file=sys.stderr, flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    if report["error"]:
        os._exit(1)


if __name__ == "__main__":
    main()
