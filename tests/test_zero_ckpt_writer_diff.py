"""The checkpoint writer, differentially: a run of eager ZeRO-1, -2 or -3 that saves through a checkpoint writer
("checkpoint": {"writer": {...}}), loads what it saved and trains on must be, bit for bit, the same run saving
through the default engine (torch.save, no writer); and the fork must run each configuration as 0.19.8 does, where
0.19.8 runs it.

Per cell (tests/cpu_workers/zero_ckpt_writer_diff.py: the differential suite's model, batches and bf16 stage cells,
HF's documented ZeRO options, gradient accumulation 2, clipping 1.0), writer and launcher, each version trains 2
steps, saves, trains 1 more step, loads through `latest`, reads the fp32 master weights and trains 2 more steps.
Writers: "python" (the fast checkpoint engine with the python writer, as tests/test_checkpoint_writer_round_trip.py
configures it), "decoupled" (the same writer in a background process), and "fast" (the FAST writer, which needs
DeepSpeed's async_io op and pinned CUDA memory: neither build can start it on DeepSpeed's CPU accelerator, which is
asserted, not skipped, so that the day it runs it joins the comparison). Launchers: the environment of DeepSpeed's
launcher (CROSS_SIZE, CROSS_RANK) and of torchrun (neither).

0.19.8 fails several of these configurations: those are the defects the fork's checkpoint-writer patches fix, and
EXPECTED_UPSTREAM_DEVIATIONS asserts each failure (its exception and the phase it stopped in), so the day 0.19.8 runs
one the table must change. Everything else must equal the fork to the bit, and the fork's default engine must equal
0.19.8's. The control: the fork's python-writer run of CONTROL, its learning rate raised by 2**-10 after the load,
must differ from the default engine's.

One gloo rank on DeepSpeed's CPU accelerator (tests/test_checkpoint_writer_round_trip.py runs the decoupled writer at
two); 0.19.8 is the test environment's one build of the pinned sdist (conftest's pinned_upstream_site); each version's
worker runs in tools/zero-diff's environment of its site.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
from dist import DistJob  # noqa: E402
from zero_diff_tool import first_difference, site_env  # noqa: E402

WORKER = os.path.join(REPO, "tests", "cpu_workers", "zero_ckpt_writer_diff.py")
UPSTREAM, FORK = "0.19.8", "fork"
SUFFIX = "-bf16-oc1-cg1-rs1-mr1-ga2-clip-all-off-none-dense"
CELLS = {stage: f"z{stage}{SUFFIX}" for stage in (1, 2, 3)}
WRITERS = ("python", "decoupled", "fast")
LAUNCHERS = ("deepspeed", "torchrun")
CONTROL = (CELLS[2], "python", "deepspeed")
TIMEOUT = 280

# (stage, writer, launcher) -> (the phase 0.19.8 stopped in, the start of its error; the patch that fixes it)
DP_RANK = ("initialize", "AttributeError: 'UniversalParallelInfo' object has no attribute 'dp_rank'",
           "checkpoint-writer-pure-data-parallel-rank")
CROSS_SIZE = ("initialize", "KeyError: 'CROSS_SIZE'", "checkpoint-writer-without-the-deepspeed-launcher")
UNPICKLING = ("load", "UnpicklingError: Weights only load failed", "checkpoint-writer-loads-what-it-saved")
EXPECTED_UPSTREAM_DEVIATIONS = {
    **{(stage, writer, "deepspeed"): DP_RANK for stage in (1, 2) for writer in ("python", "decoupled", "fast")},
    **{(3, writer, "deepspeed"): UNPICKLING for writer in ("python", "decoupled")},
    **{(stage, writer, "torchrun"): CROSS_SIZE for stage in (1, 2, 3) for writer in WRITERS},
}
# The FAST writer pins its buffers in CUDA memory: on the CPU accelerator it cannot start, in either build.
NO_CUDA = ("initialize", "RuntimeError: Found no NVIDIA driver")


def key(stage, writer, launcher):
    return f"{CELLS[stage]}:{writer}:{launcher}"


@pytest.fixture(scope="module")
def runs(pinned_upstream_site, tmp_path_factory):
    """Both versions' workers side by side, every cell, writer (and no writer) and launcher: {version: rank 0's
    report}."""
    folder = tmp_path_factory.mktemp("ckpt-writer-diff")
    args = ["--cells", *CELLS.values(), "--writers", "none", *WRITERS, "--launchers", *LAUNCHERS,
            "--deadline", str(TIMEOUT - 30)]
    jobs = {}
    for version, site in ((UPSTREAM, pinned_upstream_site), (FORK, ".")):
        extra = ["--perturb", ":".join(CONTROL)] if version == FORK else []
        jobs[version] = DistJob(WORKER, [*args, *extra, "--folder", str(folder / version)], nprocs=1,
                                timeout=TIMEOUT, env=site_env(site)).start()
    reports, seconds = {}, {}
    for version, job in jobs.items():
        res = job.wait()
        assert res.ok and sorted(res.results) == [0], f"{version}: {res.failure_message(40)}"
        assert res.results[0].get("error") is None, f"{version}: {res.failure_message(40)}"
        reports[version], seconds[version] = res.results[0], round(res.duration_s, 1)
    print(f"checkpoint-writer differential, 1 rank: {seconds} s")
    assert reports[UPSTREAM]["deepspeed_version"] == "0.19.8", reports[UPSTREAM]["deepspeed_version"]
    assert "+fork." in reports[FORK]["deepspeed_version"]
    return reports


def done(reports, version, name):
    rec = reports[version]["cells"][name]
    assert "error" not in rec and rec["reached"] == "done", (
        f"{version} {name} stopped in {rec['reached']}: {rec.get('error')}\n{rec.get('traceback', '')}")
    assert rec["loaded"] == "global_step2" and rec["global_steps"] == 4, rec
    assert rec["moved_after_save"] and rec["restored"], f"{version} {name}: the load did not restore the save"
    return rec


def same_run(a, b):
    """Where two records of a round first disagree (the saving run's steps, the weights read right after the load,
    the continuation), or None."""
    where = first_difference({**a["before_save"], "params": {}}, {**b["before_save"], "params": {}})
    if where:
        return f"before the save: {where}"
    if a["after_load"] != b["after_load"]:
        return "fp32 master weights right after the load: " + ", ".join(
            n for n in a["after_load"] if a["after_load"][n] != b["after_load"].get(n))
    where = first_difference(a, b)
    if not where and a["final_fp32"] != b["final_fp32"]:  # bf16 parameters can round away what the masters show
        where = "final fp32 master weights: " + ", ".join(
            n for n in a["final_fp32"] if a["final_fp32"][n] != b["final_fp32"].get(n))
    return f"after the load: {where}" if where else None


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("writer", ("python", "decoupled"))
@pytest.mark.parametrize("stage", sorted(CELLS))
def test_the_fork_resumes_through_a_writer_as_through_the_default_engine(runs, stage, writer, launcher):
    default = done(runs, FORK, key(stage, "none", launcher))
    through_writer = done(runs, FORK, key(stage, writer, launcher))
    where = same_run(default, through_writer)
    assert where is None, f"ZeRO-{stage}, {writer} writer, {launcher}'s environment: differs from torch.save: {where}"


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("stage", sorted(CELLS))
def test_the_default_engine_resumes_in_the_fork_as_in_0_19_8(runs, stage, launcher):
    fork = done(runs, FORK, key(stage, "none", launcher))
    upstream = done(runs, UPSTREAM, key(stage, "none", launcher))
    where = same_run(upstream, fork)
    assert where is None, f"ZeRO-{stage} without a writer ({launcher}'s environment): the fork differs: {where}"


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("writer", WRITERS)
@pytest.mark.parametrize("stage", sorted(CELLS))
def test_0_19_8_runs_a_writer_as_the_fork_or_fails_as_expected(runs, stage, writer, launcher, record_property):
    """Where EXPECTED_UPSTREAM_DEVIATIONS names a configuration, 0.19.8 must stop in that phase with that error
    (and the fork, unless the configuration cannot run on CPU at all, completes it); everywhere else 0.19.8's run
    through the writer equals the fork's to the bit."""
    name = key(stage, writer, launcher)
    rec = runs[UPSTREAM]["cells"][name]
    expected = EXPECTED_UPSTREAM_DEVIATIONS.get((stage, writer, launcher))
    if expected is None and writer == "fast":
        expected = NO_CUDA + ("none: the FAST writer needs CUDA",)
    if expected is not None:
        phase, error, patch = expected
        assert "error" in rec, (f"0.19.8 ran {name} to the end where it was expected to stop in {phase} with "
                                f"{error!r} ({patch} fixes that in the fork): update EXPECTED_UPSTREAM_DEVIATIONS")
        assert rec["reached"] == phase and rec["error"].startswith(error), (
            f"0.19.8 {name}: expected to stop in {phase} with {error!r}; stopped in {rec['reached']} with "
            f"{rec['error']}")
        record_property("upstream_deviation", f"{phase}: {rec['error'][:160]}")
        return
    fork = done(runs, FORK, name)
    where = same_run(done(runs, UPSTREAM, name), fork)
    assert where is None, f"{name}: the fork differs from 0.19.8: {where}"


