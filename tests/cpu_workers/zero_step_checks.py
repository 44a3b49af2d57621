"""Worker for tests/test_zero_step_per_tensor_work.py: the overflow check and norm of eager ZeRO-0/1/2/3's step, on CPU.

One process, world size 1, gloo, DS_ACCELERATOR=cpu: the real engine and its optimizer (ZeRO-0: the mixed-precision
FP16_UnfusedOptimizer, whose CheckOverflow serves bf16 and fp16 without ZeRO), bf16 with
`check_grad_overflow` (the CPU accelerator has no fp16; bf16 with the check on takes the same path as fp16: a
non-finite gradient anywhere skips the step). The model is a stack of small Linear layers, so the optimizer holds
many small gradient tensors, the case where per-tensor work costs the most.

Per case (zero stage, where to put a non-finite value: none, or (tensor index, element, value)), one training step:
the value is written into one element of one parameter's gradient by a tensor hook, before ZeRO takes it. Recorded:
whether the step was skipped (every parameter unchanged), the optimizer's overflow flag, the global gradient norm
it computed (with gradient clipping) next to one computed without DeepSpeed, and how many aten ops the overflow
check and the norm dispatched and how many calls of torch's API they made, and the largest tensor they allocated;
ZeRO-1/2/3: the passes over the whole gradient partition before the optimizer steps, and the fp32 gradient it gets.
Prints one line "ZERO_STEP_CHECKS <json>".
"""

import json
import math
import os
import sys

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gpu", "workers"))
from founding_common import ensure_dist_env, init_distributed  # noqa: E402

LAYERS = 12
WIDTH = 16
BATCH = 4
# name: (zero stage, injection, gradient_clipping). Injection None is a clean step; otherwise (parameter index,
# element, value), negative indices counted from the end as in Python. With gradient_clipping the optimizer
# computes the global gradient norm (clipping at 1e-3 is active on every clean step of this model).
CASES = {
    "z0_clean": (0, None, 0.0),
    "z0_inf_first_tensor": (0, (0, 0, math.inf), 0.0),
    "z0_nan_middle_tensor": (0, (LAYERS, 5, math.nan), 0.0),
    "z0_neg_inf_last_element": (0, (-1, -1, -math.inf), 0.0),
    "z0_clip": (0, None, 1e-3),
    "z1_clean": (1, None, 0.0),
    "z2_clean": (2, None, 0.0),
    "z1_inf_first_tensor": (1, (0, 0, math.inf), 0.0),
    "z2_inf_first_tensor": (2, (0, 0, math.inf), 0.0),
    "z1_nan_middle_tensor": (1, (LAYERS, 5, math.nan), 0.0),
    "z2_nan_middle_tensor": (2, (LAYERS, 5, math.nan), 0.0),
    "z1_neg_inf_last_element": (1, (-1, -1, -math.inf), 0.0),
    "z2_neg_inf_last_element": (2, (-1, -1, -math.inf), 0.0),
    "z3_clean": (3, None, 0.0),
    "z3_inf_first_tensor": (3, (0, 0, math.inf), 0.0),
    "z1_clip": (1, None, 1e-3),
    "z2_clip": (2, None, 1e-3),
    "z3_clip": (3, None, 1e-3),
    "z2_clip_nan": (2, (3, 0, math.nan), 1e-3),
    "z1_moved_param": (1, None, 0.0),
    "z2_moved_param": (2, None, 0.0),
    "z3_frozen_in_optimizer": (3, None, 1e-3),
}
# Cases whose parameter MOVED_PARAM gets new data (a clone) between backward and step, as a .to() or an assigning
# load_state_dict would: the step must point it at the optimizer's flat buffer again, updated.
MOVED = ("z1_moved_param", "z2_moved_param")
MOVED_PARAM = 5
# Cases whose parameter FROZEN_PARAM stops taking gradients after the optimizer was built (a layer frozen during
# training): ZeRO-3 gives it zeros outside its flat gradient buffer.
FROZEN = ("z3_frozen_in_optimizer", )
FROZEN_PARAM = 2
# The optimizer methods whose dispatched aten ops are counted.
COUNTED = ("has_overflow_partitioned_grads_serial", "get_grad_norm_direct", "has_overflow", "_update_model_bit16_weights")


class CountOps(TorchDispatchMode):
    """Counts the aten ops dispatched, and the bytes of the largest tensor any of them returned."""

    def __init__(self):
        super().__init__()
        self.count = 0
        self.reads = 0
        self.largest = 0
        self.copies = 0  # copy kernels: copy_ and the multi-tensor copy

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        self.reads += func is torch.ops.aten._local_scalar_dense.default  # a value read back to the host
        self.copies += func in (torch.ops.aten.copy_.default, torch.ops.aten._foreach_copy_.default)
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out, ):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel() * t.element_size())
        return out


