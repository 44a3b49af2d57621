"""DeepCompile runs a full garbage collection around a profiling run only when device memory grew since the last one
(patch deepcompile-collect-garbage-only-when-device-memory-grew).

DeepCompile profiles every graph it compiles, several times, and used to call gc.collect() before and after each
run. Measured on an H100 (docs/model-zoo.md, "Where DeepCompile's time goes"): 237 collections over five zoo and
Trainer runs took 0.65-0.75 s each, and none freed more than 0.02 MiB of device memory; in the Trainer run of the
zoo's Llama under ZeRO-3 they took 29.7 s of 174 s. Here the accelerator's memory counter is scripted, so the cases
are exact on a CPU; tests/gpu/test_deepcompile_profiling_memory_release_on_gpu.py frees a real CUDA tensor held by a
reference cycle.
"""

import gc

import pytest

MiB = 2**20

# (case, device memory each scheduled pass leaves allocated, in MiB, after a first release at 100 MiB;
#  full collections expected while run_opt_passes runs those passes)
CASES = [
    ("passes_that_allocate_nothing", [100, 100, 100], 0),
    ("memory_only_freed", [90, 80, 80], 0),
    ("one_pass_allocates", [100, 164, 164], 1),
    ("every_pass_allocates", [101, 102, 103], 3),
    ("freed_then_allocated_again", [50, 60, 60], 1),
]


class ScriptedAccelerator:
    """The accelerator as release_profiling_memory sees it: an allocated-bytes counter the test sets."""

    def __init__(self):
        self.allocated = 0
        self.empty_cache_calls = 0

    def memory_allocated(self, device=None):
        return self.allocated

    def synchronize(self, device=None):
        pass

    def empty_cache(self):
        self.empty_cache_calls += 1


@pytest.fixture
def scripted(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.compile.backend as backend
    import deepspeed.compile.util as util

    acc = ScriptedAccelerator()
    for module in (backend, util):
        monkeypatch.setattr(module, "get_accelerator", lambda: acc)
    monkeypatch.setattr(backend, "log_rank0", lambda *args, **kwargs: None)  # no process group here
    collections = []
    real_collect = gc.collect

    def counting_collect(*args):
        collections.append(acc.allocated)
        return real_collect(*args)

    monkeypatch.setattr(gc, "collect", counting_collect)
    return backend, acc, collections


def run_passes(backend, acc, leaves_mib, profile=True):
    """run_opt_passes with passes that change nothing in the graph but leave the given device memory allocated, each
    after a profiling run (as DeepCompile's profilers report theirs) unless `profile` is false."""
    import torch
    import deepspeed.compile.util as util

    def make_pass(mib):

        def opt_pass(gm, *args):
            if profile:
                util.profiling_ran()
            acc.allocated = mib * MiB
            return None

        return opt_pass

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    backend.run_opt_passes(opt_passes=[make_pass(m) for m in leaves_mib], gm=gm, graph_id=0, graph_order=[],
                           profiling_results={}, create_inputs_fn=lambda: (), mem_budget=0.0, param_manager={},
                           bwd=False)


@pytest.mark.parametrize("leaves_mib,collections_expected", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_full_collection_only_when_device_memory_grew(scripted, leaves_mib, collections_expected):
    backend, acc, collections = scripted
    acc.allocated = 100 * MiB
    run_passes(backend, acc, [])  # settles what the last release saw: 100 MiB
    collections.clear()
    calls_before = acc.empty_cache_calls
    run_passes(backend, acc, leaves_mib)
    assert len(collections) == collections_expected, (
        f"full collections at {[c // MiB for c in collections]} MiB allocated, passes leaving {leaves_mib} MiB")
    # The cached blocks go back to the device around every profiling run, collected or not.
    assert acc.empty_cache_calls - calls_before == 1 + len(leaves_mib)


def test_memory_allocated_at_the_first_release_is_collected(scripted, monkeypatch):
    """Nothing is known before the first release: after a profiling run it collects whatever the allocation."""
    backend, acc, collections = scripted
    import deepspeed.compile.util as util
    monkeypatch.setattr(util, "_allocated_at_last_release", None, raising=False)
    acc.allocated = 0
    util.profiling_ran()
    run_passes(backend, acc, [])
    assert collections == [0]
