"""Worker for test_founding_fixes.py, upstream PR #8080: ZeRO-1/2 with overlap_comm must not reduce the
IPG gradient bucket before every stream that copied a gradient into it has finished.

Eager ZeRO (no DeepCompile), fp32, 2 ranks, stages 1 and 2. The model has three weights, in backward order:

* ``side`` (256 x 1024): its gradient comes from a custom autograd Function whose forward ran on a side
  stream, so its backward, its AccumulateGrad node and ZeRO's gradient hook (which copies the gradient
  into the bucket) all run on that side stream. The backward first sleeps on the side stream
  (torch.cuda._sleep), so that copy lands long after the hook returned on the host.
* ``mid`` (256 x 4096): its hook runs on the default stream and finds the bucket too full
  (reduce_bucket_size 1.2M elements), so it reduces the bucket that holds ``side``'s slot.
  DeepSpeed 0.19.1 makes the reduction stream wait for the current (default) stream only, so the
  reduction reads ``side``'s slot before the sleeping side stream has written it.
* ``big`` (4096 x 1024, 4.2M elements): larger than the bucket, reduced on its own (extra-large path).

Every step the worker computes the reference gradient in plain PyTorch (same weights and data, no side
stream, no overlap, all-reduced and averaged by hand) and reads DeepSpeed's reduced gradient back from a
plain SGD step: grad = (w_before - w_after) / lr. Variant "control" runs the same Function on the current
stream. Gradient clipping is switched off explicitly: DeepSpeed 0.19.8 clips to norm 1.0 by default (0.19.1
did not clip), which would scale every reconstructed gradient by 1 / global norm.
Run standalone with torchrun --nproc_per_node=2 (the report is printed when $DIST_RESULT_DIR is unset).
"""

import argparse
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, finite, run_worker, setup_device  # noqa: E402

IN_DIM, HIDDEN, OUT_DIM = 1024, 4096, 256
BATCH = 16
STEPS = 3
LR = 1e-3
# side (262,144) + mid (1,048,576) does not fit, mid alone does, big (4,194,304) never does.
BUCKET_ELEMS = 1_200_000
# About one second on an H200 (1.98 GHz at most): far longer than the host takes to reach the reduction.
SLEEP_CYCLES = 2_000_000_000
STAGES = (1, 2)
VARIANTS = ("side_stream", "control")
PARAM_NAMES = ("big.weight", "mid.weight", "side.weight")
# fp32 throughout; the reconstruction (w_before - w_after) / lr loses ~1e-6 relative.
REL_TOL = 1e-3


