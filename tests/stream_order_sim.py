"""Find missing stream ordering in ZeRO-1/2 gradient reduction on a machine without GPUs.

Runs the cases of tests/gpu/workers/overlap_comm_stream_order.py (its model, its injection at the optimizer's
per-parameter entry, its reference) on CPU, through the real DeepSpeedZeroOptimizer, with the accelerator that
stage_1_and_2 sees replaced by one with simulated streams and events. Every aten op is attributed to the simulated
current stream and checked, with vector clocks, against the earlier accesses to the same memory: an access that
conflicts with one on another stream (at least one of the two a write) without an event, a stream wait or a host
synchronization ordering them is a race. Timing plays no part (the sleep kernels are left out), so what a GPU run
shows only while a sleep kernel holds the window open is found every time, and an ordering the code does
establish is never reported. Memory freed on the host while a stream may still use it (what record_stream is for)
is not modelled: a new allocation starts with a clean history.

  python tests/stream_order_sim.py [CASE ...]     # JSON report on stdout

STREAM_ORDER_SIM_ACCELERATOR=without_events gives the optimizer an accelerator with streams but no events and no
Stream.wait_event; =without_events_or_record_stream one where Tensor.record_stream raises too.
"""

import contextlib
import json
import os
import sys
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu", "workers"))
import overlap_comm_stream_order as worker  # noqa: E402

MAX_REPORTED = 12
# Ops that allocate or describe memory without reading or writing its contents.
NO_DATA_ACCESS = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "record_stream"}


class SimStreamWithoutEvents:
    """A simulated stream of an accelerator without events: it can only wait for another stream."""

    def __init__(self, sim, name):
        self.sim = sim
        self.name = name
        self.clock = {name: 0}

    def tick(self):
        self.clock[self.name] += 1
        return self.clock[self.name]

    def join(self, clock):
        for k, v in clock.items():
            if self.clock.get(k, 0) < v:
                self.clock[k] = v

    def wait_stream(self, other):
        self.join(other.clock)

    def query(self):
        return True

    def synchronize(self):
        self.sim.host_wait(self)

    def __repr__(self):
        return f"{type(self).__name__}({self.name})"


class SimStream(SimStreamWithoutEvents):

    def wait_event(self, event):
        if event.clock is not None:
            self.join(event.clock)

    def record_event(self, event=None):
        event = event or SimEvent(self.sim)
        event.record(self)
        return event


class SimEvent:

    def __init__(self, sim, *args, **kwargs):
        self.sim = sim
        self.clock = None

    def record(self, stream=None):
        stream = stream or self.sim.current
        self.clock = dict(stream.clock)

    def wait(self, stream=None):
        (stream or self.sim.current).wait_event(self)

    def query(self):
        return True

    def synchronize(self):
        if self.clock is not None:
            self.sim.host_join(self.clock)


class Sim:
    """Simulated streams of one device, and the host's view of them."""

    def __init__(self, stream_cls=None):
        self.stream_cls = stream_cls or SimStream
        self.default = self.stream_cls(self, "default")
        self.current = self.default
        self.n_streams = 0
        # What the host has waited for: work issued from now on, on any stream, comes after it.
        self.host = {}

    def new_stream(self, name=None):
        self.n_streams += 1
        return self.stream_cls(self, name or f"stream{self.n_streams}")

    @contextlib.contextmanager
    def stream(self, stream):
        if stream is None:
            yield
            return
        previous, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = previous

    def host_join(self, clock):
        for k, v in clock.items():
            if self.host.get(k, 0) < v:
                self.host[k] = v

    def host_wait(self, stream):
        self.host_join(stream.clock)

    def synchronize_all(self, streams):
        for s in streams:
            self.host_join(s.clock)

    def issue(self):
        """An op is issued on the current stream: returns (stream name, its clock after the op)."""
        s = self.current
        s.join(self.host)
        s.tick()
        return s.name, s.clock


class SimAccelerator:
    """The accelerator as stage_1_and_2 sees it: the real one, with simulated streams and events."""

    def __init__(self, real, sim, streams):
        self._real = real
        self._sim = sim
        self._streams = streams

    def __getattr__(self, name):
        return getattr(self._real, name)

    def is_synchronized_device(self):
        return False

    def resolves_data_dependency(self):
        return False

    def Stream(self, *args, **kwargs):
        s = self._sim.new_stream("side" if any(x.name == "reduction" for x in self._streams) else "reduction")
        self._streams.append(s)
        return s

    def Event(self, *args, **kwargs):
        return SimEvent(self._sim)

    def current_stream(self, *args, **kwargs):
        return self._sim.current

    def default_stream(self, *args, **kwargs):
        return self._sim.default

    def stream(self, stream):
        return self._sim.stream(stream)

    def synchronize(self, *args, **kwargs):
        self._sim.synchronize_all(self._streams)


class SimAcceleratorWithoutEvents(SimAccelerator):
    """An accelerator with streams but no events (its Event is None, as the CPU accelerator's)."""
    Event = None


def record_stream_unsupported(self, stream):
    raise RuntimeError("record_stream is not supported by this backend (simulated)")


ACCELERATORS = {
    # name: (accelerator, its streams, Tensor.record_stream)
    "events": (SimAccelerator, SimStream, lambda self, stream: None),
    "without_events": (SimAcceleratorWithoutEvents, SimStreamWithoutEvents, lambda self, stream: None),
    "without_events_or_record_stream": (SimAcceleratorWithoutEvents, SimStreamWithoutEvents,
                                        record_stream_unsupported),
}