class CountCalls(TorchFunctionMode):
    """Counts the calls of torch's Python API (functions, tensor methods and properties): host work an aten op count
    misses, such as a .to() that returns its tensor as it is."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


class PartitionPasses(TorchDispatchMode):
    """Records each aten op but views that returns a tensor of `numel` elements, the size of the optimizer's flat
    gradient partition (a pass over all of it), until the optimizer's first _optimizer_step: (op, dtype) in order.
    That method is wrapped to stop the record and to note the fp32 gradient it is given."""

    def __init__(self, optimizer, numel, fp32_grad):
        super().__init__()
        self.numel, self.passes, self.stepped = numel, [], False
        self.optimizer, self.fp32_grad, self.grad = optimizer, fp32_grad, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out, ):
            if not self.stepped and not func.is_view and isinstance(t, torch.Tensor) and t.numel() == self.numel:
                self.passes.append([func.overloadpacket.__name__, str(t.dtype).replace("torch.", "")])
        return out

    def _step(self, *args, _step, **kwargs):
        if not self.stepped:
            self.stepped = True
            self.grad = self.fp32_grad().detach().clone()
        return _step(*args, **kwargs)

    def __enter__(self):
        step = self.optimizer._optimizer_step
        self.optimizer._optimizer_step = lambda *a, **k: self._step(*a, _step=step, **k)
        return super().__enter__()

    def __exit__(self, *exc):
        del self.optimizer._optimizer_step
        return super().__exit__(*exc)

    def report(self):
        # With clipping the fp32 gradient is the bf16 one times a factor in fp32: most of its elements then need
        # more than bf16's 8 bits of mantissa. A product rounded to bf16 would need none.
        beyond_bf16 = None
        if self.grad is not None and self.grad.numel():
            beyond_bf16 = (self.grad != self.grad.bfloat16().float()).float().mean().item()
        return {"passes": self.passes, "fp32_grad_dtype": str(self.grad.dtype).replace("torch.", ""),
                "fp32_grad_beyond_bf16": beyond_bf16}


def partition_passes(optimizer, stage):
    """PartitionPasses over the first (here: the only) group's fp32 gradient partition."""
    if stage == 3:
        flat = optimizer.fp32_partitioned_groups_flat[0]
    else:
        flat = optimizer.single_partition_of_fp32_groups[0]
    return PartitionPasses(optimizer, flat.numel(), lambda: flat.grad)


class StepHostWork:
    """Counts, over one ZeRO-3 engine.step(), the walks over the module's parameters (calls of Module.named_parameters)
    and, in the optimizer's preparation of each sub-group's fp32 gradient, the reads of the accelerator's current
    stream and the record_stream calls, with which stream each was made. For that preparation the accelerator answers
    as an asynchronous device does (CUDA: is_synchronized_device() False); record_stream is recorded, not run (a CPU
    tensor has no stream)."""

    STREAM = object()

    def __init__(self, optimizer):
        self.optimizer = optimizer
        self.walks = self.stream_reads = 0
        self.recorded = []

    def _prepare(self, *args, _prepare, **kwargs):
        from deepspeed.accelerator import get_accelerator
        accel = get_accelerator()

        def current_stream(device_index=None):
            self.stream_reads += 1
            return self.STREAM

        record_stream = torch.Tensor.record_stream
        torch.Tensor.record_stream = lambda tensor, stream: self.recorded.append(stream is self.STREAM)
        accel.is_synchronized_device = lambda: False
        accel.current_stream = current_stream
        try:
            return _prepare(*args, **kwargs)
        finally:
            del accel.is_synchronized_device, accel.current_stream  # the class's methods show again
            torch.Tensor.record_stream = record_stream

    def __enter__(self):
        walk = torch.nn.Module.named_parameters

        def named_parameters(module, *args, **kwargs):
            self.walks += 1
            return walk(module, *args, **kwargs)

        self._walk = walk
        torch.nn.Module.named_parameters = named_parameters
        prepare = self.optimizer._prepare_fp32_grad_for_sub_group
        self.optimizer._prepare_fp32_grad_for_sub_group = lambda *a, **k: self._prepare(*a, _prepare=prepare, **k)
        return self

    def __exit__(self, *exc):
        torch.nn.Module.named_parameters = self._walk
        del self.optimizer._prepare_fp32_grad_for_sub_group

    def report(self):
        return {"walks": self.walks, "stream_reads": self.stream_reads, "record_stream_calls": len(self.recorded),
                "recorded_on_the_stream_read": all(self.recorded)}


def build_model():
    torch.manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    return nn.Sequential(*layers)


def reference_grad_norm(injection, frozen=False):
    """The global L2 norm of the gradients of the same step without DeepSpeed, accumulated in fp64."""
    model = build_model().to(torch.bfloat16)
    if frozen:
        list(model.parameters())[FROZEN_PARAM].requires_grad_(False)
    torch.manual_seed(1)
    x = torch.randn(BATCH, WIDTH, dtype=torch.bfloat16)
    model(x).float().pow(2).mean().backward()
    norms = [torch.linalg.vector_norm(p.grad.double()) for p in model.parameters() if p.grad is not None]
    return torch.stack(norms).pow(2).sum().sqrt().item()


