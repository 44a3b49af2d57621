"""Eager ZeRO's step did host work per gradient tensor: the overflow check of ZeRO-1/2 (patch
zero12-overflow-check-in-one-multi-tensor-pass) and the gradient norm of ZeRO-1/2/3 (zero-grad-norm-in-one-multi-
tensor-pass) dispatched several ops per tensor, which dominates the step of a model of many small tensors
(docs/eager-zero-step-work.md). Both now take one multi-tensor pass per parameter group: the number of ops they
dispatch must not grow with the number of tensors, and what they decide must not change.

tests/cpu_workers/zero_step_checks.py runs the real engine and ZeRO optimizers on CPU (world size 1, gloo) for
each case; deepspeed is imported in processes of its own, never here (see tests/test_torch_private_apis.py).
"""

import importlib.util
import math
import os
import subprocess
import sys
import textwrap

import pytest

import cpu_worker

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "cpu_workers", "zero_step_checks.py")
sys.path.insert(0, os.path.join(HERE, "cpu_workers"))
from zero_step_checks import CASES  # noqa: E402

PREFIX = "ZERO_STEP_CHECKS "
# The model sizes (layers of two tensors each) the op counts are compared across.
SMALL, LARGE = 12, 24


def run_worker(tmp_path_factory, layers, cases=()):
    report, _ = cpu_worker.run(WORKER, ["--layers", str(layers), *cases], PREFIX, tmp_path_factory.mktemp("zero_step"))
    return report["cases"]


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return run_worker(tmp_path_factory, SMALL)


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    return run_worker(tmp_path_factory, LARGE, ["z0_clip", "z1_clip", "z2_clip", "z3_clip"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_non_finite_gradient_anywhere_skips_the_step(small, case):
    """An inf, -inf or NaN in one element of one tensor (first, middle or last) is found and the step skipped, with
    and without gradient clipping; a clean step is taken."""
    stage, injection, _ = CASES[case]
    rec = small[case]
    assert rec["overflow"] is (injection is not None), rec
    assert rec["skipped"] is (injection is not None), rec


@pytest.mark.parametrize("case", ["z0_clip", "z1_clip", "z2_clip", "z3_clip", "z3_frozen_in_optimizer"])
def test_the_gradient_norm_is_that_of_the_gradients(small, case):
    """The global norm the optimizer computed equals the norm of the same step's gradients without DeepSpeed,
    accumulated in fp64; ZeRO-1/2 round the sum of squares to fp32 before the root (as 0.19.8 does), hence the
    tolerance, far below any change in which tensors are counted (each contributes more than 1e-4 here)."""
    rec = small[case]
    assert rec["grad_norm"] == pytest.approx(rec["reference_grad_norm"], rel=1e-6), rec


@pytest.mark.parametrize("case", ["z1_clip", "z2_clip", "z3_clip"])
def test_the_step_checks_dispatch_no_op_per_tensor(small, large, case):
    """The overflow check (ZeRO-1/2; ZeRO-3 checks its flat buffer already) and the norm dispatch as many ops for a
    model of 48 gradient tensors as for one of 24. 0.19.8: about 13 and 4 ops per tensor."""
    assert small[case]["tensors"] == 2 * SMALL and large[case]["tensors"] == 2 * LARGE
    assert large[case]["ops"] == small[case]["ops"], (small[case], large[case])
    assert small[case]["ops"]["get_grad_norm_direct"] > 0, "the norm was not computed"
    if case != "z3_clip":
        assert small[case]["ops"]["has_overflow_partitioned_grads_serial"] > 0, "the overflow check did not run"


@pytest.mark.parametrize("case", ["z1_clip", "z2_clip"])
def test_zero12_norm_moves_the_norms_with_one_call(small, large, case):
    """ZeRO-1/2's norm moved each tensor's norm to the accelerator with a .to() of its own (patch
    zero12-grad-norm-moves-the-norms-together): no kernel where the norm already is, but host work a tensor (219 a step
    of a 0.55B Llama), which no aten op count sees. Now as many calls of torch's API for 48 tensors as for 24."""
    calls = [rec[case]["calls"]["get_grad_norm_direct"] for rec in (small, large)]
    assert calls[1] == calls[0] > 0, calls


@pytest.mark.parametrize("case", ["z1_clip", "z2_clip"])
def test_zero12_step_rebinds_no_parameter_that_still_views_its_flat_buffer(small, large, case):
    """ZeRO-1/2 pointed every bit16 parameter at its slice of the flat buffer after every step (a narrow, a view and a
    .data assignment each: 0.19.8's "TODO: we probably don't need this?"), though the parameters already were those
    views. Now nothing runs for them, whatever their number, and they still are the buffer's views after the step."""
    ops = [rec[case]["ops"]["_update_model_bit16_weights"] for rec in (small, large)]
    assert ops == [0, 0], ops
    assert small[case]["aliases_flat_buffer"] and large[case]["aliases_flat_buffer"]


@pytest.mark.parametrize("case", ["z1_moved_param", "z2_moved_param"])
def test_zero12_step_points_a_moved_parameter_at_its_flat_buffer_again(small, case):
    """A parameter whose data was replaced (a .to(), an assigning load_state_dict) between backward and step is
    pointed at the updated flat buffer again by the step, as 0.19.8 did: it trains on."""
    rec = small[case]
    assert rec["ops"]["_update_model_bit16_weights"] > 0, rec
    assert rec["aliases_flat_buffer"] and rec["moved_param_updated"], rec


def test_zero0_overflow_check_is_one_pass_and_one_host_read(small, large):
    """ZeRO-0's mixed-precision optimizers check overflow with CheckOverflow.has_overflow_serial, which in 0.19.8
    runs has_inf_or_nan on each gradient and reads each result back to the host (14 ops and one device
    synchronization per tensor). Now: as many ops for 48 tensors as for 24, and one read."""
    assert small["z0_clip"]["optimizer"] == "FP16_UnfusedOptimizer", small["z0_clip"]
    ops = [rec["z0_clip"]["ops"]["has_overflow_serial"] for rec in (small, large)]
    assert ops[0] == ops[1] > 0, ops
    assert small["z0_clip"]["host_reads"]["has_overflow_serial"] == 1, small["z0_clip"]


def test_zero0_unscales_and_copies_back_in_multi_tensor_ops(small, large):
    """FP16_UnfusedOptimizer multiplied every fp32 gradient by 1/scale one tensor at a time, also by 1 when there was
    nothing to unscale (bf16 without clipping), and copied every fp32 master weight back to its bf16 parameter with a
    copy kernel each. Now: nothing when the scale is 1, one multi-tensor multiply otherwise (here: clipping), and one
    multi-tensor copy for the parameter group, whatever the number of tensors."""
    assert small["z0_clean"]["ops"]["unscale_and_clip_grads"] == 0, small["z0_clean"]
    clip = [rec["z0_clip"]["ops"]["unscale_and_clip_grads"] for rec in (small, large)]
    assert clip[0] == clip[1] > 0, clip
    copies = [rec["z0_clip"]["copies"]["step"] for rec in (small, large)]
    assert copies == [1, 1], copies


def test_zero3_step_walks_the_modules_parameters_once(small, large):
    """Patch zero3-step-walks-the-parameters-once: every ZeRO-3 step ends by releasing all parameters, which walked
    the module's parameters three times (release, check, and the same check again); with nothing gathered, as after
    every DeepCompile ZeRO-3 backward, the walks were the work, host time at every step. Now one walk, and the
    step's result is unchanged (the norm test above, the differential suite)."""
    walks = [rec["z3_clip"]["zero3_step_host_work"]["walks"] for rec in (small, large)]
    assert walks == [1, 1], walks


def test_zero3_fp32_grads_record_their_stream_reading_it_once(small, large):
    """Patch zero3-step-reads-the-current-stream-once: on a device with streams, the step records every gradient of a
    sub-group on the current stream before dropping it, and read that stream again for each gradient (on CUDA the read
    costs more host time than the record). Now the stream is read once per sub-group (one here, at 24 and 48 tensors),
    and every gradient is still recorded on it."""
    work = [rec["z3_clip"]["zero3_step_host_work"] for rec in (small, large)]
    assert [w["record_stream_calls"] for w in work] == [2 * SMALL, 2 * LARGE], work
    assert all(w["recorded_on_the_stream_read"] for w in work), work
    assert [w["stream_reads"] for w in work] == [1, 1], work


def run_utils(code):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)],
                          capture_output=True,
                          text=True,
                          env=cpu_worker.cpu_env(),
                          timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout + proc.stderr


