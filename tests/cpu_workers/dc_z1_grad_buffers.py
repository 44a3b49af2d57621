"""Worker for tests/test_deepcompile_z1_grad_buffers_in_one_call.py: DeepCompile ZeRO-1's gradient buffers, handed to
the native registry at each step, and the values trained with them. On CPU (gloo, DS_ACCELERATOR=cpu), one rank or
several under tests/gpu/dist.py's launcher (cpu_worker.run_ranks).

  python tests/cpu_workers/dc_z1_grad_buffers.py

DeepCompile's native op needs CUDA: it is replaced by a recorder of its calls, and DeepCompile's backend by one that
runs each graph as traced, so the gradients land in `param.grad` and DeepCompile's ZeRO-1 init reduces them into the
buffers it made for the step (the path of frames Dynamo does not compile). Everything else is real:
deepspeed.initialize, engine.compile() with DeepCompile's ZeRO-1 init, and the ZeRO-1 optimizer reading the buffers.
The same model and batches (each rank its own) also train on eager ZeRO-1. Reports (each rank, founding_common's
report): the recorder's calls by name over the steps, the slices the last step's buffer was cut into, each
parameter's size by its id, and the largest difference between the two engines' parameters.
"""

import collections
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import init_distributed, run_worker  # noqa: E402
from dc_stand_in import stand_in_deepcompile  # noqa: E402

STEPS = 3
LAYERS = 5  # 1,360 parameters: at two ranks the third weight lies across the partitions


class Net(torch.nn.Module):  # defined here, not in torch: Dynamo skips torch's own modules' frames

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(16, 16) for _ in range(LAYERS))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


class Recorder:
    """Stands in for the native op: counts its calls; keeps the last flat buffer's slices."""

    def __init__(self):
        self.calls = collections.Counter()
        self.slices = None

    def set_param_grad_buffers(self, ds_ids, flat, starts, numels, offsets):
        self.calls["set_param_grad_buffers"] += 1
        self.slices = dict(ids=list(ds_ids), starts=list(starts), numels=list(numels), offsets=list(offsets),
                           flat_numel=flat.numel(), flat_zero=bool((flat == 0).all()))

    def __getattr__(self, name):

        def call(*args, **kwargs):
            self.calls[name] += 1

        return call


def config(deepcompile):
    return {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {"stage": 1},
        "compile": {"deepcompile": deepcompile},
    }


def train(deepspeed, deepcompile):
    torch.manual_seed(0)
    model = Net()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config(deepcompile))
    if deepcompile:
        engine.compile()
    gen = torch.Generator().manual_seed(1 + int(os.environ["RANK"]))
    for _ in range(STEPS):
        x = torch.randn(4, 16, generator=gen)
        loss = engine(x).square().mean()
        engine.backward(loss)
        engine.step()
    return engine


def main(report):
    import deepspeed

    init_distributed("gloo")
    recorder = Recorder()
    stand_in_deepcompile(recorder, lambda gm, example_inputs: gm.forward)
    eager = train(deepspeed, deepcompile=False)
    compiled = train(deepspeed, deepcompile=True)
    diff = max(float((a - b).abs().max()) for a, b in zip(eager.module.parameters(), compiled.module.parameters()))
    report.update(steps=STEPS, numels={str(p.param_id): p.numel() for p in compiled.module.parameters()},
                  calls=dict(recorder.calls), slices=recorder.slices, max_param_diff=diff)


if __name__ == "__main__":
    run_worker("dc-z1-grad-buffers", main, hard_exit=True)
