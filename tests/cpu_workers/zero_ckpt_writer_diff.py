"""Worker of tests/test_zero_ckpt_writer_diff.py: a save -> load -> train round of eager ZeRO with a checkpoint writer
configured ("checkpoint": {"writer": {...}}), to be compared bit for bit with the same round through the default
checkpoint engine (torch.save, no writer), and across deepspeed builds.

Runs with whichever deepspeed is importable (the fork installed here, or upstream 0.19.8 first on PYTHONPATH), one
process per rank (tests/gpu/dist.py), DeepSpeed's CPU accelerator with gloo (DS_ACCELERATOR=cpu). The model, a
cell's configuration and the batches are those of the differential suite (tests/gpu/workers/zero_diff.py, cells of
tests/gpu/workers/zero_ckpt_cross.py: HF's documented ZeRO options, gradient accumulation 2, clipping 1.0).

Per cell, writer and launcher: set the launcher's variables (tests/cpu_workers/checkpoint_writer_round_trip.py's
LAUNCHER_ENV: DeepSpeed's launcher sets CROSS_SIZE and CROSS_RANK, torchrun neither), build the engine with the
writer, train SAVE_STEPS steps, engine.save_checkpoint(DIR) (default tag, `latest` written), train one more step
(the parameters move away from the saved ones), engine.load_checkpoint(DIR) through `latest`, read every fp32 master
weight (safe_get_full_fp32_param) at once, then train RESUME_STEPS steps with the batches of steps SAVE_STEPS on.
Writers: "none" (no writer: the default engine), "python" (the fast checkpoint engine with the python writer),
"fast" (the fast checkpoint engine with the FAST writer, DeepSpeed's async_io op), "decoupled" (the python writer in
a background process).

Recorded as zero_diff.py records a cell (losses of every micro-batch as float.hex, per step the gradient norm, loss
scale and skipped steps, sha256 prefixes of the final parameters, ZeRO-3 gathered, and of the final fp32 master
weights) for the steps after the load,
the saving run's records before it, the path loaded and the digests read right after the load; or the exception
and the stage it was raised at ("initialize", "train", "save", "load", ...).

  python tests/cpu_workers/zero_ckpt_writer_diff.py --folder DIR --cells NAME ... --writers none python decoupled \
      --launchers deepspeed [--perturb CELL:WRITER:LAUNCHER] [--deadline S]
"""

import argparse
import os
import sys
import time
import traceback

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.dirname(os.path.abspath(__file__)), os.path.join(TESTS, "gpu", "workers"),
                os.path.join(TESTS, "gpu")]
from founding_common import run_worker, stacks_at_deadline, cancel_deadline  # noqa: E402
from checkpoint_writer_round_trip import LAUNCHER_ENV  # noqa: E402
import zero_ckpt_cross  # noqa: E402  (its cells, training loop and final parameters)
import zero_diff  # noqa: E402

SAVE_STEPS = 2
RESUME_STEPS = 2
WRITERS = {
    "none": None,
    "python": {"type": "python", "decoupled": False},
    "fast": {"type": "fast", "decoupled": False},
    "decoupled": {"type": "python", "decoupled": True},
}


def key(cell, writer, launcher):
    return f"{cell}:{writer}:{launcher}"


def build(cell, world_size, writer, lr):
    import deepspeed
    torch.manual_seed(1234)
    model = zero_diff.Net(False, world_size)
    optimizer = torch.optim.Adam([{"params": list(model.parameters()), "name": "all"}], lr=lr)
    cfg = zero_diff.config(cell)
    if WRITERS[writer] is not None:
        cfg["checkpoint"] = {"writer": dict(WRITERS[writer])}
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=cfg)
    return engine


def fp32_digests(engine):
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: zero_diff.digest(safe_get_full_fp32_param(p)) for name, p in engine.module.named_parameters()}