CHECK = """
    import math
    import torch
    from deepspeed.runtime.utils import accumulate_inf_or_nan_

    def found(tensors):
        flag = torch.zeros(1)
        accumulate_inf_or_nan_(tensors, flag)
        return flag.item()

    clean = [torch.tensor([1e-45, -0.0, 3.4e38, -3.4e38]), torch.empty(0), torch.randn(7).bfloat16()]
    copies = [t.clone() for t in clean]
    assert found(clean) == 0.0
    # The fused check rewrites every element with itself: nothing may change, to the bit.
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(clean, copies))
    for value in (math.inf, -math.inf, math.nan):
        for where in range(3):
            tensors = [torch.ones(5), torch.ones(3, dtype=torch.bfloat16), torch.ones(2, 2)]
            tensors[where].view(-1)[-1] = value
            assert found(tensors) == 1.0, (value, where)
    sparse = torch.sparse_coo_tensor([[0, 3]], [1.0, math.nan], (6,))
    assert found([torch.ones(2), sparse]) == 1.0
    assert found([torch.ones(2), torch.sparse_coo_tensor([[1]], [2.0], (6,))]) == 0.0
    assert found([]) == 0.0
"""


def test_the_fused_check_finds_every_non_finite_value_and_changes_nothing():
    run_utils(CHECK)


