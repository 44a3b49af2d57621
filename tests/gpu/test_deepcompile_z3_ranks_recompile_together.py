"""DeepCompile ZeRO-3 at 2 ranks: when both ranks' lengths were one at first and differ later, the ranks recompile
together and train on (patches deepcompile-z3-ranks-recompile-together and
deepcompile-z3-inductor-alignment-guards-every-rank-shares; #7611).

Each rank's first micro-batch has length 40 (a multiple of 8), so each compiles a static graph; at the second step
rank 0's length stays 40 and rank 1's becomes 45. Before fork.22 rank 0 kept its static graph while rank 1 recompiled
alone, and ZeRO-3's compile, which profiles with collectives every rank must join, waited for the other rank
(compile-waits-for-every-rank raises after compile_sync_timeout, 10 minutes by default). The Dynamo graphs each rank has
compiled must be the same count after every step, the run must finish before its deadline (each rank's stacks are
kept when it passes), and the losses and gradient norms must be eager ZeRO-3's (workers/dc_z3_ranks_recompile.py).

Calls of the model itself (patch deepcompile-z3-ranks-agree-on-calls-of-the-module): at 4 ranks (4xH100, fork.23 and
fork.24) the zoo's Trainer stopped in its second evaluation with ProfileGraphMismatch. prediction_step calls the
model, not the engine, so its inputs reached Dynamo without the marks DeepSpeedEngine.forward gave its own calls, and
Dynamo's automatic dynamic shapes traced rank 0, whose evaluation length was the one its frame was compiled for,
static ([2, 80]) and the other ranks symbolic. Here each rank trains one step through the engine (lengths 40 and 45),
then calls engine.module under no_grad (40 and 50, then 44 and 37): both ranks must compile the same graphs, finish
before the deadline and give eager ZeRO-3's evaluation losses (--case calls-of-the-module).

Matmul padding (patch deepcompile-z3-ranks-agree-on-matmul-padding): on 4xH200 (fork.33) two-rank jobs of
test_z3_release_memcheck.py stopped in their first compile with ProfileGraphMismatch, rank 0's graph padding a matmul of
odd size and rank 1's not: Inductor pads where a benchmark timed on the rank's own GPU finds it faster, and the ranks
timed it apart. Here the zoo's Llama with GPT-2's vocabulary (50257 rows) trains at one length on both ranks while each
rank's benchmark answers for it, padding on rank 0 and not on rank 1 (--case padding-benchmarks-disagree): both ranks
must compile the same graphs without asking it, and give eager ZeRO-3's losses.
"""

import os

import pytest

from dist import DistJob, skip_reason

from zoo_models import ZOO

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_z3_ranks_recompile.py")
DEADLINE_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "300"))
# bf16, DeepCompile against eager: the zoo's Llama tolerance (zoo_models.py).
RTOL = ZOO["llama"].loss_tol


def _run_both_modes(case):
    reason = skip_reason(2)
    if reason:
        pytest.skip(reason)
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    args = ["--case", case, "--deadline", str(DEADLINE_S)]
    jobs = {mode: DistJob(WORKER, ["--mode", mode] + args, nprocs=2, timeout=DEADLINE_S + 60, env=env).start()
            for mode in ("eager", "deepcompile")}
    done = {}
    for mode, job in jobs.items():
        done[mode] = job.wait()
        done[mode].save(f"dc_z3_{case.replace('-', '_')}_{mode}")
    return done


@pytest.fixture(scope="module")
def runs():
    return _run_both_modes("recompile-together")


@pytest.fixture(scope="module")
def direct_calls():
    return _run_both_modes("calls-of-the-module")


@pytest.fixture(scope="module")
def padding_runs():
    return _run_both_modes("padding-benchmarks-disagree")


def _ranks(res):
    assert res.ok, res.failure_message()
    return [res.results[r]["run"] for r in (0, 1)]


def test_ranks_compile_the_same_graphs_at_every_step(runs):
    dc = _ranks(runs["deepcompile"])
    assert dc[0]["graphs"] == dc[1]["graphs"], dc


def test_losses_and_gradient_norms_are_eager_zero3s(runs):
    dc, eager = _ranks(runs["deepcompile"]), _ranks(runs["eager"])
    for rank in (0, 1):
        assert dc[rank]["lengths"] == eager[rank]["lengths"]
        for got, want in zip(dc[rank]["losses"], eager[rank]["losses"]):
            assert abs(got - want) <= RTOL * abs(want), (rank, dc[rank]["losses"], eager[rank]["losses"])
        for got, want in zip(dc[rank]["grad_norms"], eager[rank]["grad_norms"]):
            assert abs(got - want) <= max(1e-2, 5 * RTOL) * abs(want), (rank, dc[rank]["grad_norms"], eager[rank])
    assert dc[0]["grad_norms"] == dc[1]["grad_norms"], dc  # one global norm, the same on both ranks


def test_ranks_compile_the_same_graphs_for_calls_of_the_model_itself(direct_calls):
    dc = _ranks(direct_calls["deepcompile"])
    assert dc[0]["graphs"] == dc[1]["graphs"], dc


def test_calls_of_the_model_itself_give_eager_zero3s_evaluation_losses(direct_calls):
    dc, eager = _ranks(direct_calls["deepcompile"]), _ranks(direct_calls["eager"])
    for rank in (0, 1):
        assert len(dc[rank]["eval_losses"]) == 2, dc[rank]
        for got, want in zip(dc[rank]["eval_losses"], eager[rank]["eval_losses"]):
            assert abs(got - want) <= RTOL * abs(want), (rank, dc[rank], eager[rank])


def test_ranks_whose_padding_benchmarks_disagree_compile_the_same_graphs(padding_runs):
    res = padding_runs["deepcompile"]
    dc = _ranks(res)  # before the patch: ProfileGraphMismatch in the first compile, on both ranks
    assert dc[0]["graphs"] == dc[1]["graphs"], dc
    assert [res.results[r]["padding_asked"] for r in (0, 1)] == [[], []], res.results


def test_ranks_whose_padding_benchmarks_disagree_give_eager_zero3s_losses(padding_runs):
    dc, eager = _ranks(padding_runs["deepcompile"]), _ranks(padding_runs["eager"])
    for rank in (0, 1):
        assert len(dc[rank]["losses"]) == 3, dc[rank]
        for got, want in zip(dc[rank]["losses"], eager[rank]["losses"]):
            assert abs(got - want) <= RTOL * abs(want), (rank, dc[rank]["losses"], eager[rank]["losses"])
