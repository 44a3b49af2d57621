"""Worker for tests/test_deepcompile_z3_step_gathers_no_persistent_params.py: what ZeRO-3's optimizer step gathers
under DeepCompile, and what it leaves gathered. 2 gloo ranks on CPU (DS_ACCELERATOR=cpu), started by tests/gpu/dist.py.

The model's small parameters (a LayerNorm's weight and bias, the Linear biases: 64 elements each) are under
stage3_param_persistence_threshold, its Linear weights (4096) over it. The model runs in a frame Dynamo skips, so
DeepCompile's eager fallback gathers what it uses, and DeepCompile's CUDA op is a no-op stand-in
(dc_z3_skipped_frames_sim.use_fake_deepcompile_op): ZeRO-3's partitioning, collectives and optimizer are real. The
same steps run on eager ZeRO-3 and on DeepCompile ZeRO-3. Recorded per training step: the all-gathers engine.step()
issued (every gather method of DeepSpeed's communication backend is counted), the parameters left gathered after it,
and the loss.
"""

import os
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import run_worker  # noqa: E402

HIDDEN = 64
STEPS = 3


class Net(nn.Module):

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(HIDDEN)
        self.fc1 = nn.Linear(HIDDEN, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, HIDDEN)

    @torch.compiler.disable
    def body(self, h):
        return self.fc2(torch.relu(self.fc1(self.norm(h))))

    def forward(self, x, y):
        return F.mse_loss(self.body(x * 1.5), y)


def count_gathers(counter):
    """Count every call of a gather method of DeepSpeed's communication backend (all_gather, all_gather_into_tensor,
    all_gather_coalesced, ...), whichever path of deepspeed.comm reaches it."""
    from deepspeed.comm import comm
    backend = comm.cdb
    inside = []  # a gather method calling another counts once

    for name in dir(backend):
        method = getattr(backend, name)
        if "gather" in name and not name.startswith("has_") and callable(method):

            def counted(*args, _method=method, _name=name, **kwargs):
                if not inside:
                    counter[_name] = counter.get(_name, 0) + 1
                inside.append(_name)
                try:
                    return _method(*args, **kwargs)
                finally:
                    inside.pop()

            setattr(backend, name, counted)


def run(deepcompile, rank, rec, counter):
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-2,
                "torch_adam": True
            }
        },
        "zero_allow_untested_optimizer": True,
        "zero_optimization": {
            "stage": 3,
            "stage3_param_persistence_threshold": 1000
        },
        "steps_per_print": 1_000_000,
    }
    if deepcompile:
        config["compile"] = {"deepcompile": True}
    engine, _, _, _ = deepspeed.initialize(model=Net(), config=config)
    rec["persistent"] = [n for n, p in engine.module.named_parameters() if getattr(p, "ds_persist", False)]
    if deepcompile:
        engine.compile(backend="eager")
        rec["deepcompile_active"] = engine.is_deepcompile_active()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * rank + step)
        x, y = torch.randn(2, 8, HIDDEN, generator=gen), torch.randn(2, 8, HIDDEN, generator=gen)
        loss = engine(x, y)
        engine.backward(loss)
        counter.clear()
        engine.step()
        rec["step_gathers"].append(dict(counter))
        rec["gathered_after_step"].append(
            [n for n, p in engine.module.named_parameters() if p.ds_status != ZeroParamStatus.NOT_AVAILABLE])
        rec["losses"].append(loss.item())


def main(report):
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    from dc_z3_skipped_frames_sim import use_fake_deepcompile_op
    use_fake_deepcompile_op()
    counter = {}
    count_gathers(counter)
    for name, deepcompile in (("eager", False), ("deepcompile", True)):
        rec = report[name] = {"step_gathers": [], "gathered_after_step": [], "losses": []}
        run(deepcompile, report["rank"], rec, counter)


if __name__ == "__main__":
    run_worker("dc_z3_step_gathers", main, hard_exit=True)  # gloo on CPU: see founding_common.run_worker