@pytest.mark.parametrize("launcher", LAUNCHERS)
@pytest.mark.parametrize("stage", sorted(CELLS))
def test_the_fast_writer_cannot_start_on_the_cpu_accelerator(runs, stage, launcher):
    """Not a defect of either build: the FAST writer pins its I/O buffers in CUDA memory. Asserted so that the day it
    starts here, its run joins the comparison with the default engine instead of being left out unnoticed."""
    rec = runs[FORK]["cells"][key(stage, "fast", launcher)]
    if "error" not in rec:
        where = same_run(done(runs, FORK, key(stage, "none", launcher)), done(runs, FORK, key(stage, "fast", launcher)))
        assert where is None, f"the fast writer differs from torch.save: {where}"
        pytest.fail("the FAST writer now starts on the CPU accelerator and equals torch.save: drop NO_CUDA")
    assert rec["reached"] == NO_CUDA[0] and rec["error"].startswith(NO_CUDA[1]), rec


def test_the_comparison_sees_a_learning_rate_0_1_percent_higher(runs):
    cell, writer, launcher = CONTROL
    default = done(runs, FORK, f"{cell}:none:{launcher}")
    perturbed = done(runs, FORK, f"perturbed:{cell}:{writer}:{launcher}")
    assert same_run(default, perturbed) is not None, "the perturbed continuation came out equal"
    assert same_run(default, perturbed).startswith("after the load"), same_run(default, perturbed)
