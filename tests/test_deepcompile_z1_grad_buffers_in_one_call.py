"""DeepCompile ZeRO-1 hands each step's gradient buffers to its native registry in one call (patch
deepcompile-z1-grad-buffers-in-one-call).

ZeRO-1 makes a flat, zeroed gradient buffer for its partition at each accumulation window and frees it after the
optimizer step. 0.19.8 cut it into a view per parameter (a slice and a reshape each) and registered each with a call
that zeroed the view again (a kernel launch a parameter), and at the release registered an empty tensor per parameter:
at the 0.55B Llama on one H200 about 880 host dispatches of the 6,354 of a step (docs/bench.md), where the step is
host-bound. The layout is now computed once; each window's buffer is cut with one split and registered with one call,
and released with one.

Checked on CPU (tests/cpu_workers/dc_z1_grad_buffers.py: the native op recorded, each graph run as traced, so the
gradients reach the buffers through DeepCompile's reduction of eager gradients): the calls per step, the slices each
parameter gets, and three steps' parameters against eager ZeRO-1's.
"""

import os

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_z1_grad_buffers.py")


def test_zero1_grad_buffers_reach_the_native_registry_in_one_call_a_step(tmp_path):
    report, _ = cpu_worker.run(WORKER, [], "Z1_BUFFERS_REPORT ", tmp_path, timeout=300)
    calls, steps, numels = report["calls"], report["steps"], report["numels"]
    # The optimizer read the buffers the gradients were reduced into: the same training as eager ZeRO-1.
    assert report["max_param_diff"] <= 1e-6, report
    assert calls.get("update_param_grad_buffer", 0) == 0, f"a call per parameter and step: {calls}"
    assert calls.get("set_param_grad_buffers") == steps and calls.get("clear_param_grad_buffers") == steps, calls
    # One rank holds the whole partition: every parameter's slice, whole, one after another, in a zeroed buffer.
    slices = report["slices"]
    assert slices["flat_zero"], slices
    assert slices["numels"] == numels and slices["offsets"] == [0] * len(numels), slices
    assert slices["starts"] == [sum(numels[:i]) for i in range(len(numels))], slices
    assert slices["flat_numel"] >= sum(numels), slices
