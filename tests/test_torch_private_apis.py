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


def test_inductor_keeps_deepcompile_ops_and_eliminates_the_rest():
    """deepcompile-keep-inductor-dead-code-elimination: Inductor's fallback kernels of DeepCompile's ops report side
    effects (so dead code elimination keeps them) while other ops do not, and elimination stays on for the process.
    Inductor consults torch.fx.has_side_effect only from some version on (2.11 does, 2.8 reads the op's schema).
    0.19.8 turned elimination off, and so did this patch on torch 2.8 before fork.7; no_grad evaluation of SDPA
    models then crashed on cuDNN attention's missing logsumexp. A custom op stands in for DeepCompile's (built on
    GPU hosts)."""
    run("""
        import torch
        from torch._inductor.ir import FallbackKernel
        from torch._inductor.scheduler import Scheduler
        elimination = Scheduler.dead_node_elimination

        @torch.library.custom_op("dc::release_param", mutates_args=())
        def release_param(a: torch.Tensor, graph_id: int, id: int, n_users: int) -> torch.Tensor:
            return a.clone()

        from deepspeed.compile.inductor import keep_deepcompile_ops_through_dead_code_elimination
        keep_deepcompile_ops_through_dead_code_elimination()
        keep_deepcompile_ops_through_dead_code_elimination()  # DeepCompile may be initialized more than once

        class Kernel:  # what dead code elimination asks: FallbackKernel.has_side_effects of the kernel's op
            def __init__(self, op):
                self.op_overload = op

        assert FallbackKernel.has_side_effects(Kernel(torch.ops.dc.release_param.default)), (
            "Inductor would eliminate DeepCompile's release_param when its output is unused")
        assert not FallbackKernel.has_side_effects(Kernel(torch.ops.aten.add.Tensor))
        assert Scheduler.dead_node_elimination is elimination, "dead code elimination was turned off"
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
        import torch._dynamo  # torch >= 2.15 calls the interface itself while importing Dynamo
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


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_multi_tensor_non_finite_check_finds_every_kind_and_changes_nothing(dtype):
    """zero12-overflow-check-in-one-multi-tensor-pass calls torch._amp_foreach_non_finite_check_and_unscale_ with an
    inverse scale of 1 as a read-only check: it must flag inf, -inf and NaN in any tensor of the list, flag nothing
    in finite ones, and leave every value's bits as they were. (Where it raises NotImplementedError the patch warns
    and checks tensor by tensor: tests/test_zero_step_per_tensor_work.py.)"""
    run(f"""
        import torch
        check = torch._amp_foreach_non_finite_check_and_unscale_
        def flagged(tensors):
            found, before = torch.zeros(1), [t.clone() for t in tensors]
            check(tensors, found, torch.ones(1))
            assert all(torch.equal(a.view(torch.int8), b.view(torch.int8)) for a, b in zip(tensors, before))
            return found.item()
        g = torch.Generator().manual_seed(0)
        make = lambda: [torch.randn(n, generator=g).to(torch.{dtype}) for n in (3, 1000, 17)]
        assert flagged(make()) == 0
        for bad in (float("inf"), float("-inf"), float("nan")):
            for i in range(3):
                tensors = make()
                tensors[i][-1] = bad
                assert flagged(tensors) == 1, (bad, i)
    """)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_multi_tensor_infinity_norm_is_finite_exactly_when_every_element_is(dtype):
    """zero12-overflow-check-in-one-multi-tensor-pass checks the dtypes torch's GradScaler kernel refuses (bfloat16 on
    CUDA) with torch._foreach_norm(tensors, inf): each tensor's largest magnitude, which must be inf or NaN when one
    element is inf, -inf or NaN, and finite (the largest magnitude itself) when none is, the dtype's extremes
    included."""
    run(f"""
        import torch
        dt = torch.{dtype}
        g = torch.Generator().manual_seed(0)
        make = lambda: [torch.randn(n, generator=g).to(dt) for n in (3, 1000, 17)]
        extremes = torch.tensor([torch.finfo(dt).max, -torch.finfo(dt).max, torch.finfo(dt).tiny, -0.0], dtype=dt)
        for tensors in (make(), [extremes]):
            norms = torch._foreach_norm(tensors, float("inf"))
            assert all(n.isfinite() and n == t.abs().max() for n, t in zip(norms, tensors)), norms
        for bad in (float("inf"), float("-inf"), float("nan")):
            for i in range(3):
                tensors = make()
                tensors[i][len(tensors[i]) // 2] = bad
                norms = torch.stack(torch._foreach_norm(tensors, float("inf")))
                assert not norms[i].isfinite() and norms.isfinite().sum() == 2, (bad, i, norms)
    """)


def test_multi_tensor_norm_accumulates_in_the_dtype_asked():
    """zero-grad-norm-in-one-multi-tensor-pass takes the gradient norms with torch._foreach_norm(grads, 2,
    dtype=torch.float64): norms in fp64 of bf16 and fp32 tensors, equal to each tensor's own fp64 norm."""
    run("""
        import torch
        g = torch.Generator().manual_seed(0)
        tensors = [torch.randn(n, generator=g).to(dt) * 1e3 for n, dt in ((5, torch.bfloat16), (4099, torch.float32))]
        norms = torch._foreach_norm(tensors, 2, dtype=torch.float64)
        assert all(n.dtype == torch.float64 for n in norms)
        for n, t in zip(norms, tensors):
            assert torch.allclose(n, t.double().norm(), rtol=1e-12), (n, t.double().norm())
    """)


def test_multi_tensor_copy_casts_and_multiply_match_the_per_tensor_ops():
    """zero0-unscale-and-copy-back-in-multi-tensor-ops copies fp32 master weights into bf16/fp16 parameters with
    torch._foreach_copy_ and unscales fp32 gradients with torch._foreach_mul_: bit for bit what copy_ and mul_ give."""
    run("""
        import torch
        g = torch.Generator().manual_seed(0)
        src = [torch.randn(n, generator=g) * 1e3 for n in (3, 1000, 17)]
        for dtype in (torch.bfloat16, torch.float16):
            dst, ref = [torch.empty(t.shape, dtype=dtype) for t in src], [torch.empty(t.shape, dtype=dtype) for t in src]
            torch._foreach_copy_(dst, src)
            for r, s in zip(ref, src):
                r.copy_(s)
            assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(dst, ref))
        fused, ref = [t.clone() for t in src], [t.clone() for t in src]
        torch._foreach_mul_(fused, 1.0 / 3.7)
        for r in ref:
            r.mul_(1.0 / 3.7)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(fused, ref))
    """)
