"""The worker side of tests/gpu/against_eager.py: one process trains the zoo's Llama (fp32, AdamW) under the ZeRO stage
and the mode (eager or DeepCompile) its command line names, for a test that compares the two modes stage by stage."""

import argparse

import torch

from founding_common import cancel_deadline, describe, setup_device, stacks_at_deadline
import ds_configs
import zoo_models


def engine_for_stage_and_mode(report, micro_batch, grad_acc, **config):
    """(args, device, engine) for `--stage {1,2,3} --mode {eager,deepcompile} [--deadline S]` (every stack printed
    past the deadline): the zoo's Llama seeded alike in both modes, under ds_configs.zero with `config` added, compiled
    where the mode is DeepCompile."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    ap.add_argument("--mode", required=True, choices=["eager", "deepcompile"])
    ap.add_argument("--deadline", type=float, default=400)
    args = ap.parse_args()
    stacks_at_deadline(args.deadline)
    device = setup_device()
    describe(report)
    import deepspeed

    torch.manual_seed(0)
    model = zoo_models.build("llama")
    cfg = ds_configs.zero(args.stage, micro_batch, grad_acc, 1e-3, optimizer="AdamW", bf16=False,
                          deepcompile=args.mode == "deepcompile", **config)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if args.mode == "deepcompile":
        engine.compile()
    return args, device, engine


def finish(report, rec, engine):
    """The run reached its end: say so in the report, drop the deadline, release the engine."""
    rec["reached"] = "done"
    report.write()
    cancel_deadline()
    engine.destroy()
