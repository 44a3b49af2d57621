"""Worker of tools/zero-diff: train each cell of tests/gpu/workers/zero_diff_cells.py with the deepspeed importable
here, and record what a user would compare between two builds.

One process per rank (torchrun, or alone as rank 0 of 1); CUDA with NCCL when a GPU is visible, else DeepSpeed's
CPU accelerator with gloo (run with DS_ACCELERATOR=cpu). Every cell starts from the same weights and the same
batches (seeded by step and rank), and trains STEPS optimizer steps of GRAD_ACCUM_OF_CELL micro-batches with torch's
Adam as the client optimizer. Recorded per micro-batch: the loss (float.hex, exact); per optimizer step: the global
gradient norm, the loss scale and the count of skipped steps; at the end, a sha256 of every parameter's bytes
(ZeRO-3 parameters gathered first). The Trainer cells (zero_diff_cells.TRAINER_CELLS) train the zoo's Llama through
transformers' Trainer instead and record its logged losses, gradient norms and evaluation losses. A cell that raises
records its exception instead and the next cell runs.

A deadline prints every thread's stack and exits, so a hung collective fails the run instead of holding
it. --perturb NAME raises the learning rate of cell NAME by 2**-10 of itself (about 0.1 %): the control that shows
the comparison sees a difference as small as that.

  python tests/gpu/workers/zero_diff.py [--cells NAME ...] [--deadline S] [--perturb NAME]
"""

import argparse
import hashlib
import math
import os
import sys
import traceback

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # zoo_models
from founding_common import run_worker, stacks_at_deadline, cancel_deadline  # noqa: E402
import zero_diff_cells  # noqa: E402

VOCAB, HIDDEN, LAYERS, SEQ, MICRO_BATCH = 64, 32, 3, 8, 2
STEPS = 4
TRAINER_STEPS = 4
LR = 1e-2
# Small buckets, so that every ZeRO-1/2 backward flushes several and an oversized gradient exists (the embedding).
BUCKET = 1500


class Expert(nn.Module):

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(HIDDEN, 2 * HIDDEN)
        self.down = nn.Linear(2 * HIDDEN, HIDDEN)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class Net(nn.Module):

    def __init__(self, moe, world_size):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.blocks = nn.ModuleList(nn.Linear(HIDDEN, HIDDEN) for _ in range(LAYERS))
        self.moe = None
        if moe:
            from deepspeed.moe.layer import MoE
            # One expert-parallel group over all ranks, two experts per rank.
            self.moe = MoE(HIDDEN, Expert(), num_experts=2 * world_size, ep_size=world_size, k=1)
        self.head = nn.Linear(HIDDEN, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = h + F.gelu(block(h))
        aux = h.new_zeros(())
        if self.moe is not None:
            out, aux, _ = self.moe(h)
            h = h + out
        logits = self.head(h).float()
        return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), ids[:, 1:].reshape(-1)) + 0.01 * aux.float()


def config(cell):
    precision = cell["precision"]
    zero = {
        "stage": cell["stage"],
        "overlap_comm": cell["overlap_comm"],
        "contiguous_gradients": cell["contiguous_gradients"],
        "reduce_scatter": cell["reduce_scatter"],
        "use_multi_rank_bucket_allreduce": cell["multi_rank_bucket_allreduce"],
        "reduce_bucket_size": BUCKET,
        "allgather_bucket_size": BUCKET,
    }
    if cell["stage"] == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=BUCKET)
    if cell["offload"] == "cpu":
        zero["offload_optimizer"] = {"device": "cpu"}
    cfg = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH,
        "gradient_accumulation_steps": cell["grad_accum"],
        "gradient_clipping": cell["clip"],
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 10**9,
    }
    if precision in ("bf16", "bf16_fp32_accum"):
        cfg["bf16"] = {"enabled": True}
    if precision == "bf16_fp32_accum":
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if precision == "fp16":
        # A high initial scale, so that the first steps overflow and are skipped: the skip decisions are compared.
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 30, "loss_scale_window": 2, "hysteresis": 1}
    return cfg


def digest(t):
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()[:16]


def hexf(x):
    if x is None:
        return None
    x = float(x)
    return x.hex() if math.isfinite(x) else repr(x)


