"""DeepCompile ZeRO-3 runs its fused prefetch once its WARMUP step has planned it.

From WARMUP on, the prefetch pass gathers groups of parameters ahead of their use with one op,
`dc::prefetch_params_fused`, which returns nothing. From fork.3 to fork.32 Inductor's dead code elimination removed
that op from every compiled graph (deepcompile-keep-inductor-dead-code-elimination pinned DeepCompile's other ops
only), so each parameter was gathered only at its `allgather_param`: no prefetching, nothing to show for it but
speed (docs/bench.md). tests/test_deepcompile_prefetch_survives_dead_code_elimination.py checks the mechanism on a
CPU; this checks a DeepCompile ZeRO-3 run on a GPU.

The zoo's Llama, fp32, a new sequence length every step, 8 steps (workers/dc_grad_accumulation.py, variant
past_warmup), its last step under torch.profiler, which records every dispatcher call of DeepCompile's ops: the
gathers must run in that step (the count is not vacuous) and so must the fused prefetch.
"""

import os

import pytest

from dist import DistJob, skip_reason

TIMEOUT_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "480"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_grad_accumulation.py")


def test_deepcompile_zero3_runs_its_fused_prefetch_after_warmup():
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    res = DistJob(WORKER, ["--stage", "3", "--variant", "past_warmup", "--mode", "deepcompile", "--profile-last-step"],
                  nprocs=1, timeout=TIMEOUT_S, env={"TORCHINDUCTOR_COMPILE_THREADS": "1"}).start().wait()
    res.save("dc_z3_prefetches")
    assert res.ok, res.failure_message()
    run = res.results[0]["run"]
    calls = run["dc_op_calls"]
    print(f"\nDeepCompile's op calls in the last of 8 steps: {calls}")
    assert run["deepcompile_active"]
    assert calls.get("dc::allgather_param", 0) > 0 and calls.get("dc::release_param", 0) > 0, (
        f"the profiler saw none of DeepCompile's gathers and releases in the step: {calls}")
    assert calls.get("dc::prefetch_params_fused", 0) > 0, (
        f"the step prefetched nothing: Inductor dropped dc::prefetch_params_fused from the compiled graphs: {calls}")
