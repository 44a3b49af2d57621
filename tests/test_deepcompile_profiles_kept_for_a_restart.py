"""A job restarted on the same host plans from the profiles its first run measured (patches
deepcompile-keep-profiles-with-the-compile-cache, deepcompile-keep-all-gather-times-with-the-compile-cache).

DeepCompile ZeRO-3 schedules, prefetches and chooses what stays gathered from the times and memory it profiles while
compiling. A restarted job profiled again, and its timings differ from the first run's by a few percent: on 1x H200
(docs/warmup.md) the two runs' plans of a Llama graph put two prefetched parameters in another order and one
all-gather elsewhere, so Inductor's FX graph cache, keyed on the graph, missed, and the restart warmed up as long as
the first run (82 s and 82 s). The profilers now keep each profile in Inductor's cache folder, keyed on the graph, its
inputs, the world size, the device and the versions, and a job finding one for every rank uses it instead of
profiling. The prefetch pass also fuses all-gathers from times it measures once a process, and those too are kept
(a restart measuring them again fused otherwise, and Inductor missed again: 0.81x of the cold warm-up at 1.5B on one
H200, against 0.51x with them kept). Two gloo ranks on CPU (tests/cpu_workers/dc_profiler_collectives.py), each with
a cache of its own that outlives the process.
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_profiler_collectives.py")
PROFILERS = ("ProfilingInterpreter", "MemoryProfilingInterpreter")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("inductor-caches"))
    first = cpu_worker.run_two_ranks(WORKER, ["--layers", "4", "--cache-root", root])
    restart = cpu_worker.run_two_ranks(WORKER, ["--layers", "4", "--cache-root", root])
    deeper = cpu_worker.run_two_ranks(WORKER, ["--layers", "5", "--cache-root", root, "--alter-times-on-rank1"])
    one_rank_forgot = cpu_worker.run_two_ranks(WORKER, ["--layers", "4", "--cache-root", root, "--forget-on-rank1"])
    return dict(first=first, restart=restart, deeper=deeper, one_rank_forgot=one_rank_forgot)


@pytest.mark.parametrize("profiler", PROFILERS)
def test_a_restart_plans_from_the_first_runs_profile_without_profiling(runs, profiler):
    for rank in (0, 1):
        first, restart = runs["first"][rank][profiler], runs["restart"][rank][profiler]
        assert first["ran"] == first["nodes"] and not first["incomplete"], first
        assert restart["ran"] == 0, f"rank {rank} profiled again: {restart['ran']} nodes"
        assert restart["meta"] == first["meta"] and not restart["incomplete"]


@pytest.mark.parametrize("profiler", PROFILERS)
def test_another_graph_is_profiled(runs, profiler):
    for rank in (0, 1):
        deeper = runs["deeper"][rank][profiler]
        assert deeper["ran"] == deeper["nodes"] > runs["first"][rank][profiler]["nodes"]


@pytest.mark.parametrize("profiler", PROFILERS)
def test_every_rank_profiles_when_one_has_no_kept_profile(runs, profiler):
    # Rank 0 holds the profile, rank 1 does not: profiling runs collectives every rank must join, so both profile.
    for rank in (0, 1):
        again = runs["one_rank_forgot"][rank][profiler]
        assert again["ran"] == again["nodes"] and not again["incomplete"], (rank, again["ran"])


def test_a_restart_fuses_all_gathers_from_the_first_runs_times(runs):
    for rank in (0, 1):
        first, restart = runs["first"][rank]["all_gather"], runs["restart"][rank]["all_gather"]
        assert first["measured"] == 1, first
        assert restart["measured"] == 0, f"rank {rank} measured the all-gathers again"
        assert restart["times"] == first["times"]


@pytest.mark.parametrize("run", ["one_rank_forgot", "deeper"])
def test_every_rank_measures_all_gathers_unless_all_kept_the_same_times(runs, run):
    # one_rank_forgot: rank 1 has no kept times; deeper: rank 1's kept times differ from rank 0's. Measuring runs
    # collectives every rank must join, and ranks fusing from different times would compile different graphs.
    for rank in (0, 1):
        assert runs[run][rank]["all_gather"]["measured"] == 1, (run, rank, runs[run][rank]["all_gather"])
