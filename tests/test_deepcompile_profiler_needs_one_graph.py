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

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
from dist import DistJob  # noqa: E402

WORKER = os.path.join(HERE, "cpu_workers", "dc_profile_graph_mismatch.py")
PROFILERS = ("ProfilingInterpreter", "MemoryProfilingInterpreter")


def _run(args):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    res = DistJob(WORKER, args, nprocs=2, timeout=240, env=env).start().wait()
    assert res.ok and sorted(res.results) == [0, 1], res.failure_message()
    assert [res.results[r].get("error") for r in (0, 1)] == [None, None], res.results
    assert [res.results[r]["reduced"] for r in (0, 1)] == [3.0, 3.0], res.results  # the bucket met the bucket
    return res.results


def test_ranks_with_different_graphs_stop_before_profiling():
    for rank in _run(["--differ"]).values():
        for name in PROFILERS:
            assert rank[name].startswith("ProfileGraphMismatch: "), rank
            assert "4 to 5" in rank[name] and "pad_tensors" in rank[name], rank[name]


def test_ranks_with_the_same_graph_profile_it():
    for rank in _run([]).values():
        assert [rank[name] for name in PROFILERS] == ["returned", "returned"], rank
