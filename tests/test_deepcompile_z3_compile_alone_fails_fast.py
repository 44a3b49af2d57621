"""DeepCompile ZeRO-3: a rank that compiles a graph the other ranks do not compile stops with an error that says why,
before it issues a collective, instead of hanging (patch deepcompile-compile-waits-for-every-rank; #7611).

ZeRO-3 profiles every new graph with collectives that every rank must join. With dynamic padding Dynamo compiles on
one rank only; its profiler's collectives then pair with another rank's gradient reduction and both wait for ever
(ZeRO-1/2 compile without collectives since deepcompile-z12-compile-without-collectives). The compile now counts
itself in the store and waits there for the same compile on every rank: alone, it raises after
compile.compile_sync_timeout seconds having issued no collective; together, it compiles as before. Two gloo ranks on
CPU (tests/cpu_workers/dc_z3_compile_alone.py); without the patch gloo aborts the lone rank on the mismatched
all-reduce (exit -6).
"""

import os

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_z3_compile_alone.py")


def test_a_rank_compiling_alone_raises_before_any_collective():
    results = cpu_worker.run_two_ranks(WORKER, ["--alone"])
    rank0, rank1 = results[0], results[1]
    assert "pass_reduced" not in rank0 and not rank0.get("compiled"), rank0  # the profiling pass never ran
    err = rank0["compile_error"]
    assert "rank 0 started compiling" in err and "1 of the 2 ranks" in err and "pad_tensors" in err, err
    assert 4.5 <= rank0["compile_s"] <= 60, rank0  # it waited compile_sync_timeout (5 s), then stopped
    assert "compile_error" not in rank1, rank1


def test_ranks_compiling_together_compile_as_before():
    for rank in cpu_worker.run_two_ranks(WORKER, []).values():
        assert rank.get("compiled") and rank["pass_reduced"] == 2.0, rank  # the pass's collective joined both ranks