class DelayedLinear(torch.autograd.Function):
    """x @ w.t(); the backward sleeps on its stream before it computes the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, sleep_cycles):
        ctx.save_for_backward(x)
        ctx.sleep_cycles = sleep_cycles
        return x @ weight.t()

    @staticmethod
    def backward(ctx, grad_out):
        (x, ) = ctx.saved_tensors
        torch.cuda._sleep(ctx.sleep_cycles)
        return None, grad_out.t() @ x, None


class Net(nn.Module):

    def __init__(self, side_stream):
        super().__init__()
        # Registration order is the flat-buffer order: big, mid, side.
        self.big = nn.Linear(IN_DIM, HIDDEN, bias=False)
        self.mid = nn.Linear(HIDDEN, OUT_DIM, bias=False)
        self.side = nn.Linear(IN_DIM, OUT_DIM, bias=False)
        self.side_stream = side_stream

    def forward(self, x, y):
        m = self.mid(torch.relu(self.big(x)))
        if self.side_stream is None:
            s = DelayedLinear.apply(x, self.side.weight, SLEEP_CYCLES)
        else:
            current = torch.cuda.current_stream()
            self.side_stream.wait_stream(current)
            # The weight is first used here, so its AccumulateGrad node belongs to the side stream too.
            with torch.cuda.stream(self.side_stream):
                s = DelayedLinear.apply(x, self.side.weight, SLEEP_CYCLES)
            current.wait_stream(self.side_stream)
            s.record_stream(current)
        # Created last, so autograd runs the side branch (and its hook) before mid's.
        out = m + s
        return (out - y).pow(2).sum(-1).mean()


def reference_grads(weights, x, y, world_size):
    """Averaged gradients of the same loss, computed without DeepSpeed and without side streams."""
    big, mid, side = [w.detach().clone().requires_grad_(True) for w in weights]
    out = F.linear(torch.relu(F.linear(x, big)), mid) + F.linear(x, side)
    loss = (out - y).pow(2).sum(-1).mean()
    grads = torch.autograd.grad(loss, [big, mid, side])
    for g in grads:
        torch.distributed.all_reduce(g)
        g.div_(world_size)
    return grads


def make_batch(rank, step, device):
    gen = torch.Generator().manual_seed(8080 + 100 * rank + step)
    x = torch.randn(BATCH, IN_DIM, generator=gen)
    y = torch.randn(BATCH, OUT_DIM, generator=gen)
    return x.to(device), y.to(device)


def ds_config(stage):
    return {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": True,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": BUCKET_ELEMS,
        },
        # The step must apply the reduced gradient as it is (0.19.8's default is 1.0, 0.19.1's 0).
        "gradient_clipping": 0.0,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }


def run_case(stage, variant, device, rank, world_size):
    import deepspeed

    side_stream = torch.cuda.Stream() if variant == "side_stream" else None
    torch.manual_seed(0)
    model = Net(side_stream).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    engine, zero_opt, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds_config(stage))
    zero_opt = engine.optimizer
    rec = {
        "zero_optimizer": type(zero_opt).__name__,
        "gradient_clipping": engine.gradient_clipping(),
        "side_hook_streams": [],
        "reductions": [],
        "rel_err": dict((name, []) for name in PARAM_NAMES),
        "max_abs_diff": dict((name, []) for name in PARAM_NAMES),
        "ref_max_abs": dict((name, []) for name in PARAM_NAMES),
        # <got, ref> / <ref, ref>: 1.0 when equal; a uniform factor (clipping, averaging) shows up here.
        "scale": dict((name, []) for name in PARAM_NAMES),
        "losses": [],
    }
    side_param = engine.module.side.weight
    side_param_id = zero_opt.get_param_id(side_param)

    def record_side_hook(_param):
        rec["side_hook_streams"].append(
            "side" if side_stream is not None and torch.cuda.current_stream() == side_stream else "current")

    side_param.register_post_accumulate_grad_hook(record_side_hook)

    original_average_tensor = zero_opt.average_tensor

    def average_tensor_probe(tensor, communication_data_type, *args, **kwargs):
        bucket = zero_opt.ipg_buckets[communication_data_type]
        rec["reductions"].append({
            "numel": tensor.numel(),
            "holds_side": any(param_id == side_param_id for _, _, param_id in bucket.params),
            "on_default_stream": torch.cuda.current_stream() == torch.cuda.default_stream(),
            "side_stream_busy": side_stream is not None and not side_stream.query(),
        })
        return original_average_tensor(tensor, communication_data_type, *args, **kwargs)

    zero_opt.average_tensor = average_tensor_probe

    params = [engine.module.big.weight, engine.module.mid.weight, side_param]
    for step in range(STEPS):
        x, y = make_batch(rank, step, device)
        before = [p.detach().clone() for p in params]
        ref = reference_grads(before, x, y, world_size)
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        rec["losses"].append(loss.item())
        for name, p, b, r in zip(PARAM_NAMES, params, before, ref):
            got = (b - p.detach()) / LR
            diff = (got - r).float()
            rec["rel_err"][name].append((diff.norm() / r.norm()).item())
            rec["max_abs_diff"][name].append(diff.abs().max().item())
            rec["ref_max_abs"][name].append(r.abs().max().item())
            rec["scale"][name].append(((got * r).sum() / (r * r).sum()).item())

    zero_opt.average_tensor = original_average_tensor
    engine.destroy()
    return rec


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stages", type=int, nargs="+", default=list(STAGES), choices=[1, 2])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()

    device = setup_device()
    describe(report)
    torch.backends.cuda.matmul.allow_tf32 = False
    rank, world_size = report["rank"], report["world_size"]
    report.update(steps=STEPS,
                  lr=LR,
                  bucket_elems=BUCKET_ELEMS,
                  sleep_cycles=SLEEP_CYCLES,
                  rel_tol=REL_TOL,
                  param_numel={
                      "big.weight": HIDDEN * IN_DIM,
                      "mid.weight": OUT_DIM * HIDDEN,
                      "side.weight": OUT_DIM * IN_DIM
                  },
                  cases={})
    for stage in args.stages:
        for variant in args.variants:
            key = f"stage{stage}_{variant}"
            report["cases"][key] = {"reached": "start"}
            report.write()
            rec = run_case(stage, variant, device, rank, world_size)
            rec["reached"] = "done"
            rec["losses_finite"] = finite(rec["losses"])
            report["cases"][key] = rec
            report.write()


if __name__ == "__main__":
    run_worker("8080", main)
