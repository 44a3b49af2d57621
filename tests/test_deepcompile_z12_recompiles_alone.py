"""DeepCompile ZeRO-1/2: a rank that recompiles must not wait for the others (patch
deepcompile-z12-compile-without-collectives; #7611).

On 2xH200 the zoo's Trainer cell (HF Trainer, dynamic padding, DeepCompile ZeRO-1) hung for ever: rank 0 recompiled a
forward graph for a new length and profiled it, collective by collective, while rank 1, whose length hit a graph it
had, reduced gradients in backward. ZeRO-1/2's passes plan nothing from profiles, so their graphs are no longer
profiled. Checked on CPU with two gloo ranks (tests/cpu_workers/dc_z12_recompile_alone.py); the GPU check is the
zoo's Trainer cells at 2 ranks (tests/gpu/test_model_zoo.py with ZOO_RANKS=2).
"""

import os

import pytest

import cpu_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cpu_workers", "dc_z12_recompile_alone.py")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    out, _ = cpu_worker.run(WORKER, [], "DC_Z12_RECOMPILE ", tmp_path_factory.mktemp("dc_z12"), timeout=600)
    return out


@pytest.mark.parametrize("stage", ["zero1", "zero2"])
def test_a_rank_recompiling_alone_reaches_the_gradient_reduction(report, stage):
    ranks = report[stage]
    assert [r.get("error") for r in ranks] == [None, None], ranks
    assert [r["reduced"] for r in ranks] == [3.0, 3.0], ranks  # 1 + 2: the bucket, not a profiler's flag
