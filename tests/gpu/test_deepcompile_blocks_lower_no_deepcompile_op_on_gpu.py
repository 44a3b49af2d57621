"""With compile_blocks_once, DeepCompile ZeRO-3 has Inductor lower the model's repeated block, once, and the runs of ops
between DeepCompile's worth fusing (the loss), and runs DeepCompile's ops as traced (patch
deepcompile-compile-blocks-once-lowers-no-deepcompile-op).

Around the blocks a ZeRO-3 graph holds DeepCompile's gathers, releases and gradient reductions, about 150 of them a
decoder layer, and Inductor wrapped each in a fallback kernel: its lowering, scheduling and code generation of those
nodes were most of Inductor's time at the 8B model's width and grew with the depth (docs/warmup.md).

The zoo's Llama in fp32 (workers/dc_grad_accumulation.py --blocks), 8 steps past DeepCompile's WARMUP step, one
length throughout and a new length every step, one process each on one GPU: Inductor lowers graphs
at WARMUP, and no graph that calls the blocks reaches it with DeepCompile's ops (without the patch, the gathers,
releases and reductions of every layer do); every loss and gradient norm stays within 1e-3 of eager ZeRO-3's. At a
length of 37, Inductor pads some of the graphs' buffers (attention's rows of 37 x 37): the graphs lowered on their own
keep their outputs' traced strides, which the next region and the backward read.
"""

import math
import os

import pytest

from dist import DistJob, skip_reason, wait_for_all

TIMEOUT_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "480"))
WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "dc_grad_accumulation.py")
WARMUP = 5  # deepspeed.compile.init_z3.WARMUP
RTOL = 1e-3  # fp32; the bound of test_deepcompile_lowers_only_the_last_cycle.py
# case: (zoo model, worker variant)
CASES = {
    "llama-one-length": ("llama", "past_warmup_same_length"),
    "llama-new-length-each-step": ("llama", "past_warmup"),
}


@pytest.fixture(scope="module")
def runs():
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    started = {(case, mode): DistJob(WORKER, ["--model", model, "--stage", "3", "--mode", mode, "--variant", variant] +
                                     (["--blocks"] if mode == "deepcompile" else []),
                                     nprocs=1,
                                     timeout=TIMEOUT_S,
                                     env={
                                         "TORCHINDUCTOR_COMPILE_THREADS": "1"
                                     }).start()
               for case, (model, variant) in CASES.items() for mode in ("eager", "deepcompile")}
    done = wait_for_all(started, lambda key: f"dc_blocks_lower_no_deepcompile_op_{key[0]}_{key[1]}")
    return {key: res.results[0]["run"] for key, res in done.items()}


@pytest.mark.parametrize("case", CASES)
def test_inductor_lowers_the_blocks_without_deepcompiles_ops_and_the_values_stay_eagers(runs, case):
    eager, dc = runs[case, "eager"], runs[case, "deepcompile"]
    lowered = dc["inductor_graphs_by_step"]
    print(f"\n{case}: graphs handed to Inductor by optimizer step {lowered}, DeepCompile's ops in them "
          f"{dc['dc_ops_lowered']}\nlosses eager {eager['losses']}\n       deepcompile {dc['losses']}\n"
          f"grad norms eager {eager['grad_norms']}\n       deepcompile {dc['grad_norms']}")
    assert dc["deepcompile_active"] and len(lowered) == len(eager["grad_norms"]) == 8
    assert lowered[WARMUP] > 0, f"Inductor lowered nothing at WARMUP: {lowered}"
    assert dc["dc_ops_lowered"] == 0, f"Inductor lowered {dc['dc_ops_lowered']} of DeepCompile's ops with the blocks"
    for got, want in zip(dc["grad_norms"] + dc["losses"], eager["grad_norms"] + eager["losses"]):
        assert math.isfinite(got) and abs(got - want) <= RTOL * abs(want), (got, want)
