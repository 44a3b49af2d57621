"""Ranks whose batches differ in sequence length compile one graph under DeepCompile ZeRO-3 (patch
deepcompile-z3-ranks-compile-one-graph; #7611).

On 4xH200 (fork.17, 2 ranks, each rank's micro-batch padded to its own length, as a collator that pads to the longest
sequence of a batch gives) every DeepCompile ZeRO-3 cell of the model zoo stopped in its first compile with
ProfileGraphMismatch: rank 0's forward graph had 340 nodes and rank 1's 352, so the profiler's per-node collectives
could not pair (on 0.19.8 and before fork.16: a hang). Under DeepCompile ZeRO-3 at several
ranks every call of the compiled model now compares the input sizes across ranks in one all-reduce and marks the
dimensions that differ dynamic, so Dynamo traces them symbolically and every rank compiles the same graph; sizes equal
on every rank stay static. Until fork.24 DeepSpeedEngine.forward did this for its own calls only; since fork.25
DeepSpeedEngine.compile wraps the model's compiled call (deepspeed.compile.util.agree_on_input_sizes), which also
covers the Trainer's evaluation, which calls the model itself. The engine's wiring is proven on GPUs by the zoo at 2
and 4 ranks (tests/gpu/test_model_zoo.py, ZOO_RANKS); here two gloo ranks call the same functions around a Dynamo
compile (tests/cpu_workers/dc_inputs_differ_across_ranks.py).
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_inputs_differ_across_ranks.py")
# Each test's run of the worker (its --lengths, +unrecorded for --unrecorded).
SCENARIOS = ("differ", "same", "extra", "many", "equal-then-differ", "equal-then-differ+unrecorded",
             "train-then-call-directly")


@pytest.fixture(scope="module")
def scenarios():
    """Every scenario, one after another in one job of two ranks (each from Dynamo's state of a new process,
    torch._dynamo.reset(), and ending with a final bucket of its own): {scenario: {rank: its report}}. A job a scenario
    spent its CPU starting two ranks and a launcher, about 8 s of the 9 s a scenario took."""
    results = cpu_worker.run_ranks(WORKER, ["--scenarios", *SCENARIOS], nprocs=2)
    return {name: {r: results[r]["scenarios"][name] for r in (0, 1)} for name in SCENARIOS}


def two_ranks(scenarios, name):
    """What cpu_worker.run_two_ranks checks of a job, of one scenario: both ranks reported it, and its final bucket met
    the other rank's (no stray collective of one rank paired with it)."""
    return cpu_worker.final_bucket_met(scenarios[name])


def test_ranks_with_different_lengths_compile_one_graph(scenarios):
    ranks = two_ranks(scenarios, "differ")
    assert [ranks[r]["marked"] for r in (0, 1)] == [2, 2], ranks  # the length of input_ids and of attention_mask
    graphs = [ranks[r]["graphs"] for r in (0, 1)]
    assert len(graphs[0]) == 1 and graphs[0] == graphs[1], graphs
    assert not any(str(n) in shape for n in (33, 34) for shape in graphs[0][0]["inputs"]), graphs


def test_ranks_with_one_length_keep_a_static_graph(scenarios):
    ranks = two_ranks(scenarios, "same")
    assert [ranks[r]["marked"] for r in (0, 1)] == [0, 0], ranks
    assert all("(2, 33)" in ranks[r]["graphs"][0]["inputs"] for r in (0, 1)), ranks


def test_ranks_with_different_inputs_mark_nothing_and_stay_paired(scenarios):
    # one collective of one size on every rank, whatever the inputs: the final bucket meets the bucket
    ranks = two_ranks(scenarios, "extra")
    assert [ranks[r]["marked"] for r in (0, 1)] == [0, 0], ranks


def test_a_rank_with_too_many_inputs_to_compare_still_joins_the_all_reduce(scenarios):
    # rank 1's 70 more tensors (146 sizes) are more than the ranks compare: it must still take part in the all-reduce
    # (skipping it alone, as the first version of the patch did, paired rank 0's all-reduce with the final bucket's)
    ranks = two_ranks(scenarios, "many")
    assert [ranks[r]["marked"] for r in (0, 1)] == [0, 0], ranks


def test_ranks_that_agreed_first_recompile_together_once_their_sizes_differ(scenarios):
    # patch deepcompile-z3-ranks-recompile-together: both ranks at length 33 compile a static graph; then only rank 1's
    # length changes (40). maybe_mark_dynamic alone leaves rank 0 on its static graph while rank 1 recompiles alone,
    # the hang #7611 describes; a dimension that agreed before is marked so that every rank's static graph fails.
    ranks = two_ranks(scenarios, "equal-then-differ")
    assert [ranks[r]["graphs_after"] for r in (0, 1)] == [[1, 2, 2], [1, 2, 2]], ranks
    assert ranks[0]["graphs"] == ranks[1]["graphs"], ranks
    assert "(2, s)" in ranks[0]["graphs"][1]["inputs"], ranks  # one symbolic graph then serves every length


def _dynamo_guards_maybe_mark_dynamic():
    import inspect
    import torch._dynamo.guards
    return "_dynamo_weak_dynamic_indices" in inspect.getsource(torch._dynamo.guards)


def test_without_the_engines_record_one_rank_recompiles_alone_where_dynamo_ignores_weak_marks(scenarios):
    # the scenario's control: without the record the engine keeps, rank 1 compiles at its second forward and rank 0
    # only at its third, each alone. torch 2.15's Dynamo guards maybe_mark_dynamic's mark as it guards mark_dynamic's,
    # so there the ranks recompile together even so; 2.8 and 2.11 need the record.
    ranks = two_ranks(scenarios, "equal-then-differ+unrecorded")
    rank0 = [1, 2, 2] if _dynamo_guards_maybe_mark_dynamic() else [1, 1, 2]
    assert [ranks[r]["graphs_after"] for r in (0, 1)] == [rank0, [1, 2, 2]], ranks


def test_calls_of_the_model_itself_compile_one_graph_on_every_rank(scenarios):
    # patch deepcompile-z3-ranks-agree-on-calls-of-the-module: at 4 ranks (4xH100, fork.23 and fork.24) the Trainer's
    # evaluation, which calls the model itself and not the engine, reached Dynamo with unmarked inputs; Dynamo's
    # automatic dynamic shapes traced rank 0, whose evaluation length was the one its frame was compiled for, static
    # ([2, 80]) and the other ranks symbolic, and the profiler met different graphs (ProfileGraphMismatch). Here rank
    # 0 trains at 40 and evaluates at 40, rank 1 at 45 and 50.
    ranks = two_ranks(scenarios, "train-then-call-directly")
    graphs = [ranks[r]["graphs"] for r in (0, 1)]
    assert [len(g) for g in graphs] == [2, 2], graphs  # training, then evaluation (no_grad recompiles)
    assert graphs[0] == graphs[1], graphs
    assert "(2, s)" in graphs[0][1]["inputs"], graphs
