"""DeepSpeed's checkpoint writer ("checkpoint": {"writer": {...}}) must load what it saved, under every ZeRO stage
and under the launchers users start training with.

Found on CPU in 0.19.8 (tests/cpu_workers/checkpoint_writer_round_trip.py, one gloo process, torch 2.11), one patch a
row of CASES:
- without DeepSpeed's own launcher (torchrun, accelerate launch) initialize failed with KeyError: 'CROSS_SIZE';
- under ZeRO-0/1/2 initialize failed with AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank';
- under ZeRO-3 the checkpoint saved, and load_checkpoint failed with UnpicklingError: the writer's engines loaded
  with torch.load's default weights_only=True since torch 2.6 (upstream #8500).
The worker trains a step, saves, trains another, loads: every parameter must be the saved one, and the step
trained again from there must give what it gave the first time (Adam's moments restored too).
Started by neither launcher, initialize must say which variables it needs. And, with any checkpoint engine, the Adam
moments read through safe_get_full_optimizer_state right after the load must be the saved ones (ZeRO-1/2 failed).
The decoupled writer (a background process that writes) must do the same: under ZeRO-1/2 its save failed, and
load_checkpoint right after a save found no checkpoint. At two gloo ranks too, each rank with a writer process of its
own, into one folder. And a run that saves and ends must leave a checkpoint a later run resumes without a tag (the
decoupled writer left it without `latest`).
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "checkpoint_writer_round_trip.py")

# (stage, launcher): the patch whose defect the case shows
CASES = {
    (3, "deepspeed"): "checkpoint-writer-loads-what-it-saved",
    (1, "deepspeed"): "checkpoint-writer-pure-data-parallel-rank",
    (2, "deepspeed"): "checkpoint-writer-pure-data-parallel-rank",
    (3, "torchrun"): "checkpoint-writer-without-the-deepspeed-launcher",
}


@pytest.mark.parametrize("stage,launcher", sorted(CASES), ids=[f"zero{s}-{l}" for s, l in sorted(CASES)])
def test_the_checkpoint_writer_loads_what_it_saved(stage, launcher, tmp_path):
    report, _ = cpu_worker.run(WORKER, ["--stage", str(stage), "--launcher", launcher], "ROUND_TRIP_REPORT ", tmp_path,
                               timeout=300)
    assert report["error"] is None, f"{CASES[stage, launcher]}: stopped after {report['reached']}:\n{report['error']}"
    assert report["moved_after_save"] and report["restored"] and report["resumed"], report


def test_without_a_launchers_variables_the_error_says_which_to_set(tmp_path):
    report, _ = cpu_worker.run(WORKER, ["--stage", "1", "--launcher", "none"], "ROUND_TRIP_REPORT ", tmp_path,
                               timeout=300)
    assert report["reached"] == "start", report
    assert "deepspeed launcher (CROSS_SIZE, CROSS_RANK) or torchrun (LOCAL_WORLD_SIZE, GROUP_RANK)" in report["error"]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_optimizer_state_reads_back_after_load(stage, tmp_path):
    # patch zero12-optimizer-state-fragments-after-load: under ZeRO-1/2 safe_get_full_optimizer_state failed after
    # load_checkpoint, with the default checkpoint engine too ("argument of type 'NoneType' is not iterable")
    report, _ = cpu_worker.run(WORKER, ["--stage", str(stage), "--launcher", "deepspeed", "--writer", "none"],
                               "ROUND_TRIP_REPORT ", tmp_path, timeout=300)
    assert report["error"] is None, report["error"]
    assert report["restored"] and report["resumed"] and report["moments_after_load"] == "saved", report


@pytest.mark.parametrize("stage", [1, 2])
def test_the_decoupled_writer_loads_what_it_saved(stage, tmp_path):
    # patch checkpoint-writer-decoupled-sends-detached-tensors: under ZeRO-1/2 save_checkpoint failed with "Cowardly
    # refusing to serialize non-leaf tensor which requires_grad" (the fp32 partitions without their padding are
    # views of tensors that require grad, and a queue to another process takes no autograd)
    report, _ = cpu_worker.run(WORKER, ["--stage", str(stage), "--launcher", "deepspeed", "--writer", "decoupled"],
                               "ROUND_TRIP_REPORT ", tmp_path, timeout=300)
    assert report["error"] is None, f"stopped after {report['reached']}:\n{report['error']}"
    assert report["moved_after_save"] and report["restored"] and report["resumed"], report
    assert report["moments_after_load"] == "saved", report


def test_a_program_with_the_decoupled_writer_ends_without_destroy(tmp_path):
    # patch checkpoint-writer-decoupled-process-exits-with-the-program: the worker never calls engine.destroy(), as a
    # training script or the Trainer does not; multiprocessing joined the writer's process at exit, and that process
    # waited for requests for ever (cpu_worker.run fails a worker that does not end). ZeRO-3, whose save needed no
    # other patch: its round trip is checked too.
    report, _ = cpu_worker.run(WORKER, ["--stage", "3", "--launcher", "deepspeed", "--writer", "decoupled"],
                               "ROUND_TRIP_REPORT ", tmp_path, timeout=240)
    assert report["error"] is None and report["restored"] and report["resumed"], report


@pytest.mark.parametrize("writer", ["decoupled", "python"])
def test_a_checkpoint_loads_right_after_its_save(writer, tmp_path):
    # patch checkpoint-writer-decoupled-commits-before-load: the decoupled writer commits a checkpoint (and writes
    # `latest`) at the next optimizer step, so load_checkpoint right after save_checkpoint found no checkpoint and
    # loaded nothing (the Trainer's load_best_model_at_end, when the best is the last); the python writer is the control
    report, _ = cpu_worker.run(WORKER, ["--stage", "3", "--launcher", "deepspeed", "--writer", writer, "--load-at-once"],
                               "ROUND_TRIP_REPORT ", tmp_path, timeout=300)
    assert report["error"] is None, f"stopped after {report['reached']}:\n{report['error']}"
    assert report["load_path"] and report["restored"], report


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_the_decoupled_writer_round_trips_at_two_ranks(stage, tmp_path):
    # Each rank hands its partition to a writer process of its own, all into one folder, and loads it back. Before
    # fork.30, under ZeRO-1/2 every rank's save failed (checkpoint-writer-decoupled-sends-detached-tensors), and under
    # ZeRO-3 the job never ended after both ranks' reports (checkpoint-writer-decoupled-process-exits-with-the-program).
    folder = tmp_path / "ckpt"
    ranks = cpu_worker.run_ranks(WORKER, ["--stage", str(stage), "--launcher", "deepspeed", "--writer", "decoupled",
                                          "--folder", str(folder)])
    for rank, report in ranks.items():
        assert report["moved_after_save"] and report["restored"] and report["resumed"], (rank, report)
        assert report["moments_after_load"] == "saved", (rank, report)
    partitions = sorted(p.name for p in (folder / "t").glob("*optim_states.pt"))
    assert len(partitions) == 2 and "rank_0" in partitions[0] and "rank_1" in partitions[1], partitions


@pytest.mark.parametrize("writer,stage", [("decoupled", 1), ("decoupled", 3), ("python", 3)])
def test_the_last_checkpoint_of_a_run_resumes(writer, stage, tmp_path):
    # patch checkpoint-writer-decoupled-last-checkpoint-has-latest: a run that saves and ends (the Trainer's last
    # checkpoint) left its checkpoint without `latest`, written only at a next step that never came; resuming from it
    # without a tag (the Trainer's resume_from_checkpoint) then loaded nothing. The python writer is the control.
    args = ["--stage", str(stage), "--launcher", "deepspeed", "--writer", writer, "--folder", str(tmp_path / "ckpt")]
    saved, _ = cpu_worker.run(WORKER, args + ["--end-after-save"], "ROUND_TRIP_REPORT ", tmp_path, timeout=240)
    assert saved["error"] is None, f"stopped after {saved['reached']}:\n{saved['error']}"
    resumed, _ = cpu_worker.run(WORKER, args + ["--resume"], "ROUND_TRIP_REPORT ", tmp_path, timeout=240)
    assert resumed["error"] is None, f"stopped after {resumed['reached']}:\n{resumed['error']}"
    assert resumed["load_path"] and resumed["restored"], resumed