def round_trip(cell, writer, launcher, folder, rank, world_size, device, perturb, rec):
    saved_env = {name: os.environ.get(name) for name in ("CROSS_SIZE", "CROSS_RANK", "GROUP_RANK")}
    for name in saved_env:
        os.environ.pop(name, None)
    if launcher == "deepspeed":
        os.environ.update(LAUNCHER_ENV["deepspeed"])
    elif world_size == 1:  # torchrun sets GROUP_RANK itself at several ranks; one rank runs without it
        os.environ.update(LAUNCHER_ENV["torchrun"])
    engine = None
    try:
        rec["reached"] = "initialize"
        engine = build(cell, world_size, writer, zero_diff.LR)
        rec["reached"] = "train"
        losses, steps = zero_ckpt_cross.train(engine, cell, 0, SAVE_STEPS, rank, device)
        rec["before_save"] = {"losses": losses, "steps": steps}
        saved = fp32_digests(engine)
        rec["reached"] = "save"
        engine.save_checkpoint(folder)
        rec["reached"] = "train after save"
        zero_ckpt_cross.train(engine, cell, SAVE_STEPS, 1, rank, device)
        rec["moved_after_save"] = fp32_digests(engine) != saved
        rec["reached"] = "load"
        path, _ = engine.load_checkpoint(folder)
        if path is None:
            raise RuntimeError(f"load_checkpoint found no checkpoint in {folder}")
        rec["loaded"] = os.path.relpath(path, folder).split(os.sep)[0]  # the tag's folder
        rec["after_load"] = fp32_digests(engine)
        rec["restored"] = rec["after_load"] == saved
        if perturb:  # after the load, which restores the saved learning rate with the optimizer's state
            for group in engine.optimizer.param_groups:
                group["lr"] *= 1 + 2**-10
        rec["reached"] = "resume"
        losses, steps = zero_ckpt_cross.train(engine, cell, SAVE_STEPS, RESUME_STEPS, rank, device)
        rec.update(losses=losses, steps=steps, params=zero_ckpt_cross.final_params(engine, cell),
                   final_fp32=fp32_digests(engine),
                   global_steps=int(engine.global_steps), reached="done")
    finally:
        if engine is not None:
            engine.destroy()
        for name, value in saved_env.items():
            os.environ.pop(name, None)
            if value is not None:
                os.environ[name] = value


def main(report):
    parser = argparse.ArgumentParser()
    parser.add_argument("--folder", required=True)
    parser.add_argument("--cells", nargs="+", required=True)
    parser.add_argument("--writers", nargs="+", required=True, choices=sorted(WRITERS))
    parser.add_argument("--launchers", nargs="+", default=["deepspeed"], choices=["deepspeed", "torchrun"])
    parser.add_argument("--perturb", action="append", default=[], metavar="CELL:WRITER:LAUNCHER")
    parser.add_argument("--deadline", type=float, default=300)
    args = parser.parse_args()
    stacks_at_deadline(args.deadline)
    rank, world_size = report["rank"], report["world_size"]
    device = zero_diff.start_run(report)
    table = zero_ckpt_cross.cells()
    # A perturbed round runs right after the rounds of its cell and launcher: a ZeRO-3 engine leaves torch's linear
    # patched for the rest of the process (both versions), so that rounds after it are not those before it.
    perturbed = {tuple(p.split(":")) for p in args.perturb}
    runs = [(c, w, l, perturb) for c in args.cells for l in args.launchers
            for w in args.writers for perturb in (False, True) if not perturb or (c, w, l) in perturbed]
    for cell, writer, launcher, perturb in runs:
        name = ("perturbed:" if perturb else "") + key(cell, writer, launcher)
        rec = report["cells"][name] = {"reached": "start"}
        report.write()
        start = time.time()
        try:
            round_trip(table[cell], writer, launcher, os.path.join(args.folder, name.replace(":", "-")), rank,
                       world_size, device, perturb, rec)
        except Exception as exc:
            rec["error"] = f"{type(exc).__name__}: {exc}"[:400]
            rec["traceback"] = traceback.format_exc()[-3000:]
        rec["seconds"] = round(time.time() - start, 2)
        report.write()
    cancel_deadline()


if __name__ == "__main__":
    run_worker("zero_ckpt_writer_diff", main, hard_exit=True)
