"""Worker of tests/test_checkpoints_cross_versions.py: checkpoints of eager ZeRO (and DeepCompile, on GPUs) written by
one deepspeed build and resumed by another.

Runs with whichever deepspeed is importable (the fork installed here, or upstream 0.19.8 put first on PYTHONPATH),
one process per rank (tests/gpu/dist.py); DeepSpeed's CPU accelerator with gloo where no GPU is visible
(DS_ACCELERATOR=cpu), else CUDA with NCCL. The model, the configuration of a cell and the batches are those of the
differential suite's worker (tests/gpu/workers/zero_diff.py): batch (step, micro, rank) is the same in every run.

  --phase save --folder DIR: per cell, train SAVE_STEPS optimizer steps, read every parameter's Adam moments and fp32
      master weights through deepspeed.utils (safe_get_full_optimizer_state, safe_get_full_fp32_param), save a
      checkpoint into DIR/<cell> (engine.save_checkpoint, default tag, `latest` written), then train RESUME_STEPS more
      steps as if nothing had happened (the run that never stopped) and read the state again.
  --phase resume --checkpoint LABEL=DIR ...: per cell and checkpoint, build a fresh engine, engine.load_checkpoint
      (DIR/<cell>, no tag: through `latest`), read the state at once, then train RESUME_STEPS steps (batches of steps
      SAVE_STEPS on) and read it again. --perturb CELL:LABEL also resumes CELL from LABEL's checkpoint with the
      learning rate raised by 2**-10 of itself after the load (the control: that continuation must differ).

Recorded as zero_diff.py records a cell (losses of every micro-batch as float.hex, per step the gradient norm, loss
scale and skipped steps, a sha256 prefix of every final parameter's bytes, ZeRO-3 gathered), so that tools/zero-diff's
comparison applies; a state read is, per parameter and key, the sha256 prefix and the float64 norm of the full
tensor, or the exception the read raised. A cell that raises records its exception and the next one runs.
"""

import argparse
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from founding_common import run_worker, stacks_at_deadline, cancel_deadline  # noqa: E402
import zero_diff  # noqa: E402
import zero_diff_cells  # noqa: E402

SAVE_STEPS = 2
RESUME_STEPS = 2
STATE_KEYS = ("exp_avg", "exp_avg_sq", "fp32")
PRECISIONS = ("bf16", "fp32")


def cells():
    """{name: cell}: eager ZeRO-1, -2 and -3 in bf16 and fp32 (the differential suite's stage cells: HF's documented
    options, overlap_comm on, gradient accumulation 2, clipping 1.0), and DeepCompile ZeRO-1 and -3 in bf16 (CUDA
    only)."""
    table = {}
    for precision in PRECISIONS:
        for name, cell in zero_diff_cells.stage_cells(precision).items():
            if cell["stage"] in (1, 2, 3):
                table[name] = dict(cell, deepcompile=False)
    for name, cell in zero_diff_cells.stage_cells("bf16").items():
        if cell["stage"] in (1, 3):
            table["dc-" + name] = dict(cell, deepcompile=True)
    return table


def build(cell, world_size, lr):
    import deepspeed
    torch.manual_seed(1234)
    model = zero_diff.Net(False, world_size)
    optimizer = torch.optim.Adam([{"params": list(model.parameters()), "name": "all"}], lr=lr)
    cfg = zero_diff.config(cell)
    if cell["deepcompile"]:
        cfg["compile"] = {"deepcompile": True}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    if cell["deepcompile"]:
        engine.compile()
    return engine


def train(engine, cell, first_step, steps, rank, device):
    """Train `steps` optimizer steps from global step `first_step`: (losses, per-step records)."""
    losses, records = [], []
    for step in range(first_step, first_step + steps):
        for micro in range(cell["grad_accum"]):
            g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
            ids = torch.randint(0, zero_diff.VOCAB, (zero_diff.MICRO_BATCH, zero_diff.SEQ), generator=g).to(device)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(zero_diff.hexf(loss.item()))
        scale = getattr(engine.optimizer, "loss_scale", None)
        records.append({
            "grad_norm": zero_diff.hexf(engine.get_global_grad_norm()),
            "loss_scale": zero_diff.hexf(scale) if isinstance(scale, (int, float)) or torch.is_tensor(scale) else None,
            "skipped": int(engine.skipped_steps),
        })
    return losses, records


def summary(t):
    t = t.detach()
    return {"digest": zero_diff.digest(t), "norm": zero_diff.hexf(t.double().norm()), "numel": t.numel()}


def probe(p, key):
    """Read this rank's fragment of parameter `p`'s state `key` the way the full read does before its all-reduce
    (ZeRO-1/2: the parameter's fragment mapping; ZeRO-3 has no such step): None, or the exception it raises."""
    mapping = getattr(p, "_hp_mapping", None)
    if mapping is None:
        return None
    try:
        mapping.get_hp_fragment(None if key == "fp32" else key)
    except Exception as exc:
        return exc
    return None


