"""DeepCompile ZeRO-3's module hooks cost every compile two guards a submodule, built and checked in Python.

The ZeRO-3 eager fallback hooks every submodule (pre- and post-forward). It held one bound method in every
submodule's hook dicts, and Dynamo guards an object it meets again under another name to be the same object: two
aliasing guards a submodule, each one source path of the module tree against another. Dynamo builds them into one
Python guard function (parsing and unparsing every path to share their common parts) and runs it at every call of
the compiled code. For 16 layers of the Llama-3-8B shape that was 3.7 s of the first step's 35 s under cProfile on
an H200 host, and 14-17 s of the 75 s Dynamo took for a tiny Llama of 16 layers on a 2-core CPU (6-7 s with the patch).
With the patch (deepcompile-z3-module-hooks-add-no-guards-a-layer) the hooks are module-level functions that find
their module's fallback themselves: Dynamo guards them by identity, and no aliasing guard passes through a hook dict.

Checked through a real deepspeed.initialize and engine.compile() with DeepCompile's backend stood in for
(tests/cpu_workers/dc_compile_blocks_once.py), Llama of four layers: no aliasing guard through a hook dict (before
the patch: 113 of 138 in all, two a submodule; with it, 25 in all), and the eager loss.
"""

import os

import pytest
import torch

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_compile_blocks_once.py")


@pytest.fixture(scope="module")
def train(tmp_path_factory):
    report, _ = cpu_worker.run(WORKER, ["--stage", "3", "--layers", "4"], "BLOCKS_REPORT ",
                               tmp_path_factory.mktemp("hooks"), timeout=300)
    assert report["error"] is None, report["error"]
    return report["train"]


def test_no_aliasing_guard_passes_through_a_module_hook(train):
    if train["aliasing_guards"] is None:
        pytest.skip(f"torch {torch.__version__}'s Dynamo has no aliasing guard (GuardBuilder.DUPLICATE_INPUT)")
    assert train["aliasing_guards"]["module_hooks"] == 0, train


def test_the_hooked_model_computes_the_eager_loss(train):
    assert abs(train["loss"] - train["eager_loss"]) <= 1e-6 * abs(train["eager_loss"]), train
