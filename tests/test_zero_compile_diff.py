"""Plain `engine.compile()` (torch.compile, no DeepCompile) trains as in 0.19.8, bit for bit, under eager ZeRO-1 and
ZeRO-3: the fork's patches to deepspeed/runtime/engine.py's compile() and forward path say they do nothing without
DeepCompile (X-Reach `engine-compile (inert)`, `every-engine (inert)`); this guards that.

Reached as users reach it (tests/cpu_workers/zero_compile_diff.py): Hugging Face's Trainer with `torch_compile=True`
and a DeepSpeed config dict (accelerate calls engine.compile(backend=...)), the zoo's Llama with random weights from
seed 0, bf16, gradient accumulation 2, clipping 1.0, 3 optimizer steps over batches padded to their longest row (a
new sequence length after the first micro-batch, so Dynamo recompiles), an evaluation after step 2 (the Trainer
calls the compiled module itself there). Each version's losses of every micro-batch, gradient norms, evaluation
losses and final parameters must be the other's, to the bit; each must have compiled (the engine says so, Dynamo
compiled frames) and met at least two sequence lengths.

Backend "aot_eager" (Dynamo's graphs through AOT autograd, run by eager kernels), not Inductor: on this 2-core host
Inductor's C++ build of one ZeRO-1 cell took 180 s for one version, against 41 s with aot_eager, and the test runs
two versions and a control. The engine code under test (compile(), the forward path and its hooks, the Dynamo
graphs and graph breaks ZeRO's hooks cause) is the same with either backend; only the kernels that run the graphs
differ. ZERO_COMPILE_DIFF_BACKEND=inductor runs the same test with Inductor.

One gloo rank on DeepSpeed's CPU accelerator: two ranks would run four compiling processes on two cores. 0.19.8 is
the test environment's one build of the pinned sdist (conftest's pinned_upstream_site); each version's worker runs
in tools/zero-diff's environment of its site.
"""

import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tests", "gpu"))
from dist import DistJob  # noqa: E402
from zero_diff_tool import first_difference, site_env  # noqa: E402

WORKER = os.path.join(REPO, "tests", "cpu_workers", "zero_compile_diff.py")
UPSTREAM, FORK = "0.19.8", "fork"
STAGES = (1, 3)
CONTROL_STAGE = 1
BACKEND = os.environ.get("ZERO_COMPILE_DIFF_BACKEND", "aot_eager")
TIMEOUT = 420 if BACKEND == "inductor" else 240
# The patches whose claim this guards: they change engine.py's compile() or forward path and say so.
INERT = ("deepcompile-passes-launch-on-calls-of-the-module.patch",
         "deepcompile-z3-ranks-agree-on-calls-of-the-module.patch", "deepcompile-z3-reduce-skipped-frame-grads.patch",
         "deepcompile-z3-skipped-frame-param-lifetimes.patch", "deepcompile-z3-ranks-compile-one-graph.patch",
         "deepcompile-z3-ranks-recompile-together.patch")


@pytest.fixture(scope="module")
def runs(pinned_upstream_site):
    """Both versions side by side, ZeRO-1 and ZeRO-3; the fork runs the control too, a third cell after its two, in
    their process (its ZeRO-1 cell with the learning rate raised by 2**-10; a process of its own spent about 10 s of
    CPU starting): {label: rank 0's report}, the control's as the fork's with that cell alone."""
    stages = ["--stages", *map(str, STAGES), "--backend", BACKEND]
    # (site, arguments, seconds): the fork's process trains a third cell
    specs = {UPSTREAM: (pinned_upstream_site, stages, TIMEOUT),
             FORK: (".", [*stages, "--control", str(CONTROL_STAGE)], TIMEOUT * 3 // 2)}
    jobs = {label: DistJob(WORKER, [*args, "--deadline", str(timeout - 30)], nprocs=1, timeout=timeout,
                           env=site_env(site)).start() for label, (site, args, timeout) in specs.items()}
    reports, seconds = {}, {}
    for label, job in jobs.items():
        res = job.wait()
        assert res.ok and sorted(res.results) == [0], f"{label}: {res.failure_message(40)}"
        reports[label], seconds[label] = res.results[0], round(res.duration_s, 1)
    control = reports[FORK]["cells"].pop("control", {"error": "the fork's process ran no control"})
    reports["control"] = dict(reports[FORK], cells={f"z{CONTROL_STAGE}": control})
    print(f"engine.compile() differential ({BACKEND}), 1 rank: {seconds} s")
    assert reports[UPSTREAM]["deepspeed_version"] == "0.19.8", reports[UPSTREAM]["deepspeed_version"]
    assert "+fork." in reports[FORK]["deepspeed_version"]
    assert set(INERT) <= set(reports[FORK]["fork_patches"]) and not reports[UPSTREAM]["fork_patches"]
    return reports


def cell(reports, label, stage):
    rec = reports[label]["cells"][f"z{stage}"]
    assert "error" not in rec, f"{label} ZeRO-{stage} raised: {rec['error']}\n{rec.get('traceback', '')}"
    assert rec["engine_compiled"] and rec["compiled_frames"] > 0, f"{label} ZeRO-{stage} did not compile: {rec}"
    assert len(set(rec["lengths"])) >= 2, f"{label} ZeRO-{stage} met one sequence length only: {rec['lengths']}"
    assert rec["global_steps"] == 3 and len(rec["steps"]) == 3 and len(rec["losses"]) == 6, rec
    assert rec["eval_losses"], f"{label} ZeRO-{stage}: no evaluation ran"
    return rec


@pytest.mark.parametrize("stage", STAGES, ids=[f"zero{s}" for s in STAGES])
def test_engine_compile_trains_as_in_0_19_8(runs, stage):
    upstream, fork = cell(runs, UPSTREAM, stage), cell(runs, FORK, stage)
    assert upstream["lengths"] == fork["lengths"]
    where = first_difference(upstream, fork)
    assert where is None, f"ZeRO-{stage} under engine.compile() ({BACKEND}): the fork differs from 0.19.8: {where}"
    # The same graphs: a patch that broke a graph differently would show here before any number moved.
    assert upstream["compiled_frames"] == fork["compiled_frames"], (upstream["compiled_frames"],
                                                                    fork["compiled_frames"])


def test_the_comparison_sees_a_learning_rate_0_1_percent_higher(runs):
    upstream, perturbed = cell(runs, UPSTREAM, CONTROL_STAGE), cell(runs, "control", CONTROL_STAGE)
    where = first_difference(upstream, perturbed)
    assert where is not None, "the perturbed run came out equal"
    # The first micro-batches come before any update: they must still agree, or the runs were not alike to begin with.
    assert upstream["losses"][:2] == perturbed["losses"][:2], where