def _extent(t):
    if t.numel() == 0:
        return None
    span = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    start = t.storage_offset() * t.element_size()
    return (t.untyped_storage().data_ptr(), start, start + span * t.element_size())


class RaceDetector(TorchDispatchMode):
    """Attributes each op to the simulated current stream and checks it against earlier accesses."""

    def __init__(self, sim, describe):
        super().__init__()
        self.sim = sim
        self.describe = describe  # data_ptr of a storage -> what it holds, for the report
        self.accesses = {}  # storage data_ptr -> [(lo, hi, is_write, stream, clock value, op)]
        self.races = []
        self.enabled = False

    def _check_and_add(self, ext, is_write, stream, clock, op):
        ptr, lo, hi = ext
        for (a_lo, a_hi, a_write, a_stream, a_value, a_op) in self.accesses.get(ptr, ()):
            if a_hi <= lo or hi <= a_lo or not (is_write or a_write) or a_stream == stream:
                continue
            if clock.get(a_stream, 0) < a_value:
                self.races.append({
                    "memory": self.describe(ptr),
                    "first": f"{'write' if a_write else 'read'} by {a_op} on {a_stream}",
                    "second": f"{'write' if is_write else 'read'} by {op} on {stream}",
                })
        self.accesses.setdefault(ptr, []).append((lo, hi, is_write, stream, clock[stream], op))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.enabled:
            return out
        op = func.__name__
        schema = func._schema
        aliasing_outputs = any(r.alias_info is not None for r in schema.returns)
        writes_args = any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments)
        if (aliasing_outputs and not writes_args) or op.split(".")[0] in NO_DATA_ACCESS:
            return out  # views and allocations touch no data
        stream, clock = self.sim.issue()
        written = set()
        for i, arg in enumerate(schema.arguments):
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            if arg.alias_info is not None and arg.alias_info.is_write:
                for t in tree_flatten(value)[0]:
                    if isinstance(t, torch.Tensor):
                        written.add(id(t))
        inputs = set()
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                ext = _extent(t)
                if ext is not None:
                    inputs.add(ext[0])
                    self._check_and_add(ext, id(t) in written, stream, clock, op)
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and not aliasing_outputs:
                ext = _extent(t)
                # Some ops (c10d collectives) return their inputs without saying so in the schema.
                if ext is not None and ext[0] not in inputs:
                    # A new allocation: whatever this memory held before is gone.
                    self.accesses[ext[0]] = []
                    self._check_and_add(ext, True, stream, clock, op)
        return out


def run_case(case, accelerator="events"):
    import deepspeed.runtime.zero.stage_1_and_2 as zero12

    accelerator_cls, stream_cls, record_stream = ACCELERATORS[accelerator]
    sim = Sim(stream_cls)
    all_streams = [sim.default]
    real_get_accelerator = zero12.get_accelerator
    accel = accelerator_cls(real_get_accelerator(), sim, all_streams)
    zero12.get_accelerator = lambda: accel
    original_record_stream = torch.Tensor.record_stream
    torch.Tensor.record_stream = record_stream
    current = {}

    def describe(ptr):
        """What the memory at a storage address holds, for the report (looked up when a race is found)."""
        engine = current.get("engine")
        if engine is None:
            return "other"
        for bucket in engine.optimizer.ipg_buckets.values():
            for i, buf in enumerate(bucket.buffer):
                if buf.untyped_storage().data_ptr() == ptr:
                    return f"bucket buffer {i}"
        for name, p in engine.module.named_parameters():
            if p.grad is not None and p.grad.untyped_storage().data_ptr() == ptr:
                return f"gradient of {name}"
        return "other"

    detector = RaceDetector(sim, describe)

    @contextlib.contextmanager
    def step_context(step, engine):
        current["engine"] = engine
        sim.current = sim.default
        detector.enabled = True
        try:
            yield
        finally:
            detector.enabled = False
            sim.current = sim.default

    try:
        with detector:
            rec = worker.run_case(case, torch.device("cpu"), 0, 1, step_context=step_context)
    finally:
        zero12.get_accelerator = real_get_accelerator
        torch.Tensor.record_stream = original_record_stream
    races = detector.races
    return {
        "n_races": len(races),
        "races": races[:MAX_REPORTED],
        "race_memory": sorted({r["memory"]
                               for r in races}),
        "max_rel_err": {
            name: max(v)
            for name, v in rec["rel_err"].items()
        },
        "problems": rec["problems"],
        "cpu_offload": rec["cpu_offload"],
        "streams": [s.name for s in all_streams],
    }


def main(argv):
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        import socket
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    # No time on simulated streams: no sleep kernels, and every event reads as complete.
    worker.late_kernel = lambda: None
    worker.CHECK_WINDOW = False
    import deepspeed
    deepspeed.init_distributed(dist_backend="gloo")
    accelerator = os.environ.get("STREAM_ORDER_SIM_ACCELERATOR", "events")
    selected = argv or list(worker.CASES) + list(worker.SIM_ONLY_CASES)
    report = {"deepspeed_version": deepspeed.__version__, "deepspeed_file": deepspeed.__file__,
              "accelerator": accelerator, "cases": {}}
    for case in selected:
        try:
            report["cases"][case] = run_case(case, accelerator)
        except Exception:
            report["cases"][case] = {"error": traceback.format_exc()}
    print("STREAM_ORDER_SIM " + json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
