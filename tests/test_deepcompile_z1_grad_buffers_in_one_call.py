"""DeepCompile ZeRO-1 hands each step's gradient buffers to its native registry in one call (patch
deepcompile-z1-grad-buffers-in-one-call).

ZeRO-1 makes a flat, zeroed gradient buffer for its partition at each accumulation window and frees it after the
optimizer step. 0.19.8 cut it into a view per parameter (a slice and a reshape each) and registered each with a call
that zeroed the view again (a kernel launch a parameter), and at the release registered an empty tensor per parameter:
at the 0.55B Llama on one H200 about 880 host dispatches of the 6,354 of a step (docs/bench.md), where the step is
host-bound. The layout is now computed once; each window's buffer is cut with one split and registered with one call,
and released with one.

Checked on CPU at one rank and at two (tests/cpu_workers/dc_z1_grad_buffers.py: the native op recorded, each graph
run as traced, so the gradients reach the buffers through DeepCompile's reduction of eager gradients): the calls per
step, the slices each parameter gets (at two ranks a weight is split between the ranks' partitions), and three steps'
parameters against eager ZeRO-1's.
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_z1_grad_buffers.py")


@pytest.mark.parametrize("ranks", [1, 2])
def test_zero1_grad_buffers_reach_the_native_registry_in_one_call_a_step(ranks):
    reports = cpu_worker.run_ranks(WORKER, [], nprocs=ranks, timeout=300)
    covered = {}
    for rank, report in reports.items():
        calls, steps, slices = report["calls"], report["steps"], report["slices"]
        # The optimizer read the buffers the gradients were reduced into: the same training as eager ZeRO-1.
        assert report["max_param_diff"] <= 1e-6, (rank, report)
        assert calls.get("update_param_grad_buffer", 0) == 0, f"rank {rank}: a call per parameter and step: {calls}"
        assert calls.get("set_param_grad_buffers") == steps and calls.get("clear_param_grad_buffers") == steps, calls
        assert slices["flat_zero"], slices
        ends = [start + numel for start, numel in zip(slices["starts"], slices["numels"])]
        assert all(end <= start for end, start in zip(ends, slices["starts"][1:])), slices  # in order, apart
        assert ends[-1] <= slices["flat_numel"], slices
        for ds_id, offset, numel in zip(slices["ids"], slices["offsets"], slices["numels"]):
            covered.setdefault(str(ds_id), []).append((offset, offset + numel))
    # Every element of every parameter in exactly one rank's slice.
    numels = reports[0]["numels"]
    assert sorted(covered) == sorted(numels), (covered, numels)
    for ds_id, spans in covered.items():
        spans.sort()
        assert spans[0][0] == 0 and spans[-1][1] == numels[ds_id], (ds_id, spans)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), (ds_id, spans)
    if ranks > 1:
        assert any(len(spans) > 1 for spans in covered.values()), f"no parameter split between the ranks: {covered}"
