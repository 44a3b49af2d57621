"""ZeRO-0 with fp16 or bf16 must not step the client optimizer before training (0.19.8 does, with zero gradients).

FP16_UnfusedOptimizer (the wrapper of fp16, or bf16, without ZeRO and with a torch optimizer), and FP16_Optimizer (fp16
with DeepSpeed's fused Adam) alike, set every gradient to zero and called the optimizer's step() when built. Training
then started with the optimizer's step count at 1: Adam's first update was made with the bias correction of step 2
(0.744 of its size at the default betas), and AdamW's weight decay shrank every weight once before any data. ZeRO-1
creates its optimizer state at the first real step and trains exactly as a hand-written fp32-master loop does
(tests/cpu_workers/zero0_first_update.py; docs/eager-zero-audit.md).

Patch zero0-mixed-precision-wrapper-does-not-step-at-construction: the wrapper no longer steps; without it the two
ZeRO-0 tests fail (step count 1 and masters moved 2.5e-4 before training; losses 0.9190, 0.7210 against 0.8578,
0.6402), and so does the fused wrapper's (step count 1, masters moved 2.5e-4). The ZeRO-1 check guards the reference.
"""

import os

import pytest

import cpu_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cpu_workers", "zero0_first_update.py")
PREFIX = "ZERO0_FIRST_UPDATE "


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out, _ = cpu_worker.run(WORKER, [], PREFIX, tmp_path_factory.mktemp("zero0_first_update"), timeout=300)
    assert out["zero0"]["optimizer"] == "FP16_UnfusedOptimizer", out["zero0"]
    return out


def test_zero1_trains_as_the_fp32_master_reference(runs):
    assert runs["zero1"]["steps_before_training"] == [] and runs["zero1"]["masters_moved_before_training"] == 0
    assert runs["zero1"]["losses"] == runs["reference"]["losses"]


def test_the_optimizer_has_not_stepped_before_training(runs):
    zero0 = runs["zero0"]
    assert zero0["steps_before_training"] in ([], [0.0]), zero0
    assert zero0["masters_moved_before_training"] == 0, zero0


def test_zero0_trains_as_the_fp32_master_reference(runs):
    assert runs["zero0"]["losses"] == pytest.approx(runs["reference"]["losses"], rel=1e-6), runs


def test_the_fused_wrapper_has_not_stepped_when_built(runs):
    fused = runs["fused"]
    assert fused["optimizer"] == "FP16_Optimizer", fused
    assert fused["steps_before_training"] == [] and fused["masters_moved_before_training"] == 0, fused
