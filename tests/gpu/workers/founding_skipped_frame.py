"""Worker for test_founding_fixes.py, upstream PR #8059: with ZeRO-3 and DeepCompile, parameters used
in a frame that Dynamo does not compile must be gathered there, stay gathered until the backward through
that frame is done, and be released afterwards.

The model (bf16, every parameter partitioned: stage3_param_persistence_threshold 0)::

    h = embed frame(ids)       # skipped: torch.embedding(self.embed.weight, ids)
    h = relu(pre(h))           # compiled graph 1
    h = mix frame(h)           # skipped: h + linear(h, self.mid.weight)
    h = relu(post(h))          # compiled graph 2, with the output projection and the loss
    logits = head(h)           # or linear(h, self.embed.weight) in the "tied" variant

The frames are skipped with torch.compiler.disable (variants "disable" and "tied") or by a graph break
inside a for loop (variant "loop"). They use the weights through torch.embedding / F.linear on module
attributes, so no nested Python frame (which Dynamo would compile on its own) holds the parameter use.
Gradients of pre.weight flow back through the mix frame, whose backward needs mid.weight gathered.

The worker first runs one step of eager ZeRO-3 (reference gradients, by safe_get_full_grad), then 4
steps of DeepCompile on the same fixed batch. DeepSpeed 0.19.1 finds the parameter partitioned in the
skipped frame: torch.embedding fails with "'weight' must be 2-D".

The DeepCompile run also records, for the parameters used in the skipped frames, what explains a failure
(report-only figures, none asserted): the step and phase reached; who called param.partition() (the
nearest DeepSpeed frames) and when; the parameters' state after each forward; how many compiled entries
Dynamo holds for the __getitem__ of the class of module._parameters (non-zero: Dynamo compiled the ZeRO-3
getter as a frame of its own, so its torch.compiler.is_compiling() branch is taken when it runs); and
the reduced gradients of the skipped-frame parameters against eager ZeRO-3.
Run standalone with torchrun --nproc_per_node=2 (the report is printed when $DIST_RESULT_DIR is unset).
"""

import argparse
import gc
import os
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, finite, run_worker, setup_device  # noqa: E402
import ds_configs  # noqa: E402

VOCAB = 512
HIDDEN = 256
BATCH = 4
SEQ = 32
STEPS = 4  # DeepCompile's ZeRO-3 schedule switches passes at step 5
LR = 1e-3
VARIANTS = ("disable", "loop", "tied")

# What the skipped frames saw when they ran: (frame, torch.compiler.is_compiling(), weight shape).
EAGER_FRAMES = []
# Parameters used in the skipped frames (embed.weight is also used by the compiled head when tied).
SKIPPED_FRAME_PARAMS = ("embed.weight", "mid.weight")
MAX_EVENTS = 64


class Net(nn.Module):

    def __init__(self, variant):
        super().__init__()
        self.loop = variant == "loop"
        self.tied = variant == "tied"
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pre = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.mid = nn.Linear(HIDDEN, HIDDEN, bias=False)
        self.post = nn.Linear(HIDDEN, HIDDEN, bias=False)
        if not self.tied:
            self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    @torch.compiler.disable
    def embed_disabled(self, ids):
        w = self.embed.weight
        EAGER_FRAMES.append(("embed", torch.compiler.is_compiling(), list(w.shape)))
        return torch.embedding(w, ids)

    def embed_in_loop(self, ids):
        h = ids
        for _ in range(1):
            w = self.embed.weight
            EAGER_FRAMES.append(("embed", torch.compiler.is_compiling(), list(w.shape)))
            h = torch.embedding(w, h)
            torch._dynamo.graph_break()
        return h

    @torch.compiler.disable
    def mix_disabled(self, h):
        w = self.mid.weight
        EAGER_FRAMES.append(("mix", torch.compiler.is_compiling(), list(w.shape)))
        return h + F.linear(h, w)

    def mix_in_loop(self, h):
        for _ in range(1):
            w = self.mid.weight
            EAGER_FRAMES.append(("mix", torch.compiler.is_compiling(), list(w.shape)))
            h = h + F.linear(h, w)
            torch._dynamo.graph_break()
        return h

    def forward(self, ids, labels):
        h = self.embed_in_loop(ids) if self.loop else self.embed_disabled(ids)
        h = torch.relu(self.pre(h))
        h = self.mix_in_loop(h) if self.loop else self.mix_disabled(h)
        h = torch.relu(self.post(h))
        logits = F.linear(h, self.embed.weight) if self.tied else self.head(h)
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


