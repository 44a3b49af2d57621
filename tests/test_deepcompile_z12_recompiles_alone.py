"""DeepCompile ZeRO-1/2: a rank that recompiles must not wait for the others (patch
deepcompile-z12-compile-without-collectives; #7611).

On 2xH200 the zoo's Trainer cell (HF Trainer, dynamic padding, DeepCompile ZeRO-1) hung for ever: rank 0 recompiled a
forward graph for a new length and profiled it, collective by collective, while rank 1, whose length hit a graph it
had, reduced gradients in backward. ZeRO-1/2's passes plan nothing from profiles, so their graphs are no longer
profiled. Checked on CPU with two gloo ranks (tests/cpu_workers/dc_z12_recompile_alone.py; without the patch gloo
aborts rank 0 on the mismatched all-reduce); the GPU check is the zoo's Trainer cells at 2 ranks
(tests/gpu/test_model_zoo.py with ZOO_RANKS=2).
"""

import importlib.util
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu"))
from dist import DistJob  # noqa: E402

WORKER = os.path.join(HERE, "cpu_workers", "dc_z12_recompile_alone.py")


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_rank_recompiling_alone_reaches_the_gradient_reduction(stage):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    env = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    res = DistJob(WORKER, ["--stage", stage], nprocs=2, timeout=240, env=env).start().wait()
    assert res.ok and sorted(res.results) == [0, 1], res.failure_message()
    assert [res.results[r].get("error") for r in (0, 1)] == [None, None], res.results
    assert [res.results[r]["reduced"] for r in (0, 1)] == [3.0, 3.0], res.results  # 1 + 2: the bucket, not a flag