def run_trainer_cell(cell, device, perturb):
    """The Trainer as DeepSpeed's client (HF's documented ZeRO block of the cell, the rest "auto"): per logged step the
    training loss and gradient norm, the evaluation losses, and the final parameters."""
    import tempfile
    import deepspeed
    from transformers import Trainer, TrainingArguments
    import zoo_models
    from zoo_trainer import dataset, pad_to_longest

    ds = {"zero_optimization": cell["zero_optimization"], "bf16": {"enabled": "auto"},
          "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
          "steps_per_print": 10**9}
    with tempfile.TemporaryDirectory(prefix="zero_diff_trainer_") as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, per_device_eval_batch_size=2,
                                 gradient_accumulation_steps=2, max_steps=TRAINER_STEPS, eval_strategy="steps",
                                 eval_steps=2, logging_steps=1, learning_rate=1e-3 * (1 + 2**-10 if perturb else 1),
                                 bf16=True, deepspeed=ds, report_to=[], save_strategy="no", seed=0,
                                 dataloader_num_workers=0, use_cpu=device.type == "cpu")
        torch.manual_seed(0)
        model = zoo_models.build("llama")  # after TrainingArguments: ZeRO-3 builds it under zero.Init, as users get it
        trainer = Trainer(model=model, args=args, train_dataset=dataset(32, 1), eval_dataset=dataset(4, 2),
                          data_collator=pad_to_longest)
        trainer.train()
    logged = [h for h in trainer.state.log_history if "loss" in h]
    engine = trainer.model_wrapped
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=cell["stage"] == 3):
        digests = {name: digest(p) for name, p in params.items()}
    return {
        "losses": [hexf(h["loss"]) for h in logged],
        "eval_losses": [hexf(h["eval_loss"]) for h in trainer.state.log_history if "eval_loss" in h],
        "steps": [{"grad_norm": hexf(h.get("grad_norm")), "loss_scale": None, "skipped": 0} for h in logged],
        "params": digests,
    }


def run_cell(cell, device, rank, world_size, perturb):
    if cell.get("client") == "trainer":
        return run_trainer_cell(cell, device, perturb)
    import deepspeed
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer

    torch.manual_seed(1234)
    model = Net(cell["model"] == "moe", world_size)
    if cell["frozen"]:
        model.blocks[0].requires_grad_(False)
    lr = LR * (1 + 2**-10) if perturb else LR
    groups = [{"params": [p for p in model.parameters() if p.requires_grad], "name": "all"}]
    if cell["model"] == "moe":
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    optimizer = torch.optim.Adam(groups, lr=lr)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=config(cell))
    losses, steps = [], []
    for step in range(STEPS):
        for micro in range(cell["grad_accum"]):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            ids = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ), generator=g).to(device)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(hexf(loss.item()))
        optim = engine.optimizer
        scale = getattr(optim, "loss_scale", None)
        steps.append({
            "grad_norm": hexf(engine.get_global_grad_norm()),
            "loss_scale": hexf(scale) if isinstance(scale, (int, float)) or torch.is_tensor(scale) else None,
            "skipped": int(engine.skipped_steps),
        })
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=cell["stage"] == 3):
        digests = {name: digest(p) for name, p in params.items()}
    engine.destroy()
    return {"losses": losses, "steps": steps, "params": digests}


def start_run(report, **fields):
    """Join the ranks (NCCL on this rank's GPU where there is one, with TF32 off; gloo on the CPU), make torch's
    algorithms deterministic, and record in `report` which deepspeed and torch run, the fork's patches and `fields`.
    Returns the device. The differential workers (this one, zero_ckpt_cross and the CPU suite's) all start so."""
    import deepspeed
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        deepspeed.init_distributed(dist_backend="nccl")
        report["device_name"] = torch.cuda.get_device_name()
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    else:
        device = torch.device("cpu")
        deepspeed.init_distributed(dist_backend="gloo")
        report["device_name"] = "cpu"
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        from deepspeed import fork_info
        patches = [name for name, _ in fork_info.patches]
    except ImportError:  # upstream's own build
        patches = []
    report.update(deepspeed_version=deepspeed.__version__, deepspeed_file=deepspeed.__file__,
                  torch_version=torch.__version__, fork_patches=patches, cells={}, **fields)
    return device


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--cells", nargs="*", default=None)
    parser.add_argument("--deadline", type=float, default=540)
    parser.add_argument("--perturb", default=None)
    args = parser.parse_args()
    stacks_at_deadline(args.deadline)
    rank, world_size = report["rank"], report["world_size"]
    device = start_run(report)
    suite = zero_diff_cells.cells(fp16=device.type == "cuda")
    # Cells of one configuration at every stage run only when named (tests/test_zero_stages_agree.py).
    table = {name: cell for precision in zero_diff_cells.FACTORS["precision"]
             for name, cell in zero_diff_cells.stage_cells(precision).items()}
    table.update(suite)
    for name in args.cells or list(suite):
        report["cells"][name] = {"reached": "start"}
        report.write()
        try:
            rec = run_cell(table[name], device, rank, world_size, args.perturb == name)
        except Exception as exc:
            rec = {"error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()[-3000:]}
        report["cells"][name] = rec
        report.write()
    cancel_deadline()


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_worker("zero_diff", main)
