"""Worker for test_founding_fixes.py, upstream PR #8032: DeepCompile ZeRO-3 must free the storage of a
gathered parameter at its last release_param, also when the parameter's numel is not divisible by the
world size (the gather then fills a padded buffer and hands the graph a true-shape view of it).

One bf16 chain of 24 Linear(2049, 2049) layers (numel 4,198,401: odd, so every shard is padded on 2
ranks), all in one compiled graph, ZeRO-3 with stage3_param_persistence_threshold 0 and DeepCompile,
4 training steps (DeepCompile's ZeRO-3 schedule changes passes at step 5). For every step the worker
records the allocated memory at the start of the forward and of the backward and the peak of each, so
that the test can compare the peaks with the bytes of all padded gather buffers of the graph. DeepSpeed
0.19.1 only drops the registry's reference at release_param; the graph's own view keeps the padded
buffer until the graph returns, so every parameter gathered in the graph is resident at its end.

Runnable on its own (for compute-sanitizer, say):
    torchrun --standalone --nproc_per_node=2 tests/gpu/workers/founding_z3_release.py [--steps N]
With $DIST_RESULT_DIR unset each rank prints its report as one line.
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, finite, mib, run_worker, setup_device  # noqa: E402
import ds_configs  # noqa: E402

HIDDEN = 2049
LAYERS = 24
BATCH = 8
STEPS = 4
LR = 1e-4


class Chain(nn.Module):

    def __init__(self, layers, hidden):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(hidden, hidden, bias=False) for _ in range(layers)])
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=(2.0 / hidden)**0.5)

    def forward(self, x, y):
        h = x
        for layer in self.layers:
            h = torch.relu(layer(h))
        return F.mse_loss(h.float(), y.float())


def ds_config(bucket_elems):
    return ds_configs.zero(3, BATCH, 1, LR, deepcompile=True, stage3_param_persistence_threshold=0,
                           reduce_bucket_size=bucket_elems)


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--layers", type=int, default=LAYERS)
    parser.add_argument("--hidden", type=int, default=HIDDEN)
    args = parser.parse_args()
    if args.steps > 5:
        parser.error("at most 5 steps: DeepCompile's ZeRO-3 schedule switches passes at step 5")

    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    device = setup_device()
    describe(report)
    rank, world_size = report["rank"], report["world_size"]

    gen = torch.Generator().manual_seed(8032 + rank)
    x = torch.randn(BATCH, args.hidden, generator=gen).to(device, torch.bfloat16)
    y = (0.5 * torch.randn(BATCH, args.hidden, generator=gen)).to(device, torch.bfloat16)

    numel = args.hidden * args.hidden
    # One gradient per bucket fill; the two buckets are small next to the gathered parameters.
    bucket_elems = numel + 1024
    torch.manual_seed(0)
    model = Chain(args.layers, args.hidden)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(bucket_elems))
    engine.compile()

    params = list(engine.module.parameters())
    # ZeRO-3 shards are padded to the same size on every rank; DeepCompile gathers world * shard elements.
    padded_numel = [world_size * p.ds_tensor.numel() for p in params]
    elem = params[0].ds_tensor.element_size()
    report.update(
        steps=args.steps,
        layers=args.layers,
        hidden=args.hidden,
        param_numel=numel,
        uneven=all(p.ds_numel % world_size != 0 for p in params),
        padded_numel=padded_numel[0],
        padded_bytes=padded_numel[0] * elem,
        all_gathered_bytes=sum(n * elem for n in padded_numel),
        unpadded_bytes=sum(p.ds_numel * elem for p in params),
        bucket_elems=bucket_elems,
        deepcompile_active=bool(engine.is_deepcompile_active()),
        records=[],
    )
    report.write()

    for step in range(args.steps):
        torch.cuda.synchronize()
        fwd_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss = engine(x, y)
        torch.cuda.synchronize()
        fwd_peak = torch.cuda.max_memory_allocated()
        bwd_base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        engine.backward(loss)
        torch.cuda.synchronize()
        bwd_peak = torch.cuda.max_memory_allocated()
        bwd_end = torch.cuda.memory_allocated()
        engine.step()
        torch.cuda.synchronize()
        value = loss.item()
        del loss
        gathered = [i for i, p in enumerate(params) if p.ds_status != ZeroParamStatus.NOT_AVAILABLE]
        rec = {
            "step": step,
            "loss": value,
            "fwd_base": fwd_base,
            "fwd_peak": fwd_peak,
            "fwd_extra": fwd_peak - fwd_base,
            "bwd_base": bwd_base,
            "bwd_peak": bwd_peak,
            "bwd_extra": bwd_peak - bwd_base,
            "bwd_end": bwd_end,
            "post_step": torch.cuda.memory_allocated(),
            "params_left_gathered": gathered,
        }
        report["records"].append(rec)
        report.write()
        if rank == 0:
            print(
                f"step {step}: loss {value:.5f} forward peak +{mib(rec['fwd_extra'])} MiB, "
                f"backward peak +{mib(rec['bwd_extra'])} MiB, all padded params "
                f"{mib(report['all_gathered_bytes'])} MiB",
                flush=True)

    report["losses_finite"] = finite([r["loss"] for r in report["records"]])
    report["compile_entries"] = [list(e[:2]) for e in engine.get_compile_time()]
    engine.destroy()


if __name__ == "__main__":
    run_worker("8032", main)
