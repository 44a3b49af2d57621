"""DeepCompile: a call of the model itself before the engine's first forward compiles with the pass schedule's due
entry (patch deepcompile-passes-launch-on-calls-of-the-module).

The Hugging Face Trainer evaluating before training (eval_on_start, or evaluate() first) calls the model, not the
engine, and only the engine's forward launched DeepCompile's schedule: the first compile found no passes (None) and
the backend failed iterating them. Checked here with DeepCompile's init and default schedule for each stage on CPU
(tests/cpu_workers/dc_passes_on_calls_of_the_module.py records the passes each compile would run); on GPUs by
tests/gpu/test_deepcompile_evaluation_before_training.py and the zoo's Trainer with ZOO_TRAINER_EVAL_ON_START=1.
"""

import os

import pytest

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_passes_on_calls_of_the_module.py")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_evaluation_before_the_first_step_compiles_with_the_due_passes(stage, tmp_path):
    report, _ = cpu_worker.run(WORKER, ["--stage", str(stage)], "PASSES_REPORT ", tmp_path, timeout=300)
    seen = report["seen"]
    assert seen and seen[0] is not None, seen  # None: the real backend fails ("'NoneType' object is not iterable")
    if stage == 3:
        assert "add_z3_gather_release" in seen[0], seen  # the pass that gathers the partitioned parameters
    else:
        assert seen[1:] == [seen[0]], seen  # the training step that follows compiles with the same entry
