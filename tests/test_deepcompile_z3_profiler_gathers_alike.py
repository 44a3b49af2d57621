"""DeepCompile ZeRO-3's profiler gathers a parameter on every rank or on none (patch
deepcompile-z3-profiler-gathers-on-every-rank-or-none; #7611's family of hangs).

To profile a node the profiler all-gathers each ZeRO-3 parameter it reads that is partitioned on this rank; the
all-gather is a collective. On 2xH200 a two-rank DeepCompile ZeRO-3 cell stopped at its deadline with rank 0 in
exactly that all-gather while profiling the first backward graph (the other rank's stacks were lost). A parameter
gathered on one rank and partitioned on another makes one rank all-gather while the other goes on to the node's
all-reduces. The ranks now agree first, one all-reduce per node that reads ZeRO-3 parameters, and where they differ
all raise into the profiler's handler, which leaves the profile incomplete: no collective goes unmatched. Two gloo
ranks on CPU (tests/cpu_workers/dc_profile_graph_mismatch.py --split-param, a stand-in ZeRO-3 parameter partitioned on
rank 0 and gathered on rank 1): without the patch (fork.15) gloo aborts on the mismatched collectives (exit -6).
"""

import os

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_profile_graph_mismatch.py")


def test_a_parameter_gathered_on_one_rank_only_is_gathered_on_none():
    ranks = cpu_worker.run_two_ranks(WORKER, ["--split-param"])
    for rank in ranks.values():
        assert rank["gathers"] == 0 and rank["profile_incomplete"], rank  # no lone all-gather; the profile gave up
    assert "(ds_id) [7] are partitioned on some ranks and gathered on others" in ranks[0]["profiler_said"], ranks[0]
