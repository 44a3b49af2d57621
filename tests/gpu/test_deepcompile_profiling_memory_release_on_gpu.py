"""On a GPU, DeepCompile's release around profiling runs still frees a CUDA tensor a reference cycle holds, and runs no
full collection when the runs left no device memory behind (patch deepcompile-collect-garbage-only-when-device-memory-
grew; tests/test_deepcompile_profiling_memory_release.py checks the cases with a scripted counter on the CPU), nor
where memory grew with no profiling run (patch deepcompile-collect-garbage-only-after-a-profiling-run)."""

import gc

import pytest

from dist import skip_reason

MiB = 2**20


def test_cycle_held_cuda_tensor_freed_and_no_collection_when_nothing_was_left(monkeypatch):
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    import torch
    import deepspeed.compile.backend as backend
    import deepspeed.compile.util as util

    monkeypatch.setattr(backend, "log_rank0", lambda *args, **kwargs: None)  # no process group here
    collections = []
    real_collect = gc.collect
    monkeypatch.setattr(gc, "collect", lambda *args: collections.append(torch.cuda.memory_allocated()) or
                        real_collect(*args))

    def leave_a_cycle(gm, *args):
        util.profiling_ran()  # as DeepCompile's profilers report a run of a graph
        held = [torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")]
        held.append(held)  # only a full collection frees it
        return None

    def leave_nothing(gm, *args):
        util.profiling_ran()
        scratch = torch.empty(64 * MiB, dtype=torch.uint8, device="cuda")
        del scratch
        return None

    kept = []

    def train_without_profiling(gm, *args):  # the training's own memory: activations, optimizer states
        kept.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda"))
        return None

    def run(passes):
        gm = torch.fx.symbolic_trace(torch.nn.Identity())
        backend.run_opt_passes(opt_passes=passes, gm=gm, graph_id=0, graph_order=[], profiling_results={},
                               create_inputs_fn=lambda: (), mem_budget=0.0, param_manager={}, bwd=False)

    gc.disable()  # Python's own collector must not free the cycle first
    try:
        run([])
        start = torch.cuda.memory_allocated()
        collections.clear()
        run([leave_a_cycle])
        assert torch.cuda.memory_allocated() == start, "the tensor held by a reference cycle was not freed"
        assert len(collections) == 1 and collections[0] >= start + 64 * MiB, collections
        collections.clear()
        run([leave_nothing, leave_nothing])
        assert collections == [], f"full collections with no device memory left behind, at {collections} bytes"
        assert torch.cuda.memory_allocated() == start
        assert torch.cuda.memory_reserved() - start < 64 * MiB, "cached blocks were not returned"
        run([train_without_profiling, train_without_profiling])
        assert collections == [], f"full collections where no profiler ran, at {collections} bytes"
        assert torch.cuda.memory_allocated() == start + 128 * MiB
    finally:
        gc.enable()
