"""Worker for test_overlap_comm_stream_order.py: ZeRO-1/2 must order each gradient reduction after every stream
that wrote what it reduces, and every copy into a reused bucket buffer after the reduction that reads it.

fp32, plain SGD, 2 ranks; the model is a chain of bias-free Linear layers w1..wN, all on the default stream, so
ZeRO's gradient hooks run from wN down to w1. The hook does not depend on autograd's choice of stream here: the
worker wraps the optimizer's per-parameter entry (reduce_independent_p_g_buckets_and_remove_grads) and, for one
chosen weight, runs it inside `stream(side)`, as it runs when the hook fires on a side stream. Without a side
stream (the *_single_stream controls) the same injection runs on the current stream.

oversized (w3: 98,304, w2: 786,432 > reduce_bucket_size 524,288, w1: 262,144, in hook order): w3 is copied into
  the bucket on the default stream. w2's gradient is zeroed on the default stream and written back on the side
  stream after a sleep kernel (~0.5 s); then w2's hook runs there: it flushes w3's bucket (whose copies came from
  the default stream only) and registers w2 for the extra-large path, reduced in place when w1's hook, on the
  default stream, flushes it. 0.19.8 makes that reduction wait for the default stream only and reduces zeros.
  (w3 is needed: had w2's hook found the bucket empty, 0.19.8's flush of the empty bucket would have made the
  reduction stream wait for the side stream, by accident.)
buffer_reuse (w1..w6: 262,144 each, two per bucket): the flush of (w6, w5) from buffer 0 is delayed by a sleep
  kernel on the reducing stream; (w4, w3) fill buffer 1; w2's flush hands buffer 0 back and w2 is copied to its
  start; w1's hook runs on the side stream, with a gradient ready since before the step (the side stream has not
  synchronized with the default stream since the flush, as a side stream of real multi-stream work need not), and
  copies into w5's slot. 0.19.8 does not order that copy after the pending reduction, which then reads w1's
  gradient as w5's (without overlap_comm: the single buffer, whose previous reduction is (w4, w3)'s).

Self-checks, per injected step (the scenario must happen, or the case proves nothing): hooks in the expected order,
all entered on the default stream; oversized: the reduction of w2 is issued from another stream than the side
stream while the side stream is still busy (queried when it is issued, before any wait the fix adds); buffer_reuse:
when w1's copy is issued, the last reduction of its buffer is still pending and covers the slot written. Step 0 is
not injected (warm-up). The applied gradient (w_before - w_after) / lr is compared with a reference computed
without DeepSpeed (same weights and batches, all-reduced by hand). --cpu-dry-run: gloo on CPU, no streams.
"""

import argparse
import contextlib
import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, run_worker  # noqa: E402

D = 512
BATCH = 32
STEPS = 3
LR = 1.0
BUCKET_ELEMS = 2 * D * D
# About half a second on an H200: far longer than the host takes from the injection to the racing operation.
SLEEP_CYCLES = 1_000_000_000
# fp32; (w_before - w_after) / lr matches the reference to ~1e-6 relative. A race gives O(1).
REL_TOL = 1e-3
# Layer widths of the chain (w_k: widths[k] x widths[k-1]) and the weight whose hook is injected.
VARIANTS = {"oversized": ([D, D, 3 * D, 64], "w2"), "buffer_reuse": ([D] * 7, "w1")}
# name: (zero stage, overlap_comm, variant, side stream, optimizer offload). The overlap cases are the two gaps
# left by https://github.com/deepspeedai/DeepSpeed/pull/8080, one each; no_overlap: the same injections without
# overlap_comm, where 0.19.8 orders nothing at all;
# single_stream: controls.
CASES = {
    "z1_overlap_oversized": (1, True, "oversized", True, False),
    "z2_overlap_oversized": (2, True, "oversized", True, False),
    "z1_overlap_buffer_reuse": (1, True, "buffer_reuse", True, False),
    "z2_overlap_buffer_reuse": (2, True, "buffer_reuse", True, False),
    "z2_no_overlap_oversized": (2, False, "oversized", True, False),
    "z2_no_overlap_buffer_reuse": (2, False, "buffer_reuse", True, False),
    "z2_overlap_oversized_single_stream": (2, True, "oversized", False, False),
    "z2_overlap_buffer_reuse_single_stream": (2, True, "buffer_reuse", False, False),
}
# For tests/stream_order_sim.py only: the offload path, ordered by events in 0.19.8 already, must stay so. Not run on
# GPUs: its copies out of the bucket test the gradient for inf/nan on the host (a host sync), which closes the window.
SIM_ONLY_CASES = {
    "z2_overlap_oversized_offload": (2, True, "oversized", True, True),
    "z2_overlap_buffer_reuse_offload": (2, True, "buffer_reuse", True, True),
}
# tests/stream_order_sim.py replaces these: simulated streams have no time, their events are always complete.
CHECK_WINDOW = True


