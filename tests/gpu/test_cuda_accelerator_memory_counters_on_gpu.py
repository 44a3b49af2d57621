"""The CUDA accelerator's memory counters equal torch's on a GPU, through allocations, frees and a peak reset
(patch cuda-accelerator-memory-counters-without-flattening; tests/test_cuda_accelerator_memory_counters.py checks
on the CPU that they no longer flatten the allocator's statistics)."""

import pytest

from dist import skip_reason

COUNTERS = ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved")


def test_counters_equal_torch_through_allocations():
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    acc = CUDA_Accelerator()
    seen = []

    def check(when):
        for device in (None, 0, torch.device("cuda", 0)):
            got = {name: getattr(acc, name)(device) for name in COUNTERS}
            want = {name: getattr(torch.cuda, name)(device) for name in COUNTERS}
            assert got == want, f"{when}, device {device!r}"
        seen.append(got)

    check("start")
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device="cuda")
    check("after a 64 MiB allocation")
    del big
    check("after freeing it")
    torch.cuda.reset_peak_memory_stats()
    small = torch.ones(1000, device="cuda")
    check("after a peak reset and a small allocation")
    del small
    torch.cuda.empty_cache()
    check("after empty_cache")
    # The counters moved: the comparisons were not all of zeros.
    assert seen[1]["memory_allocated"] - seen[0]["memory_allocated"] >= 64 * 2**20
    assert seen[2]["max_memory_allocated"] >= 64 * 2**20 > seen[3]["max_memory_allocated"]