def read_state(engine, device):
    """{parameter name: {key: summary or {"error": ...}}} of every parameter's full Adam moments and fp32 master
    weights, as a user reads them through deepspeed.utils (safe_get_full_optimizer_state, safe_get_full_fp32_param).

    The full read of ZeRO-1/2 reads this rank's fragment, then all-reduces the full tensor over the data-parallel
    group. Where the fragment read raises on some ranks and not on others (0.19.8 after load_checkpoint: the ranks
    holding a fragment of the parameter raise, the others wait in the all-reduce), the ranks would pair the wrong
    collectives from there on (gloo: "Received data size doesn't match expected size", SIGABRT). So every rank first
    probes its fragment and the ranks agree on whether all can read: a rank whose probe raised calls the full read
    (which raises before its collective) and records that exception; a rank whose probe passed while another's
    raised records that it did not read."""
    import deepspeed.comm as dist
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    out = {}
    for name, p in engine.module.named_parameters():
        out[name] = {}
        for key in STATE_KEYS:
            failed = probe(p, key)
            flag = torch.tensor([0.0 if failed else 1.0], device=device)
            if dist.get_world_size() > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MIN)
            if flag.item() == 0.0 and failed is None:
                out[name][key] = {"error": "not read: a full read on another rank raised before its all-reduce"}
                continue
            try:
                t = safe_get_full_fp32_param(p) if key == "fp32" else safe_get_full_optimizer_state(p, key)
                out[name][key] = {"error": "returned None"} if t is None else summary(t)
            except Exception as exc:
                out[name][key] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    return out


def final_params(engine, cell):
    import deepspeed
    params = dict(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters(list(params.values()), enabled=cell["stage"] == 3):
        return {name: zero_diff.digest(p) for name, p in params.items()}


def save(cell, folder, rank, world_size, device):
    engine = build(cell, world_size, zero_diff.LR)
    losses, steps = train(engine, cell, 0, SAVE_STEPS, rank, device)
    rec = {"losses": losses, "steps": steps, "before_save": read_state(engine, device)}
    engine.save_checkpoint(folder)
    rec["saved_global_steps"] = engine.global_steps
    losses, steps = train(engine, cell, SAVE_STEPS, RESUME_STEPS, rank, device)
    rec["unstopped"] = {"losses": losses, "steps": steps, "params": final_params(engine, cell),
                        "after_steps": read_state(engine, device)}
    engine.destroy()
    return rec


def resume(cell, folder, rank, world_size, device, perturb):
    engine = build(cell, world_size, zero_diff.LR)
    path, _ = engine.load_checkpoint(folder)
    if path is None:
        raise RuntimeError(f"load_checkpoint found no checkpoint in {folder}")
    if perturb:  # after the load, which restores the saved learning rate with the optimizer's state
        for group in engine.optimizer.param_groups:
            group["lr"] *= 1 + 2**-10
    rec = {"loaded": os.path.basename(os.path.normpath(path)), "global_steps": engine.global_steps,
           "after_load": read_state(engine, device)}
    losses, steps = train(engine, cell, SAVE_STEPS, RESUME_STEPS, rank, device)
    rec.update(losses=losses, steps=steps, params=final_params(engine, cell), after_steps=read_state(engine, device))
    engine.destroy()
    return rec


def guarded(fn, *args):
    start = time.time()
    try:
        rec = fn(*args)
    except Exception as exc:
        rec = {"error": f"{type(exc).__name__}: {exc}"[:400], "traceback": traceback.format_exc()[-3000:]}
    rec["seconds"] = round(time.time() - start, 2)
    return rec


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("save", "resume"), required=True)
    parser.add_argument("--cells", nargs="+", required=True)
    parser.add_argument("--folder", help="save: the folder the checkpoints go to, one per cell")
    parser.add_argument("--checkpoint", action="append", default=[], metavar="LABEL=DIR",
                        help="resume: a folder of checkpoints (one per cell) and its label")
    parser.add_argument("--perturb", action="append", default=[], metavar="CELL:LABEL")
    parser.add_argument("--deadline", type=float, default=300)
    args = parser.parse_args()
    stacks_at_deadline(args.deadline)
    rank, world_size = report["rank"], report["world_size"]
    device = zero_diff.start_run(report)
    report["device"] = device.type
    table = cells()
    sources = [c.split("=", 1) for c in args.checkpoint]
    perturbed = {tuple(p.split(":", 1)) for p in args.perturb}
    for name in args.cells:
        cell = table[name]
        report["cells"][name] = {"reached": "start"}
        report.write()
        if args.phase == "save":
            rec = guarded(save, cell, os.path.join(args.folder, name), rank, world_size, device)
        else:
            rec = {}
            for label, folder in sources:
                rec[label] = guarded(resume, cell, os.path.join(folder, name), rank, world_size, device, False)
                if (name, label) in perturbed:
                    rec["perturbed:" + label] = guarded(resume, cell, os.path.join(folder, name), rank, world_size,
                                                        device, True)
        report["cells"][name] = rec
        report.write()
    cancel_deadline()


if __name__ == "__main__":
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    run_worker("zero_ckpt_cross", main, hard_exit=True)
