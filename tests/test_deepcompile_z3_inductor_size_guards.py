"""DeepCompile ZeRO-3 at several ranks: Inductor adds no guard on what one rank's value of a symbolic size happens to
be, so no rank recompiles alone when the lengths change (patch deepcompile-z3-inductor-size-guards-every-rank-shares).

On 4xH200 (fork.19, the model zoo's Trainer cell at 2 ranks, each batch padded to its own longest row) both ranks
compiled one graph with a symbolic length (deepcompile-z3-ranks-compile-one-graph), but Inductor's SDPA lowering had
guarded it on whether the attention mask is aligned to 8 elements, from each rank's own length. When the lengths
changed, rank 0's guard failed and rank 1's held: rank 0 recompiled alone ("not ((input_ids.size()[1] % 8) == 0
...)") and the ranks waited on each other until the cell's deadline. Inductor's size queries in DeepCompile's
ZeRO-3 compile now answer, at world size > 1, from what holds for every value of the size, and add no guard.

That guard is only made for CUDA tensors; here a compiler standing in for Inductor asks Inductor's own query
(SizeVarAllocator.guard_or_false) the same question, through DeepCompile's wrapper of Inductor's compiler
(tests/cpu_workers/dc_inductor_size_guards.py). Rank 0's lengths are 40 then 37, rank 1's 35 then 43.
"""

import inspect
import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_inductor_size_guards.py")


def _inductor_honours_backed_size_oblivious():
    try:
        from torch._inductor.sizevars import SizeVarAllocator
    except ImportError:
        return False
    return "backed_size_oblivious" in inspect.getsource(SizeVarAllocator.guard_or_false)


pytestmark = pytest.mark.skipif(not _inductor_honours_backed_size_oblivious(),
                                reason="this torch's Inductor guards every size query (torch 2.8): not fixed there")


def test_ranks_compile_once_when_one_ranks_length_changes_alignment():
    ranks = cpu_worker.run_two_ranks(WORKER, [])
    assert [ranks[r]["compiles"] for r in (0, 1)] == [1, 1], ranks  # before the patch: [2, 1]
    assert [ranks[r]["mod_guards"] for r in (0, 1)] == [[0], [0]], ranks
    assert [ranks[r]["aligned"] for r in (0, 1)] == [[False], [False]], ranks  # the lowering right for any length
    assert all(all(ranks[r]["outputs"]) for r in (0, 1)), ranks


def test_one_rank_keeps_inductors_guards():
    # nothing to disagree with at world size 1: Inductor chooses from the length and guards, as before the patch
    report, _ = cpu_worker.run(WORKER, [], "FOUNDING_REPORT ", cwd=os.path.dirname(WORKER))
    assert report["error"] is None and report["world_size"] == 1, report
    assert report["aligned"] == [True, False] and report["mod_guards"] == [1, 1], report
    assert report["compiles"] == 2 and all(report["outputs"]), report
