"""One subject of tools/bench, resident: warm up, then run a timed block of steps whenever the driver asks.

  python tools/bench_step.py --subject S --model M --seq N --batch B --ctl DIR --id ID [--warmup W] [--steps N]
                             [--deadline SECONDS]
  python tools/bench_step.py --peak --ctl DIR --id ID      the bf16 matrix-multiply rate of this GPU and the host's
                                                           rate of tiny ops, then exit

Protocol (files in DIR, written by rank 0): ID.ready after the warm-up (JSON), then for each DIR/ID.go.K the driver
writes, ID.res.K (JSON: the seconds of each step of the block, peak memory during it); ID.phases during the warm-up
(where its time went so far, tools/warmup_phases.py); for DIR/ID.profile (holding
a trace path), ID.prof (profile_steps: where a profiled step's time goes); DIR/ID.stop ends the process.
Started under torchrun for several GPUs (every rank polls the same files). Past --deadline seconds the process
prints every thread's Python stack and exits (faulthandler), so a hang is a failure with its stacks, never a stall.
"""

import argparse
import bisect
import contextlib
import faulthandler
import json
import logging
import os
import re
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_cells import MODELS, flops_per_token  # noqa: E402
import warmup_phases  # noqa: E402

POLL_S = 0.002


def write(path, obj):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def wait_for(paths):
    while True:
        for p in paths:
            if os.path.exists(p):
                return p
        time.sleep(POLL_S)


def device():
    import torch
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(dev):
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def exit_rank():
    """End a rank whose results are written, without the interpreter's shutdown. A gloo thread may still be releasing
    a collective that holds Python tensors (ZeRO-3's all-gathers): it takes the GIL while the interpreter finalizes,
    and the process aborts after its work is done ("terminate called without an active exception", exit -6)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def matmul_peak(dev):
    """bf16 TFLOP/s of an 8192^3 matrix product (the mean of 10 after 3 warm-ups; 512^3 on a CPU)."""
    import torch
    n = 8192 if dev.type == "cuda" else 512
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sync(dev)
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    sync(dev)
    return 2 * n**3 * 10 / (time.perf_counter() - start) / 1e12


def host_ops_rate(dev):
    """Tiny ops a second this host launches: 20,000 in-place adds to a one-element tensor after 1,000 warm-ups. A step
    the host bounds is made of such per-op work, and hosts of one GPU kind differ in it (docs/bench.md)."""
    import torch
    x = torch.zeros(1, device=dev)
    for _ in range(1000):
        x.add_(1)
    sync(dev)
    start = time.perf_counter()
    for _ in range(20000):
        x.add_(1)
    sync(dev)
    return 20000 / (time.perf_counter() - start)


def host_cpu():
    """The CPU's model name (/proc/cpuinfo) and the cores this process may use."""
    name = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


PROFILED_STEPS = 3
# Where the time of a profiled step goes: the first category whose pattern a kernel's (on a CPU: an aten op's)
# name matches, case-insensitive.
CATEGORIES = (
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|broadcast|all_to_all", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|_efficient_attention|cudnn.*(mha|attn)", re.I)),
    ("matmul", re.compile(r"gemm|matmul|\bmm\b|addmm|bmm|cutlass|xmma|cublas|nvjet|linear", re.I)),
    ("optimizer", re.compile(r"adam|_foreach_|multi_tensor|lamb|sgd", re.I)),
    ("copies and casts", re.compile(r"copy|cast|_to_copy|memcpy|memset|convert|contiguous|\bcat\b|clone|fill", re.I)),
)


def category(name):
    return next((cat for cat, pattern in CATEGORIES if pattern.search(name)), "other")


def communication_kernels(kernels, n):
    """(name, device microseconds) of every kernel of n steps -> per communication kernel (its name up to the
    argument list): launches and milliseconds a step. The categories say how long communication took; this says
    which collectives, and how many, a step issues (all-gathers against reduce-scatters, one version against
    another)."""
    out = {}
    for name, us in kernels:
        if category(name) == "communication":
            row = out.setdefault(name.split("(")[0][:80], {"per_step": 0.0, "ms": 0.0})
            row["per_step"] += 1 / n
            row["ms"] += us / 1e3 / n
    return out


PHASES = ("forward", "backward", "optimizer")
_phase_ranges = False


