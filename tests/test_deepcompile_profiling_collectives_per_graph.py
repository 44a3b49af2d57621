"""DeepCompile's profilers meet the other ranks per graph, not per node (patch
deepcompile-profile-with-collectives-per-graph-not-per-node).

At several ranks ProfilingInterpreter took three all-reduces at every node of a graph (has any rank's profile cache
missed, has any rank failed, the ranks' largest memory readings), a fourth at every node it timed, and a device
synchronization after each, and MemoryProfilingInterpreter two; a decoder layer of a Llama graph is a few hundred
nodes. The ranks now vote only before a node that may communicate, and reduce the whole graph's readings once at its
end. Two gloo ranks on CPU (tests/cpu_workers/dc_profiler_collectives.py), a chain of 2 and of 8 linear layers (6 and
18 nodes): fork.37 took 18 and 60 all-reduces in the operator profiler, 13 and 37 in the memory profiler; the fork
now takes 4 and 3 at either depth.
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_profiler_collectives.py")
PROFILERS = ("ProfilingInterpreter", "MemoryProfilingInterpreter")


@pytest.fixture(scope="module")
def by_depth():
    return {layers: cpu_worker.run_two_ranks(WORKER, ["--layers", str(layers)]) for layers in (2, 8)}


@pytest.fixture(scope="module")
def with_local_dc_ops_by_depth():
    return {layers: cpu_worker.run_two_ranks(WORKER, ["--layers", str(layers), "--dc-local-ops"]) for layers in (2, 8)}


@pytest.mark.parametrize("graph", ["chain", "chain with DeepCompile's waits and releases"])
@pytest.mark.parametrize("profiler", PROFILERS)
def test_collectives_do_not_grow_with_the_graph(request, profiler, graph):
    # DeepCompile's waits and releases take part in no collective while profiled (patch
    # deepcompile-profilers-vote-only-before-collectives): 0.19.8's profilers met the other ranks before each.
    runs = request.getfixturevalue("by_depth" if graph == "chain" else "with_local_dc_ops_by_depth")
    shallow, deep = (runs[layers][0][profiler] for layers in (2, 8))
    assert deep["nodes"] > 3 * shallow["nodes"] - 10, (shallow["nodes"], deep["nodes"])
    assert deep["all_reduces"] == shallow["all_reduces"] <= 4, (shallow["all_reduces"], deep["all_reduces"])


@pytest.mark.parametrize("profiler", PROFILERS)
def test_every_rank_holds_the_same_profile(by_depth, profiler):
    ranks = by_depth[8]
    assert not ranks[0][profiler]["incomplete"] and not ranks[1][profiler]["incomplete"]
    assert ranks[0][profiler]["meta"] == ranks[1][profiler]["meta"]
    if profiler == "ProfilingInterpreter":
        # The last relu's output: 4 rows of 8 float32 values.
        relus = [name for name in ranks[0][profiler]["meta"] if name.startswith("relu")]
        assert ranks[0][profiler]["meta"][relus[-1]][4] == 4 * 8 * 4
        assert all(meta[0] > 0 for name, meta in ranks[0][profiler]["meta"].items() if name.startswith("layers"))


def test_a_rank_failing_at_a_node_stops_every_rank_before_the_next_collective():
    ranks = cpu_worker.run_two_ranks(WORKER, ["--fail-on-rank1"])
    for rank in ranks.values():
        for profiler in PROFILERS:
            assert rank[profiler]["incomplete"], (rank["rank"], profiler)
        # Rank 0 did not gather the parameter alone (its all-gather would have waited for rank 1 for ever).
        assert rank["ProfilingInterpreter"]["gathers"] == 0, rank
