"""The CUDA accelerator's memory counters read one allocator statistic without flattening all of them
(patch cuda-accelerator-memory-counters-without-flattening).

torch.cuda.memory_allocated() and its siblings call torch.cuda.memory_stats(), which flattens the allocator's nested
statistics into a sorted dict of a few hundred entries to return one of them. DeepCompile's profiler reads the
counters for every graph node: in a cProfile of one model-zoo cell (Llama, DeepCompile ZeRO-3, H100) 77,438 such
calls took 43.5 s of 374 s. The counters must give the same values from the nested statistics, on CPU checked with
the statistics stubbed; tests/gpu/test_cuda_accelerator_memory_counters_on_gpu.py compares them with torch's on a GPU.
"""

import pytest

NESTED = {
    "allocated_bytes": {"all": {"current": 1536, "peak": 4096, "allocated": 9000, "freed": 7464}},
    "reserved_bytes": {"all": {"current": 2 * 2**20, "peak": 6 * 2**20, "allocated": 1, "freed": 0}},
}
COUNTERS = [
    ("memory_allocated", 1536),
    ("max_memory_allocated", 4096),
    ("memory_reserved", 2 * 2**20),
    ("max_memory_reserved", 6 * 2**20),
]


@pytest.fixture
def accelerator(monkeypatch):
    pytest.importorskip("deepspeed")
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    asked = []

    def nested(device=None):
        asked.append(device)
        return NESTED

    def flattened(device=None):
        raise AssertionError("torch.cuda.memory_stats() flattens every allocator statistic to read one")

    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", nested)
    monkeypatch.setattr(torch.cuda, "memory_stats", flattened)
    acc = CUDA_Accelerator()
    acc.asked = asked
    return acc


@pytest.mark.parametrize("name, value", COUNTERS)
@pytest.mark.parametrize("device", [None, 0, 1])
def test_counter_reads_nested_statistics(accelerator, name, value, device):
    assert getattr(accelerator, name)(device) == value
    assert accelerator.asked == [device]


@pytest.mark.parametrize("name, _", COUNTERS)
def test_counter_is_zero_before_cuda_is_initialized(accelerator, monkeypatch, name, _):
    # torch.cuda.memory_stats_as_nested_dict() returns {} until CUDA is initialized; torch's counters give 0 then.
    import torch
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", lambda device=None: {})
    assert getattr(accelerator, name)() == 0