def late_kernel():
    torch.cuda._sleep(SLEEP_CYCLES)


def chain_loss(weights, x, y):
    h = x
    for w in weights:
        h = F.linear(h, w)
    return (h - y).pow(2).mean()


class Chain(nn.Module):

    def __init__(self, widths):
        super().__init__()
        gen = torch.Generator().manual_seed(0)
        self.names = [f"w{k}" for k in range(1, len(widths))]
        for k, name in enumerate(self.names, start=1):
            weight = torch.randn(widths[k], widths[k - 1], generator=gen) * widths[k - 1]**-0.5
            self.register_parameter(name, nn.Parameter(weight))

    def forward(self, x, y):
        return chain_loss([getattr(self, n) for n in self.names], x, y)


def make_batch(widths, rank, step, device):
    gen = torch.Generator().manual_seed(4004 + 100 * rank + step)
    x = torch.randn(BATCH, widths[0], generator=gen)
    return x.to(device), torch.randn(BATCH, widths[-1], generator=gen).to(device)


def reference_grads(weights, x, y, world_size):
    """Local and averaged gradients of the same loss, without DeepSpeed."""
    leaves = [w.detach().clone().requires_grad_(True) for w in weights]
    local = torch.autograd.grad(chain_loss(leaves, x, y), leaves)
    averaged = [g.clone() for g in local]
    for g in averaged:
        torch.distributed.all_reduce(g)
        g.div_(world_size)
    return local, averaged


def ds_config(stage, overlap_comm, offload):
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {
            "stage": stage,
            "overlap_comm": overlap_comm,
            "contiguous_gradients": True,
            "reduce_scatter": True,
            "reduce_bucket_size": BUCKET_ELEMS,
        },
        "gradient_clipping": 0.0,  # 0.19.8 clips to 1.0 by default; the reference is unclipped
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 1_000_000,
    }
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
        config["zero_force_ds_cpu_optimizer"] = False  # plain torch SGD on the host
    return config


def run_case(case, device, rank, world_size, step_context=None):
    """Run one case; step_context(step, engine), when given, wraps each step's forward, backward and optimizer step."""
    import deepspeed
    import deepspeed.runtime.zero.stage_1_and_2 as zero12

    stage, overlap_comm, variant, use_side, offload = {**CASES, **SIM_ONLY_CASES}[case]
    widths, target = VARIANTS[variant]
    torch.manual_seed(0)
    model = Chain(widths).to(device)
    config = ds_config(stage, overlap_comm, offload)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           optimizer=torch.optim.SGD(model.parameters(), lr=LR),
                                           config=config)
    zero = engine.optimizer
    accel = zero12.get_accelerator()
    streams = accel.current_stream() is not None  # False on the CPU accelerator (--cpu-dry-run)
    side = accel.Stream() if use_side and streams else None
    params = {n: getattr(engine.module, n) for n in engine.module.names}
    name_of = {id(p): n for n, p in params.items()}
    rec = dict(zero_optimizer=type(zero).__name__, cpu_offload=zero.cpu_offload, problems=[], windows=[])
    rec["rel_err"] = {n: [] for n in params}
    st = {}

    def record_event(stream):
        if accel.Event is None:  # an accelerator without events (the CPU simulator's): no window to check
            return None
        event = accel.Event()
        event.record(stream)
        return event

    def stream_name(stream):
        return "side" if stream == side else "default" if stream == accel.default_stream() else str(stream)

    original_entry = zero.reduce_independent_p_g_buckets_and_remove_grads
    original_flush = zero.reduce_ipg_grads
    original_average = zero.average_tensor

    def entry(param, i):
        name = name_of[id(param)]
        st["hooks"].append((name, stream_name(accel.current_stream()) if streams else "host"))
        if not st["inject"] or name != target:
            return original_entry(param, i)
        current = accel.current_stream()
        producer = side or current
        bucket = zero.ipg_buckets[param.dtype]
        if variant == "oversized":
            st["bucket_before"] = bucket.elements
            grad = param.grad
            st["keep"].append(grad.clone())
            grad.zero_()  # not produced yet: the producer stream writes it, late
            if streams:
                producer.wait_stream(current)
            with accel.stream(producer):
                if streams:
                    late_kernel()
                grad.copy_(st["keep"][-1])
                st["late_done"] = record_event(producer) if streams else None
                return original_entry(param, i)
        pending = st["flush_done"].get(bucket.index)
        st["window"] = {
            "buffer": bucket.index,
            "offset": bucket.elements,
            "previous_elements": st["flush_elements"].get(bucket.index, 0),
            "pending": None if pending is None or not CHECK_WINDOW else not pending.query(),
        }
        with accel.stream(producer):
            param.grad = st["local"][name].clone()  # ready since before the step
            return original_entry(param, i)

    def flush(*args, **kwargs):
        bucket = next(iter(zero.ipg_buckets.values()), None)
        index, elements = (bucket.index, bucket.elements) if bucket is not None else (None, 0)
        reducing = zero.reduction_stream if overlap_comm else accel.current_stream()
        if st["inject"] and variant == "buffer_reuse" and st["flushes"] == 0 and streams:
            with accel.stream(reducing):
                late_kernel()
        st["flushes"] += 1
        result = original_flush(*args, **kwargs)
        if elements and bucket.elements == 0:
            st["flush_elements"][index] = elements
            if streams:
                st["flush_done"][index] = record_event(reducing)
        return result

    def average_tensor(tensor, dtype, *args, **kwargs):
        if st["inject"] and variant == "oversized" and zero.extra_large_param_to_reduce.get(dtype) is params[target]:
            late = st["late_done"]
            st["window"] = {
                "bucket_before": st["bucket_before"],
                "issued_on": stream_name(accel.current_stream()) if streams else "host",
                "producer_busy": None if late is None or not CHECK_WINDOW else not late.query(),
            }
        return original_average(tensor, dtype, *args, **kwargs)

    zero.reduce_independent_p_g_buckets_and_remove_grads = entry
    zero.reduce_ipg_grads = flush
    zero.average_tensor = average_tensor
    for step in range(STEPS):
        x, y = make_batch(widths, rank, step, device)
        before = {n: p.detach().clone() for n, p in params.items()}
        local, ref = reference_grads(list(before.values()), x, y, world_size)
        accel.synchronize()
        st.update(inject=step > 0, hooks=[], keep=[], flushes=0, flush_done={}, flush_elements={}, window=None)
        st.update(late_done=None, bucket_before=None, local=dict(zip(params, local)))
        with (step_context(step, engine) if step_context else contextlib.nullcontext()):
            engine.backward(engine(x, y))
            engine.step()
        accel.synchronize()
        for (n, p), r in zip(params.items(), ref):
            applied = (before[n] - p.detach()) / LR
            rec["rel_err"][n].append(((applied - r).norm() / r.norm()).item())
        if st["inject"]:
            rec["windows"].append(st["window"])
            rec["problems"] += [f"step {step}: {p}" for p in scenario_problems(st, list(params), variant, side)]
    zero.reduce_independent_p_g_buckets_and_remove_grads = original_entry
    zero.reduce_ipg_grads = original_flush
    zero.average_tensor = original_average
    engine.destroy()
    return rec