def compared_params(variant):
    """Parameters used only in compiled graphs, whose gradients DeepCompile reduces.

    pre.weight's gradient passes through the skipped mix frame (it needs mid.weight gathered in backward).
    Gradients of parameters used in a skipped frame are left out: they are not reduced through
    DeepCompile's graphs (see the test's notes)."""
    names = ["pre.weight", "post.weight"]
    if variant != "tied":
        names.append("head.weight")
    return names


def ds_config(deepcompile):
    return ds_configs.zero(3, BATCH, 1, LR, deepcompile=deepcompile, stage3_param_persistence_threshold=0,
                           reduce_bucket_size=1_000_000)


def make_batch(rank, device):
    gen = torch.Generator().manual_seed(8059 + rank)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    return ids.to(device), labels.to(device)


def gathered_params(module):
    """Names of parameters still holding gathered data (none is persistent here)."""
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return [
        name for name, p in module.named_parameters()
        if p.ds_status != ZeroParamStatus.NOT_AVAILABLE or p.data.numel() != 0
    ]


def full_grads(module, names):
    from deepspeed.utils import safe_get_full_grad

    params = dict(module.named_parameters())
    return {name: safe_get_full_grad(params[name]).detach().float().clone() for name in names}


def reduced_grads(module, names):
    """The averaged gradients the ZeRO-3 optimizer holds for ``names`` (report-only; never raises).

    safe_get_full_grad returns param.grad whenever it is set, and under DeepCompile param.grad of a parameter
    used in a skipped frame holds that rank's own eager gradient, so the optimizer is asked directly."""
    from deepspeed.utils import safe_get_full_grad

    params = dict(module.named_parameters())
    out = {}
    for name in names:
        p = params[name]
        try:
            z3 = getattr(p, "_z3_optimizer", None)
            g = z3.get_fp32_grad_for_param(p) if z3 is not None else safe_get_full_grad(p)
            out[name] = None if g is None else g.detach().float().clone()
        except Exception as e:  # report-only
            out[name] = f"{type(e).__name__}: {e}"
    return out


def _caller(skip_file):
    """The nearest DeepSpeed frames of the current stack, innermost last: "path:function:line"."""
    frames = [f for f in traceback.extract_stack()[:-2] if f.filename != skip_file]
    ds = [f for f in frames if "/deepspeed/" in f.filename.replace(os.sep, "/")]
    picked = ds[-3:] if ds else frames[-3:]
    return ["/".join(f.filename.replace(os.sep, "/").split("/")[-3:]) + f":{f.name}:{f.lineno}" for f in picked]


def _param_state(param):
    status = getattr(param, "ds_status", None)
    return [getattr(status, "name", str(status)), param.data.numel()]


class Probe:
    """Report-only instrumentation of the skipped-frame parameters in the DeepCompile run."""

    def __init__(self, module, rec):
        self.rec = rec
        self.where = ["init", None]  # phase, step
        self.params = dict((n, p) for n, p in module.named_parameters() if n in SKIPPED_FRAME_PARAMS)
        rec["partition_calls"] = []
        rec["state_after_forward"] = []
        rec["probe_errors"] = []
        # Nothing is hooked into autograd: holding a parameter's AccumulateGrad node would freeze the input
        # metadata it recorded while the parameter was partitioned, and change what backward does.
        for name, param in self.params.items():
            try:
                self._wrap_partition(name, param)
            except Exception as e:  # instrumentation only
                rec["probe_errors"].append(f"partition wrapper {name}: {e!r}")

    def _wrap_partition(self, name, param):
        original = param.partition
        here = os.path.abspath(__file__)

        def partition(*args, **kwargs):
            if len(self.rec["partition_calls"]) < MAX_EVENTS:
                self.rec["partition_calls"].append({
                    "param": name,
                    "phase": self.where[0],
                    "step": self.where[1],
                    "state_before": _param_state(param),
                    "caller": _caller(here),
                })
            return original(*args, **kwargs)

        param.partition = partition

    def at(self, phase, step):
        self.where[0], self.where[1] = phase, step
        self.rec["progress"] = f"step {step}: {phase}"

    def after_forward(self, step):
        self.rec["state_after_forward"].append({name: _param_state(p) for name, p in self.params.items()})


def getter_compiled_entries(module):
    """How many compiled entries Dynamo holds for the __getitem__ of the class of module._parameters."""
    params = module.__dict__.get("_parameters")
    getter = getattr(type(params), "__getitem__", None)
    code = getattr(getter, "__code__", None)
    out = {"class": f"{type(params).__module__}.{type(params).__name__}", "entries": None}
    if code is None:
        return out
    try:
        from torch._dynamo.eval_frame import _debug_get_cache_entry_list
        out["entries"] = len(_debug_get_cache_entry_list(code))
    except Exception as e:  # private API; report-only
        out["entries"] = f"unavailable: {e!r}"
    return out