# Counts the aten ops accumulate_inf_or_nan_ dispatches for n tensors of each dtype (the worker's counter).
COUNT_OPS = f"""
    import sys
    sys.path.insert(0, {os.path.dirname(WORKER)!r})
    from zero_step_checks import CountOps

    def ops_for(n):
        tensors = [torch.randn(7).bfloat16() for _ in range(n)] + [torch.randn(3) for _ in range(n)]
        flag = torch.zeros(1)
        with CountOps() as ops:
            accumulate_inf_or_nan_(tensors, flag)
        assert flag.item() == 0.0
        return ops.count

    ops_for(1)  # the first call learns which dtypes lack the GradScaler kernel
    print("ops", ops_for(10), ops_for(200))
"""


def test_a_dtype_without_the_gradscaler_kernel_is_checked_in_one_multi_tensor_pass():
    """CUDA's torch has no GradScaler non-finite kernel for bfloat16 (NotImplementedError), the dtype of most
    gradients. The first version of the fused check then went back to has_inf_or_nan tensor by tensor for the whole
    device: 438 checks per step of a 0.5B bf16 Llama under DeepCompile ZeRO-1 on an H100. Here torch's kernel is made
    to refuse bfloat16 as CUDA's does: the check must still make as many ops for 200 tensors of each dtype as for 10,
    and find every non-finite value in either dtype."""
    out = run_utils(
        textwrap.dedent("""
        import torch
        amp_check = torch._amp_foreach_non_finite_check_and_unscale_

        def like_cuda(tensors, found_inf, inv_scale):
            if tensors[0].dtype == torch.bfloat16:
                raise NotImplementedError("_amp_foreach_non_finite_check_and_unscale_cuda not implemented for 'BFloat16'")
            return amp_check(tensors, found_inf, inv_scale)

        torch._amp_foreach_non_finite_check_and_unscale_ = like_cuda
    """) + textwrap.dedent(CHECK) + textwrap.dedent(COUNT_OPS))
    few, many = map(int, next(line for line in out.splitlines() if line.startswith("ops ")).split()[1:])
    assert few == many, f"the check makes ops per tensor: {few} ops for 10 tensors a dtype, {many} for 200"


def test_the_zero3_overflow_check_allocates_nothing_the_size_of_the_gradients(small, large):
    """Patch zero3-overflow-check-without-boolean-masks: ZeRO-3's check of its flat gradient buffer made two boolean
    copies of it (isinf, isnan), a byte per gradient element at every fp16 step; it now reduces it to scalars. It
    still finds the inf the case put in the first tensor, and nothing in a clean step."""
    for rec in (small["z3_clip"], large["z3_clip"]):
        assert rec["ops"]["has_overflow"] > 0, "the check did not run"
        assert rec["largest_bytes"]["has_overflow"] <= 8, rec["largest_bytes"]
        assert rec["zero3_check"] is False
    assert small["z3_inf_first_tensor"]["zero3_check"] is True