def aliases_flat_buffer(optimizer):
    """Whether every bit16 parameter of a ZeRO-1/2 optimizer is a view of its group's flat buffer at its offset (read
    from the attributes 0.19.8 has too), holding what the buffer holds."""
    for flat, params, offsets in zip(optimizer.bit16_groups_flat, optimizer.round_robin_bit16_groups,
                                     optimizer.round_robin_bit16_offsets):
        for p, offset in zip(params, offsets):
            if p.data_ptr() != flat.data_ptr() + offset * flat.element_size():
                return False
            if not torch.equal(p.detach().reshape(-1), flat.narrow(0, offset, p.numel())):
                return False
    return True


def run_case(name):
    import deepspeed

    stage, injection, clipping = CASES[name]
    model = build_model()
    params = list(model.parameters())
    if injection is not None:
        index, element, value = injection

        def inject(grad):
            grad = grad.clone()
            grad.view(-1)[element] = value
            return grad

        params[index].register_hook(inject)
    config = {
        "train_micro_batch_size_per_gpu": BATCH,
        "bf16": {"enabled": True, "check_grad_overflow": True},
        "zero_optimization": {"stage": stage},
        "gradient_clipping": clipping,
        "zero_allow_untested_optimizer": True,
    }
    engine, optimizer, _, _ = deepspeed.initialize(model=model,
                                                   optimizer=torch.optim.SGD(params, lr=0.1),
                                                   config=config)
    if name in FROZEN:
        params[FROZEN_PARAM].requires_grad_(False)
    counters, calls = {}, {}
    # ZeRO-0's mixed-precision optimizers check overflow through their CheckOverflow object.
    checker = getattr(optimizer, "overflow_checker", None)
    zero0 = [(checker, "has_overflow_serial"), (optimizer, "unscale_and_clip_grads"), (optimizer, "step")]
    for owner, method in [(optimizer, m) for m in COUNTED] + (zero0 if stage == 0 else []):
        if owner is not None and hasattr(owner, method):
            counters[method] = counter = CountOps()
            calls[method] = call_counter = CountCalls()

            def counted(*args, _call=getattr(owner, method), _counter=counter, _calls=call_counter, **kwargs):
                with _calls, _counter:
                    return _call(*args, **kwargs)

            setattr(owner, method, counted)
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        before = [p.detach().clone() for p in engine.module.parameters()]
    torch.manual_seed(1)
    x = torch.randn(BATCH, WIDTH, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    # ZeRO-3 checks its flat gradient buffer for overflow under fp16 only, which the CPU accelerator lacks: call the
    # check here, between backward and step, as its fp16 step would.
    direct_check = bool(optimizer.has_overflow()) if stage == 3 else None
    if name in MOVED:
        params[MOVED_PARAM].data = params[MOVED_PARAM].data.clone()
    host_work = StepHostWork(optimizer)
    passes = partition_passes(optimizer, stage) if stage else None
    if stage == 3:
        with host_work, passes:
            engine.step()
    elif stage:
        with passes:
            engine.step()
    else:
        engine.step()
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
        after = [p.detach().clone() for p in engine.module.parameters()]
    norm = engine.get_global_grad_norm()
    return {
        "tensors": len(params),
        "optimizer": type(optimizer).__name__,
        "overflow": bool(optimizer.overflow),
        "zero3_check": direct_check,
        "skipped": all(torch.equal(a, b) for a, b in zip(before, after)),
        "ops": {method: counter.count for method, counter in counters.items()},
        "calls": {method: counter.count for method, counter in calls.items()},
        "host_reads": {method: counter.reads for method, counter in counters.items()},
        "copies": {method: counter.copies for method, counter in counters.items()},
        "largest_bytes": {method: counter.largest for method, counter in counters.items()},
        "zero3_step_host_work": host_work.report() if stage == 3 else None,
        "partition_passes": passes.report() if passes is not None and passes.stepped else None,
        "aliases_flat_buffer": aliases_flat_buffer(optimizer) if stage in (1, 2) else None,
        "moved_param_updated": (not torch.equal(before[MOVED_PARAM], after[MOVED_PARAM])) if name in MOVED else None,
        "grad_norm": None if norm is None else float(norm),
        "reference_grad_norm": reference_grad_norm(injection, name in FROZEN) if clipping and injection is None else None,
    }


def main(argv):
    global LAYERS
    if argv[:1] == ["--layers"]:
        LAYERS, argv = int(argv[1]), argv[2:]
    ensure_dist_env()
    import deepspeed
    init_distributed("gloo")
    report = {"deepspeed_version": deepspeed.__version__, "layers": LAYERS, "cases": {}}
    for name in argv or list(CASES):
        report["cases"][name] = run_case(name)
    print("ZERO_STEP_CHECKS " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
