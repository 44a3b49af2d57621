"""Worker for test_deepcompile_frozen_params.py (run it with torchrun on 2 GPUs).

DeepCompile with ZeRO stage 1 or 2 on a model whose compiled graph reads parameters that ZeRO does
not own. Trains the same bf16 model twice on identical data, eagerly (the reference) and with
DeepCompile, and records the losses, whether each parameter changed, and what the DeepCompile backend
was given.

variant "frozen": a frozen embedding and a frozen Linear (requires_grad=False; the Linear's weight
  is needed in the backward for its input gradient) in front of trainable layers. Upstream 0.19.8
  stops at the first compile: "AssertionError: All param inputs should have param_id" (only the
  parameters of the optimizer groups get a param_id).
variant "no_grad_param": a trainable parameter that the graph reads only under torch.no_grad(), so
  the backward graph has no gradient for it. Upstream 0.19.8 fails compiling the backward
  ("'NoneType' object has no attribute 'name'").

The model is a user-defined module without graph breaks, so that the frozen parameters reach a
graph DeepCompile compiles (Dynamo runs a module built only of torch.nn containers eagerly). The
worker checks that Dynamo compiled a graph.
Each rank writes a JSON report to $DIST_RESULT_DIR/rank<RANK>.json, rewritten as it goes.
"""

import argparse
import gc
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from founding_common import describe, run_worker, setup_device  # noqa: E402
import ds_configs  # noqa: E402

VOCAB = 1024
HIDDEN = 512
SEQ = 32
MICRO_BATCH = 4
STEPS = 5
LR = 1e-3


class Net(nn.Module):

    def __init__(self, variant):
        super().__init__()
        self.variant = variant
        self.emb = nn.Embedding(VOCAB, HIDDEN)
        self.proj = nn.Linear(HIDDEN, HIDDEN)
        self.layers = nn.ModuleList([nn.Linear(HIDDEN, HIDDEN) for _ in range(2)])
        self.head = nn.Linear(HIDDEN, VOCAB)
        if variant == "frozen":
            self.emb.weight.requires_grad_(False)
            self.proj.weight.requires_grad_(False)
            self.proj.bias.requires_grad_(False)
        else:
            self.gate = nn.Parameter(torch.zeros(HIDDEN))

    def forward(self, ids, labels):
        h = self.proj(self.emb(ids))
        for layer in self.layers:
            h = h + torch.relu(layer(h))
        if self.variant == "no_grad_param":
            with torch.no_grad():
                g = 2 * torch.sigmoid(self.gate)
            h = h * g
        logits = self.head(h)
        return F.cross_entropy(logits.float().view(-1, VOCAB), labels.view(-1))


def make_batch(rank, step, device):
    gen = torch.Generator().manual_seed(4000 + 100 * rank + step)
    ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=gen)
    return ids.to(device), labels.to(device)


def ds_config(stage, deepcompile):
    return ds_configs.zero(stage, MICRO_BATCH, 1, LR, deepcompile=deepcompile)


def probe_backend_inputs(rec):
    """Record which parameters DeepCompile's ZeRO-1/2 backend is handed (and which carry a param_id)."""
    import deepspeed.compile.init_z1_and_2 as init_z12

    original_make_backend = init_z12.make_backend

    def make_backend(*args, **kwargs):
        backend_fn = original_make_backend(*args, **kwargs)

        def probed(gm, real_inputs):
            params = [v for v in real_inputs if isinstance(v, torch.nn.Parameter)]
            rec["backend_calls"].append({
                "params": len(params),
                "with_param_id": sum(1 for p in params if hasattr(p, "param_id")),
                "frozen": sum(1 for p in params if not p.requires_grad),
            })
            return backend_fn(gm, real_inputs)

        return probed

    init_z12.make_backend = make_backend
    return lambda: setattr(init_z12, "make_backend", original_make_backend)


def run(stage, variant, deepcompile, rank, device, rec, report):
    import deepspeed
    import torch._dynamo.utils as dynamo_utils

    torch.manual_seed(0)
    model = Net(variant)
    engine, _, _, _ = deepspeed.initialize(model=model,
                                           model_parameters=model.parameters(),
                                           config=ds_config(stage, deepcompile))
    restore = None
    if deepcompile:
        dynamo_utils.counters.clear()
        restore = probe_backend_inputs(rec)
        try:
            engine.compile()
        finally:
            restore()
        rec["deepcompile_active"] = bool(engine.is_deepcompile_active())

    names = [name for name, _ in engine.module.named_parameters()]
    initial = {name: p.detach().float().clone() for name, p in engine.module.named_parameters()}
    for step in range(STEPS):
        rec["reached"] = f"step {step}"
        report.write()
        ids, labels = make_batch(rank, step, device)
        loss = engine(ids, labels)
        engine.backward(loss)
        engine.step()
        rec["losses"].append(loss.item())
    torch.cuda.synchronize()
    for name, p in engine.module.named_parameters():
        rec["param_changed"][name] = bool(not torch.equal(p.detach().float(), initial[name]))
        rec["requires_grad"][name] = bool(p.requires_grad)
    rec["param_names"] = names
    if deepcompile:
        stats = dynamo_utils.counters.get("stats", {})
        rec["dynamo_unique_graphs"] = int(stats.get("unique_graphs", 0))
    rec["reached"] = "done"
    report.write()
    engine.destroy()


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--stage", type=int, required=True, choices=[1, 2])
    parser.add_argument("--variant", required=True, choices=["frozen", "no_grad_param"])
    args = parser.parse_args()
    device = setup_device()
    describe(report)
    report.update(stage=args.stage, variant=args.variant)
    # One DeepCompile engine per process: DeepCompile keeps process-global hooks.
    for name, deepcompile in (("eager", False), ("deepcompile", True)):
        rec = report[name] = dict(reached=None, losses=[], param_changed={}, requires_grad={}, backend_calls=[])
        start = time.time()
        run(args.stage, args.variant, deepcompile, report["rank"], device, rec, report)
        rec["seconds"] = round(time.time() - start, 1)
        report.write()
        gc.collect()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    run_worker("z12-frozen-params", main)
