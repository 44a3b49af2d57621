"""DeepCompile ZeRO-3 at several ranks: Inductor adds no guard on what one rank's value of a symbolic size happens to
be, so no rank recompiles alone when the lengths change (patch deepcompile-z3-inductor-alignment-guards-every-rank-shares).

On 4xH200 (fork.19, the model zoo's Trainer cell at 2 ranks, each batch padded to its own longest row) both ranks
compiled one graph with a symbolic length (deepcompile-z3-ranks-compile-one-graph), but Inductor's SDPA lowering had
guarded it on whether the attention mask is aligned to 8 elements, from each rank's own length. When the lengths
changed, rank 0's guard failed and rank 1's held: rank 0 recompiled alone ("not ((input_ids.size()[1] % 8) == 0
...)") and the ranks waited on each other until the cell's deadline. In DeepCompile's ZeRO-3 compile at world size > 1
Inductor's question (ir.is_aligned_realized_tensor) is now answered from what holds for every length, without a guard.

Inductor asks it only about CUDA tensors; here a compiler standing in for Inductor asks the same function about a mask
of the graph's length, through DeepCompile's wrapper of Inductor's compiler
(tests/cpu_workers/dc_inductor_size_guards.py). Rank 0's lengths are 40 then 37, rank 1's 35 then 43.
"""

import inspect
import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_inductor_size_guards.py")


def _inductor_guards_mask_alignment():
    try:
        from torch._inductor.ir import is_aligned_realized_tensor
    except ImportError:
        return False
    return "guard_or_false" in inspect.getsource(is_aligned_realized_tensor)


pytestmark = pytest.mark.skipif(not _inductor_guards_mask_alignment(),
                                reason="this torch's Inductor picks the mask's layout from size hints and adds no "
                                "guard (torch 2.8): no rank recompiles for it")


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
