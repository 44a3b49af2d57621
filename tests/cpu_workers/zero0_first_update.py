"""Worker for tests/test_zero0_optimizer_starts_at_step_zero.py: what ZeRO-0's mixed-precision wrapper does to the
client optimizer before training, on CPU.

One process, world size 1, gloo, DS_ACCELERATOR=cpu, bf16 (the CPU accelerator has no fp16; bf16 without ZeRO and a
torch optimizer is wrapped by FP16_UnfusedOptimizer, as fp16 is). A 16-16-1 MLP with torch's AdamW (lr 1e-2) trains
3 steps on one batch with ZeRO-0 and with ZeRO-1, and by hand (bf16 forward and backward, fp32 master weights
stepped by AdamW, copied back to bf16): the reference both should equal. Recorded per run: the optimizer's step count
and how far the master weights moved between the engine's construction and the first training step, and the 3
losses; the same two for fp16's fused wrapper (FP16_Optimizer) built by hand. Prints one line
"ZERO0_FIRST_UPDATE <json>".
"""

import json
import os
import sys

import torch
import torch.nn as nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import ensure_dist_env, init_distributed  # noqa: E402

LR, WEIGHT_DECAY, STEPS = 1e-2, 0.1, 3
# `--cuda-fp16-fused` (tests/gpu/test_zero0_fused_fp16_starts_at_step_zero.py): on a GPU in fp16 with DeepSpeed's
# fused Adam from the config, which ZeRO-0 wraps in FP16_Optimizer; ZeRO-0 and ZeRO-1 only.
CUDA_FP16_FUSED = "--cuda-fp16-fused" in sys.argv
DEVICE, DTYPE = ("cuda", torch.float16) if CUDA_FP16_FUSED else ("cpu", torch.bfloat16)


def model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def batch():
    gen = torch.Generator().manual_seed(1)
    x, y = torch.randn(4, 16, generator=gen), torch.randn(4, 1, generator=gen)
    return x.to(DEVICE, DTYPE), y.to(DEVICE, DTYPE)


def loss_of(out, y):
    return (out - y).float().pow(2).mean()


def engine_run(stage):
    import deepspeed
    net = model()
    initial = [p.detach().to(DTYPE).float() for p in net.parameters()]
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": stage}}
    if CUDA_FP16_FUSED:
        opt = None
        config.update(fp16={"enabled": True, "initial_scale_power": 8},
                      optimizer={"type": "Adam", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY, "adam_w_mode": True}})
    else:
        opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
        config.update(bf16={"enabled": True}, zero_allow_untested_optimizer=True)
    engine, *_ = deepspeed.initialize(model=net, optimizer=opt, model_parameters=net.parameters(), config=config)
    inner = engine.optimizer.optimizer
    # torch's optimizers count steps per parameter; DeepSpeed's fused Adam per group
    steps = sorted({float(s["step"]) for s in inner.state.values() if "step" in s}
                   | {float(g["step"]) for g in inner.param_groups if "step" in g})
    masters = [p for group in inner.param_groups for p in group["params"]]
    flat_initial = torch.cat([w.flatten() for w in initial])
    # ZeRO-1's master is one flat partition, padded at its end; at world size 1 it holds the parameters in order.
    flat_masters = torch.cat([m.detach().float().flatten() for m in masters])[:flat_initial.numel()]
    moved = (flat_masters - flat_initial.to(flat_masters.device)).abs().max().item()
    x, y = batch()
    losses, scales = [], []
    for _ in range(STEPS):
        loss = loss_of(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
        scales.append(float(getattr(engine.optimizer, "cur_scale", getattr(engine.optimizer, "loss_scale", 0.0))))
    steps_after = sorted({float(s["step"]) for s in inner.state.values() if "step" in s}
                         | {float(g["step"]) for g in inner.param_groups if "step" in g})
    return {"optimizer": type(engine.optimizer).__name__, "steps_before_training": steps,
            "masters_moved_before_training": moved, "losses": losses, "loss_scales": scales,
            "steps_after_training": steps_after}


def fused_wrapper_run():
    """FP16_Optimizer, ZeRO-0's wrapper for fp16 with DeepSpeed's fused Adam, built by hand: the engine builds it only
    on an accelerator with fp16 and the fused Adam (CUDA), and its constructor does not depend on the optimizer it
    wraps. Its master weights are one flat fp32 tensor per group."""
    from deepspeed.runtime.fp16.fused_optimizer import FP16_Optimizer
    net = model().half()
    flat_initial = torch.cat([p.detach().float().flatten() for p in net.parameters()])
    opt = torch.optim.AdamW(net.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)
    wrapper = FP16_Optimizer(opt, static_loss_scale=1.0, verbose=False)
    steps = sorted({float(s["step"]) for s in opt.state.values() if "step" in s})
    moved = (wrapper.fp32_groups_flat[0].detach() - flat_initial).abs().max().item()
    return {"optimizer": type(wrapper).__name__, "steps_before_training": steps, "masters_moved_before_training": moved}


def reference_run():
    net = model().bfloat16()
    masters = [p.detach().float().clone().requires_grad_(True) for p in net.parameters()]
    opt = torch.optim.AdamW(masters, lr=LR, weight_decay=WEIGHT_DECAY)
    x, y = batch()
    losses = []
    for _ in range(STEPS):
        loss = loss_of(net(x), y)
        loss.backward()
        losses.append(loss.item())
        for p, master in zip(net.parameters(), masters):
            master.grad, p.grad = p.grad.float(), None
        opt.step()
        with torch.no_grad():
            for p, master in zip(net.parameters(), masters):
                p.copy_(master)
    return {"losses": losses}


def main():
    ensure_dist_env()
    init_distributed("nccl" if CUDA_FP16_FUSED else "gloo")
    out = {"zero0": engine_run(0), "zero1": engine_run(1)}
    if not CUDA_FP16_FUSED:
        out.update(reference=reference_run(), fused=fused_wrapper_run())
    print("ZERO0_FIRST_UPDATE " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
