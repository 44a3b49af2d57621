"""DeepCompile ZeRO-3 at 2 ranks: evaluation that calls the model itself, as the Hugging Face Trainer does, compiles
one graph on every rank (patch deepcompile-z3-ranks-agree-on-calls-of-the-module; #7611).

At 4 ranks (4xH100, fork.23 and fork.24) the zoo's Trainer stopped in its second evaluation with
ProfileGraphMismatch: prediction_step calls the model, not the engine, so its inputs reached Dynamo without the marks
DeepSpeedEngine.forward gave its own calls, and Dynamo's automatic dynamic shapes traced rank 0, whose evaluation
length was the one its frame was compiled for, static ([2, 80]) and the other ranks symbolic. Here each rank trains
one step through the engine (lengths 40 and 45) and then calls engine.module under no_grad (40 and 50, then 44 and
37): rank 0's first evaluation length is its training length. Both ranks must compile the same graphs, finish
before the deadline, and give eager ZeRO-3's evaluation losses (workers/dc_z3_ranks_recompile.py,
--case calls-of-the-module).
"""

import os

import pytest

from dist import DistJob, skip_reason

from zoo_models import ZOO

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_z3_ranks_recompile.py")
DEADLINE_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "300"))
RTOL = ZOO["llama"].loss_tol  # bf16, DeepCompile against eager: the zoo's Llama tolerance


@pytest.fixture(scope="module")
def runs():
    reason = skip_reason(2)
    if reason:
        pytest.skip(reason)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    args = ["--case", "calls-of-the-module", "--deadline", str(DEADLINE_S)]
    jobs = {mode: DistJob(WORKER, ["--mode", mode] + args, nprocs=2, timeout=DEADLINE_S + 60, env=env).start()
            for mode in ("eager", "deepcompile")}
    done = {}
    for mode, job in jobs.items():
        done[mode] = job.wait()
        done[mode].save(f"dc_z3_calls_of_the_module_{mode}")
    return done


def _ranks(res):
    assert res.ok, res.failure_message()
    return [res.results[r]["run"] for r in (0, 1)]


def test_ranks_compile_the_same_graphs_for_calls_of_the_module(runs):
    dc = _ranks(runs["deepcompile"])
    assert dc[0]["graphs"] == dc[1]["graphs"], dc


def test_evaluation_losses_are_eager_zero3s(runs):
    dc, eager = _ranks(runs["deepcompile"]), _ranks(runs["eager"])
    for rank in (0, 1):
        assert len(dc[rank]["eval_losses"]) == 2, dc[rank]
        for got, want in zip(dc[rank]["eval_losses"], eager[rank]["eval_losses"]):
            assert abs(got - want) <= RTOL * abs(want), (rank, dc[rank], eager[rank])
