"""Worker for tests/test_checkpoint_writer_round_trip.py: save_checkpoint and load_checkpoint through DeepSpeed's
checkpoint writer ("checkpoint": {"writer": {"type": "python"}}; --writer decoupled: the same writer in a background
process; --writer none: the default engine), one process on CPU (gloo, DS_ACCELERATOR=cpu).

  python tests/cpu_workers/checkpoint_writer_round_trip.py --stage 3 --launcher torchrun

--launcher says whose environment the process sees: DeepSpeed's launcher sets CROSS_SIZE and CROSS_RANK (machines,
and this one's index), torchrun sets GROUP_RANK and LOCAL_WORLD_SIZE instead; "none" sets neither. The worker trains a step, saves, trains
one more step, loads, trains that step again, and reports (one line, ROUND_TRIP_REPORT) how far it got, the error if
any, whether the loaded parameters are the saved ones, and whether the repeated step gives the parameters the first
one gave (Adam's update reads its moments: so they were restored too). It also reads the Adam moments right after
the load through safe_get_full_optimizer_state, and reports whether they are the saved ones, or its error.
--load-at-once: no step between save and load (as the Trainer loads its best checkpoint at the end, which may be the
one just saved): load_checkpoint without a tag must find the checkpoint through the `latest` file, and the parameters
it loads must be the saved ones.
At several ranks (started by tests/gpu/dist.py, --folder naming the one checkpoint folder of all ranks) each rank
also writes its report to dist.result_path().
--end-after-save: train a step, save without a tag (as the Trainer saves its last checkpoint) and end, without
engine.destroy(), keeping the saved parameters beside the checkpoint; --resume, started afterwards on the same
--folder: load without a tag (through `latest`, as the Trainer resumes) and report whether the parameters are those.
"""

import argparse
import json
import os
import sys
import tempfile
import traceback

import torch

TESTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(TESTS, "gpu", "workers"), os.path.join(TESTS, "gpu")]
from founding_common import ensure_dist_env, init_distributed  # noqa: E402
from dist import RESULT_DIR_ENV, result_path  # noqa: E402

PREFIX = "ROUND_TRIP_REPORT "
LAUNCHER_ENV = {"deepspeed": {"CROSS_SIZE": "1", "CROSS_RANK": "0"}, "torchrun": {"GROUP_RANK": "0"}, "none": {}}


def snapshot(engine):
    """Every fp32 parameter, full (ZeRO-3: gathered), as copies."""
    from deepspeed.utils import safe_get_full_fp32_param
    return {name: safe_get_full_fp32_param(p).clone() for name, p in engine.module.named_parameters()}


def moments(engine):
    """Every parameter's Adam moments, full, as copies; or the error reading them raised."""
    from deepspeed.utils import safe_get_full_optimizer_state
    try:
        return {(name, key): safe_get_full_optimizer_state(p, key).clone()
                for name, p in engine.module.named_parameters() for key in ("exp_avg", "exp_avg_sq")}
    except Exception as e:
        return f"{type(e).__name__}: {e}"


def same(a, b):
    return all(torch.equal(a[name], b[name]) for name in a)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--stage", type=int, required=True, choices=[0, 1, 2, 3])
    ap.add_argument("--launcher", required=True, choices=sorted(LAUNCHER_ENV))
    ap.add_argument("--writer", default="python", choices=["python", "decoupled", "none"])
    ap.add_argument("--load-at-once", action="store_true")
    ap.add_argument("--folder", help="the checkpoint folder, the same for every rank (default: a new temporary one)")
    ap.add_argument("--end-after-save", action="store_true")
    ap.add_argument("--resume", action="store_true")
    args = ap.parse_args()
    os.environ.update(LAUNCHER_ENV[args.launcher])
    ensure_dist_env()  # started alone: rank 0 of 1; under torchrun its variables stay
    os.environ.setdefault("LOCAL_WORLD_SIZE", "1")
    report = {"reached": "start", "error": None}
    try:
        import deepspeed
        init_distributed("gloo")
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
        config = {
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "torch_adam": True}},
            "zero_allow_untested_optimizer": True,
            "zero_optimization": {"stage": args.stage},
            "steps_per_print": 10**9,
        }
        if args.writer != "none":
            config["checkpoint"] = {"writer": {"type": "python", "decoupled": args.writer == "decoupled"}}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
        report["reached"] = "initialize"

        def step(seed):
            x = torch.randn(2, 16, generator=torch.Generator().manual_seed(seed))
            loss = engine(x).pow(2).mean()
            engine.backward(loss)
            engine.step()

        folder = args.folder or tempfile.mkdtemp()
        expected = os.path.join(folder, "saved-parameters.pt")
        if args.resume:
            report["load_path"], _ = engine.load_checkpoint(folder)
            report["reached"] = "load"
            report["restored"] = same(torch.load(expected), snapshot(engine))
        else:
            step(1)
            saved, saved_moments = snapshot(engine), moments(engine)
            if args.end_after_save:
                engine.save_checkpoint(folder)
                torch.save(saved, expected)
                report["reached"] = "save"
            elif args.load_at_once:
                # Nothing changes between the two: the decoupled writer captures the state when it commits (at the
                # next step, which comes after the commit), so a change made before that would be in the checkpoint.
                engine.save_checkpoint(folder)
                report["reached"] = "save"
                report["load_path"], _ = engine.load_checkpoint(folder)
                report["reached"] = "load"
                report["restored"] = same(saved, snapshot(engine))
            else:
                engine.save_checkpoint(folder, tag="t")
                report["reached"] = "save"
                step(2)
                moved = snapshot(engine)
                engine.load_checkpoint(folder, tag="t")
                report["reached"] = "load"
                report["moved_after_save"] = not same(saved, moved)
                report["restored"] = same(saved, snapshot(engine))
                loaded_moments = moments(engine)
                report["moments_after_load"] = (loaded_moments if isinstance(loaded_moments, str) else
                                                "saved" if same(saved_moments, loaded_moments) else "differ")
                step(2)
                report["resumed"] = same(moved, snapshot(engine))
    except Exception:
        report["error"] = traceback.format_exc()
    print(PREFIX + json.dumps(report), flush=True)
    if RESULT_DIR_ENV in os.environ:
        with open(result_path(), "w") as f:
            json.dump(report, f)


if __name__ == "__main__":
    main()
