"""DeepCompile's profilers stop on every rank, before any per-node collective, when the ranks' graphs differ (patch
deepcompile-profile-only-a-graph-every-rank-has; #7611).

ProfilingInterpreter and MemoryProfilingInterpreter all-reduce per node (the profile cache flag, the timings, the
failure vote, the memory), so every rank must run the same sequence of nodes. On 2xH200 both DeepCompile ZeRO-3 cells
of the zoo at 2 ranks, each rank with inputs of its own length, stopped in their first compile with rank 0 inside the
profiler. A graph traced and partitioned for other shapes can differ; its per-node collectives then pair with other
nodes' (on NCCL: for ever). The profilers now agree on a fingerprint of the graph first, in one all-reduce, and raise
ProfileGraphMismatch on every rank where it differs. Two gloo ranks on CPU
(tests/cpu_workers/dc_profile_graph_mismatch.py; DeepCompile's CUDA op handle replaced by one that does nothing, and
the CPU accelerator given timing events): without the patch (fork.15) the rank with the longer graph is still in its
per-node all-reduces when the other reaches the final bucket all-reduce, and gloo aborts on the size mismatch (exit
-6); NCCL would wait for ever. On the same graph the check adds one all-reduce and nothing else (the profile itself
then stops at DeepCompile's own ops, which need the CUDA library, as it does without the patch).
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_profile_graph_mismatch.py")
PROFILERS = ("ProfilingInterpreter", "MemoryProfilingInterpreter")


@pytest.fixture(scope="module")
def run_two_ranks():
    """cpu_worker.run_two_ranks of the worker, once per list of arguments in this module: two tests read the one run
    of --differ."""
    done = {}

    def run(args):
        if tuple(args) not in done:
            done[tuple(args)] = cpu_worker.run_two_ranks(WORKER, args)
        return done[tuple(args)]

    return run


def test_ranks_with_different_graphs_stop_before_profiling(run_two_ranks):
    for rank in run_two_ranks(["--differ"]).values():
        for name in PROFILERS:
            assert rank[name].startswith("ProfileGraphMismatch: "), rank
            assert "4 to 5" in rank[name] and "pad_tensors" in rank[name], rank[name]


def test_the_mismatch_names_the_node_where_the_ranks_graphs_part(run_two_ranks):
    """At 4 ranks the Trainer's evaluation stopped with "this rank's has 356 nodes; across ranks 356 to 366" and
    nothing to say which operation or which input made the ranks' graphs differ (4xH100, fork.23)."""
    ranks = run_two_ranks(["--differ"])
    for me, other, theirs, mine in ((0, 1, "call_function _operator.mul", "output output"),
                                    (1, 0, "output output", "call_function _operator.mul")):
        for name in PROFILERS:
            said = ranks[me][name]
            where = f"rank {other}'s graph departs from this rank's at node 3: {theirs} there, {mine} here"
            assert where in said, said


def test_graphs_traced_at_the_same_sizes_are_not_blamed_on_the_inputs(run_two_ranks):
    """On 4xH200 (fork.33) two ranks with inputs of one shape stopped with this error, which said that the ranks had
    traced their graphs for inputs of different shapes and to pad them: Inductor had padded a matmul on one rank only
    (deepcompile-z3-ranks-agree-on-matmul-padding). Where every rank traced every input at the same size, the error
    now says so (patch deepcompile-graph-mismatch-says-when-inputs-agree)."""
    for rank in run_two_ranks(["--differ", "--traced"]).values():
        for name in PROFILERS:
            said = rank[name]
            assert said.startswith("ProfileGraphMismatch: ") and "departs from this rank's at node" in said, said
            assert "traced its inputs at the same sizes" in said and "pad_tensors" not in said, said


def test_graphs_traced_at_different_sizes_name_the_input_and_the_remedy(run_two_ranks):
    ranks = run_two_ranks(["--differ", "--traced", "--rows", "4", "5"])
    for rank in ranks.values():
        for name in PROFILERS:
            said = rank[name]
            assert "graph input 0 traced as [4, 8] on rank 0, [5, 8] on rank 1" in said, said
            assert "inputs of different shapes" in said and "pad_tensors" in said, said


def test_ranks_with_the_same_graph_profile_it(run_two_ranks):
    for rank in run_two_ranks([]).values():
        assert [rank[name] for name in PROFILERS] == ["returned", "returned"], rank
