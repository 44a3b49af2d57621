"""Worker for test_founding_fixes.py, upstream PR #8036: with DeepCompile ZeRO-1 neither the gradient
targets built at compile time nor the gradient reduce buckets may live into the optimizer step.

One bf16 chain of 16 Linear(4096, 4096) layers (268M parameters, one compiled graph), ZeRO stage 1,
DeepCompile, torch AdamW, 8 training steps on fixed input. The worker records the allocated memory

* ``m_init``: after deepspeed.initialize() and before engine.compile() (cuBLAS workspaces warmed up first),
* ``pre_step``: on entry to the ZeRO optimizer's step(),
* ``pre_inner``: on entry to the wrapped torch optimizer's step() (inside the ZeRO step, after the fp32
  gradient partition is built) and the peak of that inner step,
* ``step_peak``: the peak of the whole ZeRO step, and ``post_step``: after engine.step(),

together with the optimizer state bytes and the sizes the fix is about, all computed from the model:
the flat gradient partition in the gradient-accumulation dtype (what 0.19.1 clones at compile time and
keeps for the engine's lifetime) and the two reduce buckets (reduce_bucket_size elements each, bf16).
Run standalone with torchrun --nproc_per_node=2 (the report is printed when $DIST_RESULT_DIR is unset).
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

HIDDEN = 4096
LAYERS = 16
BATCH = 8
STEPS = 8
LR = 1e-4
# Two layers' worth of gradients per bucket; DeepCompile double-buffers them.
BUCKET_ELEMS = 2 * HIDDEN * HIDDEN
BUCKETS = 2


class Chain(nn.Module):

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN, bias=False) for _ in range(LAYERS)])
        for layer in self.layers:
            nn.init.normal_(layer.weight, std=(2.0 / HIDDEN)**0.5)

    def forward(self, x, y):
        h = x
        for layer in self.layers:
            h = torch.relu(layer(h))
        return F.mse_loss(h.float(), y.float())


def ds_config():
    return ds_configs.zero(1, BATCH, 1, LR, deepcompile=True, reduce_bucket_size=BUCKET_ELEMS)


def warm_up_blas(device):
    """Create the cuBLAS/cuBLASLt workspaces (kept by the caching allocator) of the main and autograd threads."""
    for dtype in (torch.bfloat16, torch.float32):
        a = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        b = torch.randn(64, 64, device=device, dtype=dtype, requires_grad=True)
        c = torch.randn(64, device=device, dtype=dtype, requires_grad=True)
        (torch.mm(a, b).sum() + torch.addmm(c, a, b).sum()).backward()
    torch.cuda.synchronize()


def optimizer_state_bytes(inner):
    total = 0
    for state in inner.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.is_cuda:
                total += value.numel() * value.element_size()
    return total


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()

    import deepspeed

    device = setup_device()
    describe(report)
    rank = report["rank"]
    warm_up_blas(device)

    gen = torch.Generator().manual_seed(8036 + rank)
    x = torch.randn(BATCH, HIDDEN, generator=gen).to(device, torch.bfloat16)
    y = (0.5 * torch.randn(BATCH, HIDDEN, generator=gen)).to(device, torch.bfloat16)

    torch.manual_seed(0)
    model = Chain()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_config())
    zero_opt = engine.optimizer
    inner = zero_opt.optimizer
    torch.cuda.synchronize()
    m_init = torch.cuda.memory_allocated()

    engine.compile()
    torch.cuda.synchronize()
    m_after_compile = torch.cuda.memory_allocated()

    grad_dtype = zero_opt.gradient_accumulation_dtype
    grad_elem = torch.empty((), dtype=grad_dtype).element_size()
    partition_elems = sum(int(n) for n in zero_opt.partition_size)
    report.update(
        steps=args.steps,
        layers=LAYERS,
        hidden=HIDDEN,
        model_params=sum(p.numel() for p in engine.module.parameters()),
        zero_optimizer=type(zero_opt).__name__,
        inner_optimizer=type(inner).__name__,
        grad_accum_dtype=str(grad_dtype),
        partition_elems=partition_elems,
        # The flat gradient partition: what 0.19.1 clones at compile time as DeepCompile's gradient target.
        grad_target_bytes=partition_elems * grad_elem,
        fp32_grad_bytes=sum(p.numel() * 4 for p in zero_opt.single_partition_of_fp32_groups),
        bucket_elems=BUCKET_ELEMS,
        bucket_bytes=BUCKETS * BUCKET_ELEMS * torch.empty((), dtype=torch.bfloat16).element_size(),
        m_init=m_init,
        m_after_compile=m_after_compile,
        deepcompile_active=bool(engine.is_deepcompile_active()),
        records=[],
    )
    report.write()

    probe = {}

    original_inner_step = inner.step

    def inner_step_probe(*a, **kw):
        probe["pre_inner"] = torch.cuda.memory_allocated()
        probe["peak_before_inner"] = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = original_inner_step(*a, **kw)
        probe["inner_peak"] = torch.cuda.max_memory_allocated()
        return out

    inner.step = inner_step_probe

    original_step = zero_opt.step

    def step_probe(*a, **kw):
        torch.cuda.synchronize()
        probe["pre_step"] = torch.cuda.memory_allocated()
        probe["state_before"] = optimizer_state_bytes(inner)
        torch.cuda.reset_peak_memory_stats()
        out = original_step(*a, **kw)
        probe["step_peak"] = max(probe.get("peak_before_inner", 0), torch.cuda.max_memory_allocated())
        return out

    zero_opt.step = step_probe

    for step in range(args.steps):
        probe.clear()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        value = loss.item()
        del loss
        state = optimizer_state_bytes(inner)
        rec = {
            "step": step,
            "loss": value,
            "pre_step": probe.get("pre_step"),
            "pre_inner": probe.get("pre_inner"),
            "inner_temp": probe["inner_peak"] - probe["pre_inner"] if "inner_peak" in probe else None,
            "step_peak": probe.get("step_peak"),
            "post_step": torch.cuda.memory_allocated(),
            "state_before": probe.get("state_before"),
            "state_after": state,
        }
        report["records"].append(rec)
        report.write()
        if rank == 0:
            print(
                f"step {step}: loss {value:.5f} pre_step {mib(rec['pre_step'] or 0)} MiB "
                f"post_step {mib(rec['post_step'])} MiB peak {mib(rec['step_peak'] or 0)} MiB",
                flush=True)

    report["losses_finite"] = finite([r["loss"] for r in report["records"]])
    report["compile_entries"] = [list(e[:2]) for e in engine.get_compile_time()]
    engine.destroy()


if __name__ == "__main__":
    run_worker("8036", main)
