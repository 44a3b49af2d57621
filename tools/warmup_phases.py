"""Where the time of a warm-up goes, per warm-up step: Dynamo, AOTAutograd, Inductor, DeepCompile's profiling (of
time, and of memory) and its passes, ranks waiting for each other to compile, and the rest (running the steps).

install() wraps the functions each phase runs in (TARGETS). A wrapped call's time counts for its phase less the time
of the phases called inside it: a Dynamo compile's backend call counts for AOTAutograd and Inductor, a DeepCompile
pass's profiling run for profiling. `other` is the rest of a step's wall time. A target this torch or deepspeed lacks
is named in `missing` rather than failing the run. One clock per process; the phases of a backward compiled lazily on
autograd's device thread count too (the thread that started backward() is waiting then).
Python's garbage collections are counted apart, per generation with their seconds (gc.callbacks): a collection runs
inside whichever phase allocated, so its time is a part of that phase's, not a phase of its own.
Within DeepCompile's profiling, the nodes its operator profiler timed and the profilers' votes are counted apart
(PROFILER_TARGETS, PhaseClock.count), with their inclusive seconds.
"""

import functools
import gc
import importlib
import threading
import time

# (phase, module, attribute path): each callable whose time (less its nested phases') counts for the phase.
TARGETS = (
    ("dynamo", "torch._dynamo.convert_frame", "_compile"),
    # Joint tracing, partitioning and the compilers' glue; the forward's compiler is called inside it, the
    # backward's at the first backward.
    ("aot", "torch._dynamo.backends.common", "AotAutograd.__call__"),
    ("inductor", "torch._inductor.compile_fx", "_compile_fx_inner"),
    ("dc_passes", "deepspeed.compile.backend", "run_opt_passes"),
    # Each node run and timed on its own (before a pass's scheduling), and each node's memory (after each pass).
    ("dc_profiling", "deepspeed.compile.profilers.graph_profile", "ProfilingInterpreter.run"),
    ("dc_memory_profiling", "deepspeed.compile.profilers.graph_profile", "MemoryProfilingInterpreter.run"),
    ("rank_wait", "deepspeed.compile.backend", "wait_for_every_rank_to_compile"),
)
# Within DeepCompile's profiling, what its cost is mostly made of, counted with inclusive seconds (not phases): each
# node the operator profiler ran, by whether it timed it (15 runs and a device synchronization) or had timed its kind
# before (one run), and each vote the profilers took before a node that may communicate (an all-reduce and a device
# synchronization). Absent from releases before the fork's profilers had them.
PROFILER_TARGETS = (
    ("node", "deepspeed.compile.profilers.graph_profile", "ProfilingInterpreter._profile_node"),
    ("vote", "deepspeed.compile.profilers.graph_profile", "_vote"),
)
# Every phase and its name in tables, in the order tables show them.
NAMES = {"dynamo": "Dynamo", "aot": "AOT", "inductor": "Inductor", "dc_profiling": "DC profiling",
         "dc_memory_profiling": "DC memory profiling", "dc_passes": "DC passes", "rank_wait": "rank wait",
         "other": "other"}