def phase(name):
    """A `bench:NAME` record_function range around one phase of a step while profile_steps runs (split_chrome_trace
    sorts each kernel into the phase that launched it); nothing outside profiling."""
    if not _phase_ranges:
        return contextlib.nullcontext()
    import torch
    return torch.profiler.record_function(f"bench:{name}")


def profile_steps(step, dev, n, trace):
    """Run n steps under torch.profiler; write the Chrome trace to `trace` (if given) and return, per step, the
    device time of each kernel category, the device's idle time between kernels within the steps, the wall time,
    and the count of host-side aten ops. On a CPU, categories are of the aten ops' own CPU time."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    global _phase_ranges
    sync(dev)
    start = time.perf_counter()
    _phase_ranges = True
    try:
        with profile(activities=activities) as prof:
            for _ in range(n):
                step()
            sync(dev)
    finally:
        _phase_ranges = False
    wall = (time.perf_counter() - start) / n
    if trace:
        prof.export_chrome_trace(trace)
    return summarize_profile(prof.events(), n, wall, dev.type == "cuda")


def summarize_profile(events, n, wall, on_device):
    """The profiler's events of n steps (wall seconds a step) -> the per-step summary profile_steps returns. On a
    device only its kernels, copies and memsets count: a record_function range (the c10d collectives' `nccl:*`, an
    optimizer's `Optimizer.step#*`) also comes back as a device event, spanning the kernels launched inside it, and
    counting it would count those kernels twice and the gaps between them as busy (torch's own device-time totals
    leave these out)."""
    from torch.autograd import DeviceType
    kernels = [e for e in events if (e.device_type == DeviceType.CUDA) == on_device and
               (not e.is_user_annotation if on_device else e.name.startswith("aten::"))]
    by_cat = {}
    for e in kernels:
        us = e.time_range.elapsed_us() if on_device else e.self_cpu_time_total
        by_cat[category(e.name)] = by_cat.get(category(e.name), 0.0) + us / 1e3 / n
    summary = {"steps": n, "wall_ms": wall * 1e3, "device_ms": by_cat,
               "host_aten_ops": sum(1 for e in events if e.device_type == DeviceType.CPU and
                                    e.name.startswith("aten::")) / n}
    if on_device and kernels:
        spans = [(e.time_range.start, e.time_range.end, category(e.name)) for e in kernels]
        summary.update({f"{k}_ms": us / 1e3 / n for k, us in device_time_split(spans).items()})
        summary["device_idle_ms"] = max(0.0, wall * 1e3 - summary["device_busy_ms"])
        summary["communication_kernels"] = communication_kernels(
            [(e.name, e.time_range.elapsed_us()) for e in kernels], n)
    return summary


def rank_trace(path, rank):
    """Where a rank writes its trace: PATH for rank 0, PATH's stem + .rankN.json for rank N. Every rank writes one: at
    several ranks a collective's kernel runs until the last rank arrives, so only the other ranks' traces tell
    communication from waiting for a slower rank."""
    if rank == 0:
        return path
    stem, ext = os.path.splitext(path)
    return f"{stem}.rank{rank}{ext}"


def merged(spans):
    """The (start, end) intervals -> their union, as sorted disjoint intervals."""
    out = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return out


def covered(spans):
    """The length of the union of the (start, end) intervals."""
    return sum(b - a for a, b in merged(spans))


def uncovered(a, b, union):
    """How much of (a, b) the sorted disjoint intervals `union` leave uncovered."""
    i = bisect.bisect_right(union, [a, float("inf")]) - 1
    left = b - a
    for lo, hi in union[max(i, 0):]:
        if lo >= b:
            break
        left -= max(0.0, min(b, hi) - max(a, lo))
    return left


LONGEST_WAITS = 12
# The kernels a phase's split names (by device time), each by the first characters of its name.
TOP_KERNELS, KERNEL_NAME_CHARS = 10, 120


def split_chrome_trace(path, steps=PROFILED_STEPS):
    """The Chrome trace of `steps` profiled steps (--profile writes them to OUT/traces) -> per step, in ms: each kernel
    category's device time, the time any kernel ran, and the time communication ran exposed (device_time_split).
    Kernels, copies and memsets count, as in summarize_profile; `gpu_user_annotation` ranges do not.

    Where the trace has the step's `bench:` phase ranges (profile_steps records them), also per phase (the host range
    that launched the kernel: forward, backward, optimizer): the same split, the exposed communication of each
    collective (its kernel's name up to the argument list; a collective overlapping another counts in both), the
    trace's longest single waits, each with its offset into its phase, and where the device sat idle: within each
    phase, and before its first kernel since the phase before it ended; its longest-running kernels by name, with
    their launches and time a step; and the aten ops the host ran in it a step (those the ops call included), where
    a step bound by the host spends its time."""
    with open(path) as f:
        events = json.load(f).get("traceEvents", [])
    device_events = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    kernels = [(e["ts"], e["ts"] + e["dur"], category(e["name"])) for e in device_events]
    if not kernels:
        raise ValueError(f"{path}: no device kernels in this trace")
    split = {f"{k}_ms": us / 1e3 / steps for k, us in device_time_split(kernels).items()}
    split["device_ms"] = {}
    for a, b, cat in kernels:
        split["device_ms"][cat] = split["device_ms"].get(cat, 0.0) + (b - a) / 1e3 / steps
    ranges = sorted((e["ts"], e["ts"] + e["dur"], e["name"][len("bench:"):]) for e in events
                    if e.get("cat") == "user_annotation" and e.get("name", "").startswith("bench:"))
    if not ranges:
        return split
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    starts = [r[0] for r in ranges]

    def range_of(e):
        ts = launched.get(e.get("args", {}).get("correlation"))
        if ts is None:
            return "unattributed", None
        i = bisect.bisect_right(starts, ts) - 1
        return (ranges[i][2], i) if i >= 0 and ts <= ranges[i][1] else ("between phases", None)

    computing = merged((a, b) for a, b, cat in kernels if cat != "communication")
    split["phases"], exposed, by_range = {}, [], {}
    for e, (a, b, cat) in zip(device_events, kernels):
        name, i = range_of(e)
        if i is not None:
            by_range.setdefault(i, []).append((a, b))
        row = split["phases"].setdefault(name, {"spans": [], "exposed_by_collective": {}, "kernels": {}})
        row["spans"].append((a, b, cat))
        kernel = row["kernels"].setdefault(e["name"][:KERNEL_NAME_CHARS], {"per_step": 0.0, "ms": 0.0})
        kernel["per_step"] += 1 / steps
        kernel["ms"] += (b - a) / 1e3 / steps
        if cat == "communication":
            collective = e["name"].split("(")[0][:80]
            got = row["exposed_by_collective"].setdefault(collective, {"per_step": 0.0, "ms": 0.0,
                                                                       "exposed_ms": 0.0})
            got["per_step"] += 1 / steps
            got["ms"] += (b - a) / 1e3 / steps
            got["exposed_ms"] += uncovered(a, b, computing) / 1e3 / steps
            exposed.append((uncovered(a, b, computing), a, b, name, i, collective))
    first_kernel = {i: min(a for a, _ in spans) for i, spans in by_range.items()}
    # The longest waits, each at its offset from its phase's first kernel on the device: a wait at 0 ms is a
    # collective nothing could run before.
    for wait, a, b, name, i, collective in sorted(exposed, key=lambda x: -x[0])[:LONGEST_WAITS]:
        split["phases"][name].setdefault("longest_waits", []).append(
            {"exposed_ms": wait / 1e3, "collective_ms": (b - a) / 1e3, "collective": collective,
             "at_ms": (a - first_kernel[i]) / 1e3 if i is not None else None})
    host_ops = sorted(e["ts"] for e in events if e.get("cat") == "cpu_op" and e.get("name", "").startswith("aten::"))
    for row in split["phases"].values():
        spans = row.pop("spans")
        top = sorted(row.pop("kernels").items(), key=lambda kv: -kv[1]["ms"])[:TOP_KERNELS]
        row["top_kernels"] = [dict(name=k, **v) for k, v in top]
        row["device_ms"] = {}
        for a, b, cat in spans:
            row["device_ms"][cat] = row["device_ms"].get(cat, 0.0) + (b - a) / 1e3 / steps
        row["busy_ms"] = covered([(a, b) for a, b, _ in spans]) / 1e3 / steps
        comm = merged((a, b) for a, b, cat in spans if cat == "communication")
        row["exposed_communication_ms"] = sum(uncovered(a, b, computing) for a, b in comm) / 1e3 / steps
    # Where the device sat idle: inside each phase (between its first kernel and its last), and between the end of
    # the phase before and a phase's first kernel (a host that synchronized, or launched too slowly, in between).
    last_end = None
    for i in sorted(by_range):
        spans, name = by_range[i], ranges[i][2]
        first, last = first_kernel[i], max(b for _, b in spans)
        row = split["phases"][name]
        row["idle_within_ms"] = row.get("idle_within_ms", 0.0) + (last - first - covered(spans)) / 1e3 / steps
        if last_end is not None:
            row["idle_before_ms"] = row.get("idle_before_ms", 0.0) + max(0.0, first - last_end) / 1e3 / steps
        last_end = last if last_end is None else max(last_end, last)
    for start, end, name in ranges:
        if name in split["phases"]:
            ops = bisect.bisect_right(host_ops, end) - bisect.bisect_left(host_ops, start)
            row = split["phases"][name]
            row["host_aten_ops"] = row.get("host_aten_ops", 0.0) + ops / steps
    return split


def device_time_split(kernels):
    """(start, end, category) of every kernel -> the time any kernel ran (device_busy), and the time a
    communication kernel ran while no other kernel did (exposed_communication): communication that computation
    did not hide. In the unit of the spans."""
    busy = covered([(a, b) for a, b, _ in kernels])
    computing = covered([(a, b) for a, b, cat in kernels if cat != "communication"])
    return {"device_busy": busy, "exposed_communication": busy - computing}


def build_model(name, dev=None):
    """The model, in fp32, its weights initialized on `dev` (an 8B model's initialization takes minutes on a host's
    CPU, seconds on a GPU); its parameter count, the count a token does not compute with, (layers, hidden size)."""
    import torch
    import transformers
    cls, sizes = MODELS[name]
    config = getattr(transformers, cls)(**sizes, max_position_embeddings=8192)
    torch.manual_seed(0)
    with torch.device(dev or "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    n_all = sum(p.numel() for p in model.parameters())
    n_embed = model.get_input_embeddings().weight.numel()
    shape = (config.num_hidden_layers, config.hidden_size)
    return model, n_all, n_embed + inactive_expert_params(model), shape


def inactive_expert_params(model):
    """Parameters of the experts a token does not go through: (E - k) / E of the routed experts' parameters (E experts,
    k chosen per token); 0 for a dense model. A shared expert every token uses is not a routed one."""
    config = model.config
    experts = getattr(config, "num_experts", None) or getattr(config, "num_local_experts", None)
    chosen = getattr(config, "num_experts_per_tok", None)
    if not experts or not chosen:
        return 0
    routed = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    return routed * (experts - chosen) // experts


def reduce_bucket_size(subject, hidden_size):
    """zero_optimization.reduce_bucket_size of a subject, in elements: `-rbauto` what the Hugging Face Trainer
    fills in for "auto" (hidden_size squared, as its DeepSpeed integration does), `-rb1e8` 10**8; None (DeepSpeed's
    default, 5e8) for the others."""
    tail = subject.rsplit("-", 1)[-1]
    if not tail.startswith("rb"):
        return None
    return hidden_size * hidden_size if tail == "rbauto" else int(float(tail[2:]))


def ds_config(stage, deepcompile, overlap_comm, micro_batch, bf16_states=False, reduce_bucket=None,
              blocks_once=False):
    zero = {"stage": stage}
    if reduce_bucket is not None:
        zero["reduce_bucket_size"] = reduce_bucket
    if stage in (1, 2):
        zero["overlap_comm"] = overlap_comm
    bf16 = {"enabled": True}
    if bf16_states:
        # What `compile` trains with: no fp32 master weights, gradients or optimizer states.
        bf16.update(bf16_master_weights_and_grads=True, bf16_optimizer_states=True)
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": 1, "bf16": bf16,
            "zero_optimization": zero, "zero_allow_untested_optimizer": True, "steps_per_print": 10**9,
            "wall_clock_breakdown": False,
            **({"compile": {"deepcompile": True, **({"compile_blocks_once": True} if blocks_once else {})}}
               if deepcompile else {})}


class SelectiveGatherLog(logging.Handler):
    """DeepCompile ZeRO-3's selective_gather records (DeepSpeed's logger, INFO, rank 0) during the warm-up.

    The pass chooses which parameters stay gathered from the device's free memory, which counts every process on the
    GPU: two runs of one version, or a version beside another on the same GPUs, can plan differently. The records
    go into the row (bench.json) and its table. DeepSpeed's own handler keeps its level (WARNING), so the log file
    prints what it printed before, and finish() restores the logger's level before the timed steps.
    """

    def __init__(self):
        super().__init__(logging.INFO)
        from deepspeed.utils import logger
        self.logger, self.level_before, self.lines = logger, logger.level, []
        logger.addHandler(self)
        if logger.getEffectiveLevel() > logging.INFO:
            logger.setLevel(logging.INFO)

    def emit(self, record):
        msg = record.getMessage()
        if "selective_gather" in msg:
            self.lines.append(msg)

    def finish(self):
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level_before)
        return self.lines


def skip_causal_mask_under_compile():
    """Make transformers pass SDPA no mask and is_causal=True under torch.compile, as it does in eager, when no token is
    padded (no attention mask given): the `-causal` subjects.

    transformers decides in masking_utils._ignore_causal_mask_sdpa. Up to 5.17 it never skips the mask while Dynamo
    traces; from 5.18 it skips it when there is no padding mask to read, but only on torch >= 2.14, where Dynamo stops
    folding torch.compiler.is_exporting() to True. A whole-model compile (DeepCompile compiles the whole model) on
    older versions gets a materialized causal mask, which SDPA's flash kernel does not take; a per-block compile
    (fsdp2) builds the mask outside the compiled code and does not. The bench never exports and passes no padding."""
    import inspect
    import torch
    import transformers.masking_utils as masking_utils
    decide = masking_utils._ignore_causal_mask_sdpa
    params = inspect.signature(decide)

    def ignore_causal_mask_sdpa(*args, **kwargs):
        a = params.bind(*args, **kwargs)
        a.apply_defaults()
        v = a.arguments
        window = v.get("local_attention_size")
        if v["padding_mask"] is None and not isinstance(v["q_offset"], torch.Tensor) and not (
                window is not None and v["kv_length"] >= window):
            return v["q_length"] == 1 or v["kv_length"] == v["q_length"] or v["q_offset"] == 0
        return decide(*args, **kwargs)

    masking_utils._ignore_causal_mask_sdpa = ignore_causal_mask_sdpa


def pytorch_step(fwd, opt, dev, ids, amp=False):
    """One training step of a model PyTorch trains on its own (torch.compile, FSDP2), bf16 autocast if `amp`."""
    import torch

    def step(x=ids):
        with phase("forward"), torch.autocast(dev.type, dtype=torch.bfloat16, enabled=amp):
            loss = fwd(input_ids=x, labels=x).loss
        with phase("backward"):
            loss.backward()
        with phase("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    return step


def make_step(subject, model, dev, batch):
    """A function running one training step of `subject` on `model`; the engine, if any. The step trains on `batch`,
    or on the token ids it is given (tools/steady-state: a length of its own every step)."""
    import torch
    fused = dict(fused=True) if dev.type == "cuda" else {}
    ids = batch
    if subject.endswith("-causal"):
        skip_causal_mask_under_compile()
        subject = subject.removesuffix("-causal")
    if subject in ("torch", "compile", "compile-amp"):
        # compile-amp: what DeepSpeed's bf16 keeps, fp32 weights and optimizer states, with bf16 compute (autocast).
        amp = subject == "compile-amp"
        model = model.to(dev) if amp else model.to(dev, torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
        fwd = torch.compile(model) if subject.startswith("compile") else model
        return pytorch_step(fwd, opt, dev, ids, amp), None
    if subject == "fsdp2":
        import torch.distributed as dist
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        if not dist.is_initialized():
            dist.init_process_group("nccl" if dev.type == "cuda" else "gloo")
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = model.to(dev)
        for layer in model.model.layers:
            layer.compile()
            fully_shard(layer, mp_policy=mp)
        fully_shard(model, mp_policy=mp)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
        return pytorch_step(model, opt, dev, ids), None
    import deepspeed
    kind, stage = subject.split("-")[:2]
    cfg = ds_config(int(stage[1:]), kind == "dc", subject.endswith("-oc"), ids.shape[0], subject.endswith("-bf16"),
                    reduce_bucket_size(subject, model.config.hidden_size), subject.endswith("-blocks"))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
    if subject.endswith("-pad"):
        import torch._inductor.config as inductor_config
        inductor_config.force_shape_pad = True
    if kind == "dc":
        engine.compile()

    def step(x=ids):
        with phase("forward"):
            loss = engine(input_ids=x, labels=x).loss
        with phase("backward"):
            engine.backward(loss)
        with phase("optimizer"):
            engine.step()

    return step, engine


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--subject")
    ap.add_argument("--model")
    ap.add_argument("--seq", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ctl", required=True)
    ap.add_argument("--id", required=True)
    ap.add_argument("--deadline", type=float, default=540)
    ap.add_argument("--peak", action="store_true")
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.deadline, exit=True)
    rank = int(os.environ.get("RANK", "0"))
    base = os.path.join(args.ctl, args.id)
    try:
        import torch
        dev = device()
        if args.peak:
            import transformers
            write(base + ".ready", {"peak_tflops": matmul_peak(dev), "host_ops_per_s": host_ops_rate(dev),
                                    "host_cpu": host_cpu(), "torch": torch.__version__,
                                    "transformers": transformers.__version__,
                                    "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"})
            return
        import transformers
        model, n_all, n_not_computed, (layers, hidden) = build_model(args.model, dev)
        torch.manual_seed(1)
        ids = torch.randint(3, model.config.vocab_size, (args.batch, args.seq), device=dev)
        if dev.type == "cuda":
            torch.cuda.reset_peak_memory_stats(dev)
        # Where the warm-up's time goes; rank 0 keeps ID.phases current, so a warm-up cut by its deadline says
        # how far it got.
        clock = warmup_phases.PhaseClock(on_update=(lambda steps: write(base + ".phases", steps)) if rank == 0
                                         else None)
        missing = warmup_phases.install(clock, deepspeed=args.subject.startswith(("ds-", "dc-")))
        step, _ = make_step(args.subject, model, dev, ids)
        warmup, plan = args.warmup, None
        if args.subject.startswith("dc-z3"):
            # DeepCompile ZeRO-3 compiles every graph again at its WARMUP step: a timed block must not hold it.
            from deepspeed.compile.init_z3 import WARMUP
            warmup = max(warmup, WARMUP + 2)
            plan = SelectiveGatherLog()
        t0 = time.perf_counter()
        for k in range(warmup):
            clock.begin(k)
            step()
            sync(dev)
            clock.end()
            if k == 0:
                first = time.perf_counter() - t0
        warm = time.perf_counter() - t0
        gathered = plan.finish() if plan is not None else None
        world = int(os.environ.get("WORLD_SIZE", "1"))
        info = {"first_step_s": first, "warmup_s": warm, "warmup_steps": warmup, "params": n_all,
                "flops_per_step": (flops_per_token(n_all - n_not_computed, layers, hidden, args.seq) * args.batch
                                   * args.seq),
                "tokens_per_step": args.batch * args.seq * world, "world_size": world,
                "torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES")}
        try:
            import deepspeed
            info["deepspeed"] = deepspeed.__version__
            info["deepspeed_file"] = deepspeed.__file__
        except ImportError:
            pass
        if dev.type == "cuda":
            info["peak_allocated"] = torch.cuda.max_memory_allocated(dev)
            info["peak_reserved"] = torch.cuda.max_memory_reserved(dev)
        if gathered is not None:
            info["selective_gather"] = gathered
        info["warmup_phases"] = clock.steps
        info["compile_cache_counters"] = warmup_phases.cache_counters()
        if missing:
            info["warmup_phase_targets_missing"] = missing
        if rank == 0:
            write(base + ".ready", info)
        k, profiled = 0, False
        while True:
            # Every rank reads the same request files and leaves them in place (a rank removing one would hide it
            # from the others, which would then wait in another step's collectives): the profile request is taken
            # once.
            got = wait_for([f"{base}.go.{k}", base + ".stop"] + ([] if profiled else [base + ".profile"]))
            if got.endswith(".stop"):
                exit_rank()
            if got.endswith(".profile"):
                profiled = True
                with open(got) as f:
                    trace = f.read().strip()
                summary = profile_steps(step, dev, PROFILED_STEPS, rank_trace(trace, rank))
                if rank == 0:
                    write(base + ".prof", summary)
                continue
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            times = []
            sync(dev)
            for _ in range(args.steps):
                t = time.perf_counter()
                step()
                sync(dev)
                times.append(time.perf_counter() - t)
            res = {"step_s": times}
            if dev.type == "cuda":
                res["peak_allocated"] = torch.cuda.max_memory_allocated(dev)
                res["peak_reserved"] = torch.cuda.max_memory_reserved(dev)
            if rank == 0:
                write(f"{base}.res.{k}", res)
            k += 1
    except BaseException as exc:  # the driver reads the error instead of waiting for a file that never comes
        import traceback
        if rank == 0:
            write(base + ".error", {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()})
        raise


if __name__ == "__main__":
    main()