def scenario_problems(st, names, variant, side):
    """What kept the race window of this step from opening as designed (empty: it opened)."""
    problems = []
    order = [n for n, _ in st["hooks"]]
    if order != names[::-1]:
        problems.append(f"hook order {order}, expected {names[::-1]}")
    if any(s not in ("default", "host") for _, s in st["hooks"]):
        problems.append(f"hooks not entered on the default stream: {st['hooks']}")
    w = st["window"]
    if w is None:
        return problems + ["the injected operation did not happen"]
    if variant == "oversized":
        if not w["bucket_before"]:
            problems.append("the oversized gradient's hook found the bucket empty (its flush orders the reduction)")
        if side is not None and w["issued_on"] == "side":
            problems.append("the oversized gradient was reduced from the stream that produced it")
        if w["producer_busy"] is False:
            problems.append("the producer stream was idle when the oversized gradient's reduction was issued")
    else:
        if not w["offset"] < w["previous_elements"]:
            problems.append(f"the copy does not land in the range of the buffer's previous reduction: {w}")
        if w["pending"] is False:
            problems.append("the buffer's previous reduction was complete when the copy was issued")
    return problems


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    parser.add_argument("--cpu-dry-run", action="store_true", help="gloo on CPU (DS_ACCELERATOR=cpu), no streams")
    args = parser.parse_args()
    import deepspeed

    if args.cpu_dry_run:
        deepspeed.init_distributed(dist_backend="gloo")
        device = torch.device("cpu")
        report["deepspeed_version"] = deepspeed.__version__
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl")
        describe(report)
        torch.backends.cuda.matmul.allow_tf32 = False
    report.update(rel_tol=REL_TOL, bucket_elems=BUCKET_ELEMS, sleep_cycles=SLEEP_CYCLES, steps=STEPS, cases={})
    for case in args.cases:
        report["cases"][case] = {"reached": "start"}
        report.write()
        rec = run_case(case, device, report["rank"], report["world_size"])
        rec["reached"] = "done"
        report["cases"][case] = rec
        report.write()


if __name__ == "__main__":
    if "--cpu-dry-run" in sys.argv:
        os.environ["DS_ACCELERATOR"] = "cpu"
    run_worker("overlap_comm_stream_order", main)