class PhaseClock:
    """Exclusive time per phase and calls per phase, for each step between begin(k) and end()."""

    def __init__(self, on_update=None, update_every_s=5.0):
        self.steps = []
        self._lock = threading.Lock()
        self._stack = []
        self._slice_start = None
        self._step = None
        self._gc_start = None
        self._on_update, self._every, self._last_update = on_update, update_every_s, time.monotonic()

    def gc_callback(self, event, info):
        """A gc.callbacks hook: each step's collections per generation, [count, seconds] (a collection holds the
        interpreter, so no other thread runs between its start and its stop)."""
        if event == "start":
            self._gc_start = time.perf_counter()
            return
        start, self._gc_start = self._gc_start, None
        step = self._step
        if start is None or step is None:
            return
        count, seconds = step["gc"].get(str(info["generation"]), (0, 0.0))
        step["gc"][str(info["generation"])] = [count + 1, seconds + time.perf_counter() - start]

    def begin(self, step):
        self._step = {"step": step, "wall_s": 0.0, "phases": {}, "calls": {}, "gc": {}, "profiler": {},
                      "_start": time.perf_counter()}
        self.steps.append(self._step)

    def end(self):
        step = self._step
        step["wall_s"] = time.perf_counter() - step.pop("_start")
        step["phases"]["other"] = max(0.0, step["wall_s"] - sum(step["phases"].values()))
        self._step = None
        self._update(force=True)

    def _charge(self, phase, seconds):
        if self._step is not None:
            self._step["phases"][phase] = self._step["phases"].get(phase, 0.0) + seconds

    def enter(self, phase):
        with self._lock:
            now = time.perf_counter()
            if self._stack:
                self._charge(self._stack[-1], now - self._slice_start)
            self._stack.append(phase)
            self._slice_start = now
            if self._step is not None:
                self._step["calls"][phase] = self._step["calls"].get(phase, 0) + 1

    def exit(self):
        with self._lock:
            now = time.perf_counter()
            self._charge(self._stack.pop(), now - self._slice_start)
            self._slice_start = now
        self._update()

    def count(self, what, seconds):
        """One more `what` in this step's profiler counts, [count, inclusive seconds]."""
        with self._lock:
            if self._step is not None:
                n, t = self._step["profiler"].get(what, (0, 0.0))
                self._step["profiler"][what] = [n + 1, t + seconds]

    def counted(self, kind, fn):
        """`fn` (a PROFILER_TARGETS callable) counting its calls: a vote as `vote`; a node the operator profiler ran as
        `timed <op>` where it timed it, `reused` where it had timed its kind before."""

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                what = kind
                if kind == "node" and len(args) == 6:  # (self, node, args, kwargs, cache_key, cache_hit)
                    what = "reused" if args[5] else f"timed {getattr(args[1], 'target', '?')}"
                self.count(what, time.perf_counter() - start)

        wrapper.__warmup_phase__ = kind
        return wrapper

    def _update(self, force=False):
        """Hand the steps so far to on_update at most every update_every_s (a warm-up cut by its deadline keeps
        what it measured until then)."""
        if self._on_update is None or (not force and time.monotonic() - self._last_update < self._every):
            return
        self._last_update = time.monotonic()
        self._on_update(self.snapshot())

    def snapshot(self):
        """The steps measured, the one under way included (its wall time so far)."""
        out = []
        for s in self.steps:
            s = dict(s, phases=dict(s["phases"]), calls=dict(s["calls"]))
            if "profiler" in s:
                s["profiler"] = {k: list(v) for k, v in s["profiler"].items()}
            if "gc" in s:
                s["gc"] = {g: list(v) for g, v in s["gc"].items()}
            if "_start" in s:
                s["wall_s"] = time.perf_counter() - s.pop("_start")
                s["phases"]["other"] = max(0.0, s["wall_s"] - sum(s["phases"].values()))
                s["unfinished"] = True
            out.append(s)
        return out

    def timed(self, phase, fn):

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            self.enter(phase)
            try:
                return fn(*args, **kwargs)
            finally:
                self.exit()

        wrapper.__warmup_phase__ = phase
        return wrapper


def resolve(module, path):
    """(owner, name, value) of `path` in `module`, a dotted path such as a class's method: setattr(owner, name, ...)
    replaces it for every caller that looks it up at call time. ImportError or AttributeError where it is missing."""
    owner = importlib.import_module(module)
    *parents, name = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, name, getattr(owner, name)


def install(clock, targets=TARGETS, deepspeed=True, profiler_targets=PROFILER_TARGETS):
    """Wrap every target importable here with the clock (profiler_targets: counted); return the targets that are not
    (module.attribute)."""
    missing = []
    wrappers = [(clock.timed, t) for t in targets] + [(clock.counted, t) for t in profiler_targets]
    for wrap, (phase, module, path) in wrappers:
        if module.startswith("deepspeed") and not deepspeed:
            continue
        try:
            owner, name, fn = resolve(module, path)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{path}")
            continue
        if getattr(fn, "__warmup_phase__", None) is None:
            setattr(owner, name, wrap(phase, fn))
    if clock.gc_callback not in gc.callbacks:
        gc.callbacks.append(clock.gc_callback)
    return missing


def cache_counters():
    """What Inductor's FX graph cache and AOTAutograd's cache answered in this process (hits, misses, bypasses): a
    restarted job is warm only where they hit."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {k: v for group in ("inductor", "aot_autograd") for k, v in counters[group].items()
            if k.startswith(("fxgraph_cache", "autograd_cache"))}


def totals(steps):
    """The phases' seconds over all steps, the wall time, the compile time of the steps after the first (a
    recompile: DeepCompile ZeRO-3 compiles every graph again at its WARMUP step), the garbage collections per
    generation (None for steps recorded before collections were counted) and the profiler counts ({} before they
    were), each [count, seconds]."""
    phases, collections, profiler = {}, ({} if any("gc" in s for s in steps) else None), {}
    for s in steps:
        for k, v in s["phases"].items():
            phases[k] = phases.get(k, 0.0) + v
        for summed, counts in ((collections, s.get("gc")), (profiler, s.get("profiler"))):
            for key, (n, t) in (counts or {}).items():
                count, seconds = summed.get(key, (0, 0.0))
                summed[key] = [count + n, seconds + t]
    later = sum(v for s in steps[1:] for k, v in s["phases"].items() if k != "other")
    return {"wall_s": sum(s["wall_s"] for s in steps), "phases": phases, "compile_after_first_step_s": later,
            "gc": collections, "profiler": profiler}
