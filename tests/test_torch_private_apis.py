"""The private torch interfaces fork patches rely on work on the torch installed here (the CPU suite runs on each
version of the torch matrix, docs/torch-matrix.md). Where one is missing, a patch would quietly fall back to
0.19.8's behaviour: these checks make that a failure naming the patch.

Each check runs in a process of its own: importing deepspeed here would fix its accelerator for the whole session
(tests/test_arch_list.py needs the CUDA one)."""

import importlib.util
import subprocess
import sys
import textwrap

import pytest


def run(code):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_frames_can_be_marked_to_run_eagerly():
    """deepcompile-z3-getter-runs-eagerly-in-skipped-frames: ZeRO-3's eager-only getter and hooks must never be
    compiled as frames of their own; without Dynamo's frame-strategy interface they would be."""
    run("""
        from deepspeed.compile.z3_eager_fallback import run_as_eager_code
        assert run_as_eager_code(lambda: 1), (
            "torch._C._dynamo.eval_frame.set_code_exec_strategy or torch._dynamo.types FrameAction/FrameExecStrategy "
            "is missing: skipped frames would get partitioned ZeRO-3 weights again")
    """)


def test_inductor_keeps_side_effect_ops_through_dead_code_elimination():
    """deepcompile-keep-inductor-dead-code-elimination: DeepCompile's ops survive Inductor's dead code elimination
    through torch.fx.has_side_effect only where Inductor's FallbackKernel consults that registry; elsewhere the patch
    turns elimination off for the process as 0.19.8 did, and no_grad evaluation of SDPA models crashes again."""
    run("""
        import torch.fx
        from deepspeed.compile.inductor import _inductor_dce_honors_side_effect_registry
        assert callable(torch.fx.has_side_effect)
        assert _inductor_dce_honors_side_effect_registry(), "Inductor's FallbackKernel ignores torch.fx.has_side_effect"
    """)


def test_nested_allocator_statistics_exist():
    """cuda-accelerator-memory-counters-without-flattening reads torch.cuda.memory_stats_as_nested_dict."""
    run("""
        import torch
        assert callable(getattr(torch.cuda, "memory_stats_as_nested_dict", None))
    """)


def test_missing_frame_strategy_interface_is_reported_once():
    """On a torch without Dynamo's frame-strategy interface, run_as_eager_code cannot do its work: it must say so,
    once, naming what it costs, instead of returning quietly (deepcompile-z3-getter-runs-eagerly-in-skipped-frames).
    The interface is removed here from torch's module to stand for such a torch."""
    run("""
        import io, logging
        import torch._C._dynamo.eval_frame as eval_frame
        del eval_frame.set_code_exec_strategy
        from deepspeed.utils import logger
        from deepspeed.compile.z3_eager_fallback import run_as_eager_code
        said = io.StringIO()
        logger.addHandler(logging.StreamHandler(said))
        assert run_as_eager_code(lambda: 1) is False
        assert run_as_eager_code(lambda: 2) is False
        lines = [l for l in said.getvalue().splitlines() if "frame-strategy interface" in l]
        assert len(lines) == 1, said.getvalue()
        assert "set_code_exec_strategy" in lines[0] and "'weight' must be 2-D" in lines[0], lines[0]
    """)
