"""DeepCompile ZeRO-1/2: a rank that recompiles must not wait for the others (patch
deepcompile-z12-compile-without-collectives; #7611).

On 2xH200 the zoo's Trainer cell (HF Trainer, dynamic padding, DeepCompile ZeRO-1) hung for ever: rank 0 recompiled a
forward graph for a new length and profiled it, collective by collective, while rank 1, whose length hit a graph it
had, reduced gradients in backward. ZeRO-1/2's passes plan nothing from profiles, so their graphs are no longer
profiled. Checked on CPU with two gloo ranks (tests/cpu_workers/dc_z12_recompile_alone.py; without the patch gloo
aborts rank 0 on the mismatched all-reduce); the GPU check is the zoo's Trainer cells at 2 ranks
(tests/gpu/test_model_zoo.py with ZOO_RANKS=2).
"""

import os

import pytest

import cpu_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cpu_workers", "dc_z12_recompile_alone.py")


@pytest.mark.parametrize("stage", ["1", "2"])
def test_a_rank_recompiling_alone_reaches_the_gradient_reduction(stage):
    cpu_worker.run_two_ranks(WORKER, ["--stage", stage])  # both reduce the bucket (1 + 2), no profiler flag with it