def run(variant, deepcompile, steps, device, rank, rec, save):
    """Train ``steps`` steps; fill ``rec`` (already in the report) as it goes and ``save()`` the report."""
    import deepspeed

    torch.manual_seed(0)
    model = Net(variant)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(deepcompile))
    rec.update({
        "losses": [],
        "eager_frames": [],
        "gathered_after_backward": [],
        "gathered_after_step": [],
        # Shape of param.grad of the parameters used in skipped frames, after the first backward.
        "skipped_param_grads": {},
    })
    probe = Probe(engine.module, rec) if deepcompile else None
    if deepcompile:
        engine.compile()
    ids, labels = make_batch(rank, device)
    grads = skipped_grads = None
    try:
        for step in range(steps):
            EAGER_FRAMES.clear()
            if probe:
                probe.at("forward", step)
                save()
            loss = engine(ids, labels)
            if probe:
                probe.after_forward(step)
                probe.at("backward", step)
            engine.backward(loss)
            rec["eager_frames"].append(list(EAGER_FRAMES))
            rec["gathered_after_backward"].append(gathered_params(engine.module))
            if step == 0:
                grads = full_grads(engine.module, compared_params(variant))
                skipped_grads = reduced_grads(engine.module, SKIPPED_FRAME_PARAMS)
                rec["skipped_param_grads"] = {
                    name: (None if p.grad is None else list(p.grad.shape))
                    for name, p in engine.module.named_parameters() if name in SKIPPED_FRAME_PARAMS
                }
            if probe:
                probe.at("step", step)
            engine.step()
            rec["losses"].append(loss.item())
            rec["gathered_after_step"].append(gathered_params(engine.module))
        if probe:
            probe.at("done", steps)
    except BaseException:
        rec["eager_frames_at_failure"] = list(EAGER_FRAMES)
        if deepcompile:
            rec["getter_compiled"] = getter_compiled_entries(engine.module.embed)
        save()
        raise
    rec["losses_finite"] = finite(rec["losses"])
    if deepcompile:
        rec["deepcompile_active"] = bool(engine.is_deepcompile_active())
        rec["compile_entries"] = [list(e[:2]) for e in engine.get_compile_time()]
        rec["getter_compiled"] = getter_compiled_entries(engine.module.embed)
        from torch._dynamo.utils import counters
        rec["graph_break_reasons"] = sorted(str(k)[:160] for k in counters["graph_break"])
    engine.destroy()
    return grads, skipped_grads


def _compare(got, ref):
    if not isinstance(got, torch.Tensor) or not isinstance(ref, torch.Tensor):
        return {"rel_err": None, "got": str(got)[:200], "ref": str(ref)[:200]}
    if got.shape != ref.shape:
        return {"rel_err": None, "got_shape": list(got.shape), "ref_shape": list(ref.shape)}
    diff = got - ref
    return {
        "rel_err": (diff.norm() / ref.norm()).item(),
        "max_abs_diff": diff.abs().max().item(),
        "ref_max_abs": ref.abs().max().item(),
        "ref_norm": ref.norm().item(),
        "got_norm": got.norm().item(),
    }


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--variant", required=True, choices=VARIANTS)
    parser.add_argument("--steps", type=int, default=STEPS)
    args = parser.parse_args()

    device = setup_device()
    describe(report)
    rank = report["rank"]
    report.update(variant=args.variant,
                  steps=args.steps,
                  vocab=VOCAB,
                  hidden=HIDDEN,
                  compared=compared_params(args.variant),
                  weight_shapes={
                      "embed": [VOCAB, HIDDEN],
                      "mix": [HIDDEN, HIDDEN]
                  })

    report["reached"] = "eager"
    report["eager"] = {}
    report.write()
    eager_grads, eager_skipped = run(args.variant, False, 1, device, rank, report["eager"], report.write)
    report.write()
    gc.collect()
    torch.cuda.empty_cache()

    report["reached"] = "deepcompile"
    report["deepcompile"] = {}
    report.write()
    dc_grads, dc_skipped = run(args.variant, True, args.steps, device, rank, report["deepcompile"], report.write)
    report["grad_compare"] = {name: _compare(dc_grads[name], ref) for name, ref in eager_grads.items()}
    # Report-only: what DeepCompile reduced for the parameters used in the skipped frames (their eager
    # autograd nodes are outside every compiled graph) against eager ZeRO-3.
    report["skipped_grad_compare"] = {name: _compare(dc_skipped[name], ref) for name, ref in eager_skipped.items()}
    report["reached"] = "done"


if __name__ == "__main__":
    run_worker("8059", main)
