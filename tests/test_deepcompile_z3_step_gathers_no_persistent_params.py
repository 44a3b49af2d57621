"""DeepCompile ZeRO-3: the optimizer step gathers no parameters for the next forward to release (patch
deepcompile-z3-optimizer-gathers-no-persistent-params).

ZeRO-3 keeps parameters under stage3_param_persistence_threshold gathered for good, and all-gathers them after every
optimizer step, one collective each. DeepCompile's init_z3 makes every parameter non-persistent (its graphs gather what
they use), but ZeRO-3's list of persistent parameters stayed: every step all-gathered them all, and the next forward
partitioned them again. A Hugging Face model has a few such parameters per layer (norms, biases, the router of an MoE
layer): 85 for the 12-layer Qwen2-MoE-style model of tools/bench. That is 85 collectives of a few KiB, with their
allocations and frees, in every step, and the host bounds that step (docs/bench.md).

Two gloo ranks on CPU (tests/cpu_workers/dc_z3_step_gathers.py): eager ZeRO-3 and DeepCompile ZeRO-3 (its CUDA op a
no-op; the model runs in a frame Dynamo skips) train the same 3 steps.
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_z3_step_gathers.py")
PERSISTENT = ["norm.weight", "norm.bias", "fc1.bias", "fc2.bias"]


@pytest.fixture(scope="module")
def reports():
    return cpu_worker.run_ranks(WORKER, [], nprocs=2, timeout=300)


def test_the_model_has_persistent_parameters(reports):
    for rank in reports.values():
        assert rank["eager"]["persistent"] == PERSISTENT and rank["deepcompile"]["persistent"] == PERSISTENT, rank


def test_eager_zero3_keeps_its_persistent_parameters_gathered(reports):
    # The control: the counter sees the step's gathers where ZeRO-3 wants them, and eager ZeRO-3 is unchanged.
    for rank in reports.values():
        eager = rank["eager"]
        assert all(sum(g.values()) > 0 for g in eager["step_gathers"]), eager
        assert eager["gathered_after_step"] == [PERSISTENT] * 3, eager


def test_deepcompile_step_gathers_nothing_and_leaves_nothing_gathered(reports):
    for rank in reports.values():
        dc = rank["deepcompile"]
        assert dc.get("deepcompile_active"), dc
        assert dc["step_gathers"] == [{}] * 3, dc
        assert dc["gathered_after_step"] == [[]] * 3, dc


def test_deepcompile_trains_as_eager_zero3(reports):
    # The persistent parameters are still updated and used: the same losses, step after step.
    for rank in reports.values():
        assert rank["deepcompile"]["losses"] == pytest.approx(rank["eager"]["losses"], rel=1e-5), rank
