"""Worker for tests/test_deepcompile_passes_launch_on_calls_of_the_module.py: a DeepCompile engine whose model is
called itself, under no_grad, before the engine's first forward (the Hugging Face Trainer's evaluation before
training: prediction_step calls the model, not the engine). One process on CPU (gloo, DS_ACCELERATOR=cpu).

  python tests/cpu_workers/dc_passes_on_calls_of_the_module.py --stage 3

DeepCompile's native op needs CUDA: it is replaced by a no-op, and DeepCompile's backend by a stand-in that records
the passes the real backend would run (deepspeed.compile.backend.next_passes; the real one iterates them, and None
fails with "'NoneType' object is not iterable") and then runs the graph as traced. Everything else is real:
deepspeed.initialize, engine.compile() with DeepCompile's init for the stage and its default schedule. Under ZeRO-3
the stand-in inserts no gathers, so the evaluation runs inside GatheredParameters and no training step follows.
Reports (one line, PASSES_REPORT): the passes each compile saw, in order.
"""

import argparse
import json
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import ensure_dist_env, init_distributed  # noqa: E402
from dc_stand_in import NoOpHandle, stand_in_deepcompile  # noqa: E402

PREFIX = "PASSES_REPORT "


class Net(torch.nn.Module):  # defined here, not in torch: Dynamo skips torch's own modules' frames

    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 1)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[1, 2, 3])
    stage = ap.parse_args().stage
    ensure_dist_env()  # one process: rank 0 of 1
    import deepspeed
    from deepspeed.compile import backend

    init_distributed("gloo")
    seen = []

    def compile_graph(gm, example_inputs):
        passes = backend.next_passes
        seen.append(None if passes is None else [p.__name__ for p in passes])
        return gm.forward

    stand_in_deepcompile(NoOpHandle(), compile_graph)
    torch.manual_seed(0)
    model = Net()
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": stage},
        "compile": {"deepcompile": True},
    }
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    engine.compile()
    x = torch.randn(2, 16)
    with torch.no_grad(), deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        engine.module(x)
    if stage != 3:
        loss = engine(x).sum()
        engine.backward(loss)
        engine.step()
    print(PREFIX + json.dumps({"stage": stage, "seen": seen}), flush=True)


if __name__ == "__main__":
    main()
