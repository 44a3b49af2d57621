"""DeepCompile ZeRO-3 at several ranks: Inductor pads no matmul on one rank only, so every rank profiles the same
graph (patch deepcompile-z3-ranks-agree-on-matmul-padding).

On 4xH200 (fork.33) tests/gpu/test_z3_release_memcheck.py's dense and tied-embedding jobs, two ranks each,
stopped in their first compile with ProfileGraphMismatch: rank 0's forward graph had a constant_pad_nd where rank 1's
went straight to the addmm (node 40 of 80 and 68), though both ranks' inputs had the same shapes. The jobs' layers have
odd sizes, and Inductor pads such a matmul where a benchmark timed at compile time on the rank's own GPU finds the
padded one faster: the two ranks, with a second suite beside them on the host, timed it apart. Alone on the host the
same jobs passed. The same can stop any model with a size off the tensor-core alignment, a vocabulary of 50257 rows;
on 0.19.8, whose profiler pairs per-node collectives without comparing the graphs, the ranks wait for ever.

Under a schedule that profiles, at world size > 1, DeepCompile now compiles with Inductor's benchmarked padding off:
a matmul stays as the model wrote it unless config.force_shape_pad pads it on every rank. Here two gloo ranks compile
through DeepCompile's backend with the benchmark's answer given per rank (tests/cpu_workers/dc_matmul_padding.py; the
GPU test, a Llama with GPT-2's vocabulary: tests/gpu/test_deepcompile_z3_ranks_recompile_together.py).
"""

import os

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_matmul_padding.py")
PAD = "aten.constant_pad_nd.default"


def test_ranks_whose_padding_benchmarks_disagree_profile_one_graph():
    ranks = cpu_worker.run_two_ranks(WORKER, [])
    graphs = [ranks[r]["graphs"] for r in (0, 1)]
    assert len(graphs[0]) == 1 and graphs[0] == graphs[1], graphs  # before the patch: rank 0's graph padded
    assert PAD not in graphs[0][0], graphs
    assert [ranks[r]["benchmarked"] for r in (0, 1)] == [[], []], ranks  # no rank's timing was asked
    assert all(ranks[r]["output_matches"] for r in (0, 1)), ranks


def test_one_rank_keeps_inductors_padding():
    # nothing to disagree with at world size 1: Inductor benchmarks and pads, as before the patch
    report, _ = cpu_worker.run(WORKER, [], "FOUNDING_REPORT ", cwd=os.path.dirname(WORKER))
    assert report["error"] is None and report["world_size"] == 1, report
    assert report["benchmarked"] and all(report["benchmarked"]), report
    assert PAD in report["graphs"][0] and report["output_matches"], report