def fp32_passes(rec):
    return [op for op, dtype in rec["partition_passes"]["passes"] if dtype == "float32"]


@pytest.mark.parametrize("case", ["z1_clip", "z2_clip", "z3_clip", "z3_clean"])
def test_zero_step_unscales_gradients_as_it_casts_them(small, case):
    """Patch zero-step-unscales-gradients-as-it-casts-them: the step cast the gradient partition to fp32 and then
    multiplied the fp32 copy by 1 / (loss scale x clip coefficient) in place, two passes over every trained parameter
    (ZeRO-3 also multiplied by 1 without clipping). Now one op makes the fp32 gradient, unscaled. It must still be an
    fp32 product: with clipping most of its elements need more mantissa than bf16 has (a factor that type promotion
    let round the product to bf16 would make it 0)."""
    rec = small[case]
    assert fp32_passes(rec) == (["mul"] if case.endswith("clip") else ["_to_copy"]), rec["partition_passes"]
    assert rec["partition_passes"]["fp32_grad_dtype"] == "float32"
    if case.endswith("clip"):
        assert rec["partition_passes"]["fp32_grad_beyond_bf16"] > 0.5, rec["partition_passes"]


@pytest.mark.parametrize("case", ["z3_clip", "z3_clean"])
def test_zero3_step_casts_gradients_without_flattening_them(small, case):
    """Patch zero3-step-casts-gradients-without-flattening-them: ZeRO-3 flattened the sub-group's gradient partitions
    (a bf16 copy of all of them) before casting, though they lie back to back in its flat gradient buffer. Now no
    bf16 pass over the partition before the optimizer steps."""
    passes = small[case]["partition_passes"]["passes"]
    assert [op for op, dtype in passes if dtype == "bfloat16"] == [], passes
    assert fp32_passes(small[case]), passes


def test_zero3_step_flattens_the_gradients_where_a_parameter_stopped_taking_them(small):
    """A parameter frozen after the optimizer was built gets zeros outside ZeRO-3's flat gradient buffer, so the
    sub-group's gradients no longer lie back to back there: the step flattens them as before (a bf16 copy, then one
    fp32 pass) and clips by the norm of the others' gradients (the norm test above)."""
    rec = small["z3_frozen_in_optimizer"]
    assert rec["partition_passes"]["passes"] == [["cat", "bfloat16"], ["mul", "float32"]], rec["partition_passes"]


def test_one_pass_unscale_equals_the_cast_then_multiply_to_the_bit():
    """The step's one-pass unscale, torch.mul of the 16-bit gradients by factor_for_dtype(factor, float32), against
    0.19.8's cast to fp32 then in-place multiply: the same bits for bf16 and fp16 gradients (signed zeros, the largest
    values, inf and NaN among them) and each kind of factor the step has (a 0-dim tensor of the norm's fp64 or fp32, a
    number where only a loss scale applies). A factor left as a number or a 0-dim tensor would round the product to
    the gradients' dtype: shown with a factor that is not a power of two."""
    run_utils("""
        import math
        import torch
        from deepspeed.runtime.zero.utils import factor_for_dtype

        torch.manual_seed(0)
        for dtype in (torch.bfloat16, torch.float16):
            grads = (torch.randn(4099) * 3).to(dtype)
            grads[:6] = torch.tensor([0.0, -0.0, torch.finfo(dtype).max, -torch.finfo(dtype).max, math.inf, math.nan])
            for factor in (torch.tensor(1 / 3.7, dtype=torch.float64), torch.tensor(0.0123), 1 / 1024.0, 1 / 3.0):
                two_passes = grads.to(torch.float32)
                two_passes.mul_(factor)
                one_pass = torch.mul(grads, factor_for_dtype(factor, torch.float32, grads.device))
                assert one_pass.dtype == torch.float32, one_pass.dtype
                assert torch.equal(one_pass.view(torch.int32), two_passes.view(torch.int32)), (dtype, factor)
                if float(factor) != 1 / 1024.0:
                    assert not torch.equal(torch.mul(grads, factor).float()[6:], two_passes[6:]), (dtype, factor)
    """)
