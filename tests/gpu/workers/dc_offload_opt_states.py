"""Worker for test_deepcompile_offload_opt_states.py: DeepCompile ZeRO-3 in bf16, 8 steps, with its optimizer states
offloaded (`compile.offload_opt_states`, every state forced out) or resident, recording the losses, global gradient
norms, how many graphs Inductor lowered in each optimizer step and the offload ops' counters.

  python tests/gpu/workers/dc_offload_opt_states.py --model llama --run offload

Runs:
  offload               offload_opt_states on, the default schedule: gathers and releases at step 0, the offload
                        passes from step 1 (the last cycle, lowered with Inductor from step 1)
  resident-same-cycles  offload off, a schedule of the same cycles: gathers and releases at step 0, again at step 1
  resident-default      offload off, the default schedule: its last cycle (prefetch, selective gather) at WARMUP (5)

The test sets DS_DC_OFFLOAD_OPT_BUDGET_GB for the offload run, as upstream's test does, so that every state (the fp32
partition too) leaves the GPU whatever memory the device has.
"""

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import describe, run_worker, setup_device, stacks_at_deadline, cancel_deadline  # noqa: E402
import compile_phases  # noqa: E402
import ds_configs  # noqa: E402
import zoo_models  # noqa: E402

STEPS = 8
LR = 1.5e-4  # upstream's test_offload_opt_states_correctness
MICRO_BATCH = 2
LENGTH = 33
RUNS = ("offload", "resident-same-cycles", "resident-default")


class SoftLabelMLP(torch.nn.Module):
    """Upstream's SimpleModel made two layers deep: linear layers and a cross entropy against soft (random) targets,
    whose bf16 value Inductor's fused kernel and the unfused ATen ops round differently."""

    def __init__(self, hidden=64):
        super().__init__()
        self.linears = torch.nn.ModuleList([torch.nn.Linear(hidden, hidden) for _ in range(2)])

    def forward(self, x, y):
        for layer in self.linears:
            x = layer(x)
        return torch.nn.functional.cross_entropy(x, y)


def batches(model, device):
    if model == "mlp":
        g = torch.Generator().manual_seed(123)
        xs = [torch.randn(MICRO_BATCH, 64, generator=g) for _ in range(STEPS)]
        return [dict(x=x.to(device, torch.bfloat16), y=torch.randn(x.shape, generator=g).to(device, torch.bfloat16))
                for x in xs]
    return [{k: v.to(device) for k, v in zoo_models.token_batch(model, 3000 + i, MICRO_BATCH, LENGTH).items()}
            for i in range(STEPS)]


def main(report):
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True, choices=["mlp", "llama"])
    ap.add_argument("--run", required=True, choices=RUNS)
    ap.add_argument("--deadline", type=float, default=400)
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)

    device = setup_device()
    describe(report)
    import deepspeed
    from deepspeed.compile.passes import offload_adam_states, zero3_compile

    torch.manual_seed(0)
    model = SoftLabelMLP() if args.model == "mlp" else zoo_models.build(args.model)
    config = ds_configs.zero(3, MICRO_BATCH, 1, LR, deepcompile=True, stage3_param_persistence_threshold=0)
    config["compile"]["offload_opt_states"] = args.run == "offload"
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    schedule = None
    if args.run == "resident-same-cycles":
        schedule = [(0, [zero3_compile.add_z3_gather_release]), (1, [zero3_compile.add_z3_gather_release])]
    engine.compile(schedule=schedule)
    offload_adam_states.reset_offload_op_stats()

    rec = report["run"] = dict(model=args.model, run=args.run, losses=[], grad_norms=[], inductor_graphs_by_step=[],
                               deepcompile_active=bool(engine.is_deepcompile_active()),
                               budget_gb=os.environ.get("DS_DC_OFFLOAD_OPT_BUDGET_GB"))
    lowered = compile_phases.InductorGraphs()
    for batch in batches(args.model, device):
        out = engine(**batch)
        loss = out if torch.is_tensor(out) else out.loss
        engine.backward(loss)
        engine.step()
        rec["losses"].append(loss.float().item())
        norm = engine.get_global_grad_norm()
        rec["grad_norms"].append(None if norm is None else float(norm))
        rec["inductor_graphs_by_step"].append(lowered.since_last())
        report.write()
    rec["offload_ops"] = dict(offload_adam_states.get_offload_op_stats())
    report.write()
    cancel_deadline()
    engine.destroy()


if __name__ == "__main__":
    run_worker("dc-offload-opt-states", main)
