"""Where a compiled run's time goes: seconds and calls of each compile phase, summed by wrappers around the entry
points of Dynamo, AOT autograd, Inductor and DeepCompile (benchmark diagnostics, not a test).

    phases = compile_phases.install()   # before the first compile
    ...
    report["phases"] = phases.snapshot()

Phases nest (the backend runs inside a Dynamo compile, Inductor inside AOT autograd, DeepCompile's passes inside
both): every figure is inclusive. An entry point this torch or deepspeed lacks is left out of the snapshot and
named under "missing".
"""

import functools
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tools"))
from warmup_phases import resolve  # noqa: E402

# phase name: (module, attribute path of the callable). Each is looked up by its callers at call time, so replacing
# the attribute reaches every call.
ENTRY_POINTS = {
    "dynamo compile": ("torch._dynamo.convert_frame", "_compile"),
    "backend (call_user_compiler)": ("torch._dynamo.output_graph", "OutputGraph.call_user_compiler"),
    "AOT autograd, compilers included": ("torch._dynamo.backends.common", "aot_module_simplified"),
    "Inductor (_compile_fx_inner)": ("torch._inductor.compile_fx", "_compile_fx_inner"),
    "DeepCompile run_opt_passes": ("deepspeed.compile.backend", "run_opt_passes"),
    "DeepCompile operator profile": ("deepspeed.compile.profilers.graph_profile", "ProfilingInterpreter.run"),
    "DeepCompile memory profile": ("deepspeed.compile.profilers.graph_profile", "MemoryProfilingInterpreter.run"),
    "gc.collect": ("gc", "collect"),
}


class Phases:

    def __init__(self):
        self.seconds = {}
        self.calls = {}
        self.missing = []
        self._depth = {}

    def _wrap(self, name, fn):

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            # A phase that re-enters itself (a Dynamo compile inside a compile) is counted once, at its outermost call.
            depth = self._depth.get(name, 0)
            self._depth[name] = depth + 1
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth[name] = depth
                if depth == 0:
                    self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
                    self.calls[name] = self.calls.get(name, 0) + 1

        return timed

    def snapshot(self):
        return {
            "seconds": {k: round(v, 2)
                        for k, v in self.seconds.items()},
            "calls": dict(self.calls),
            "missing": list(self.missing)
        }


def install(entry_points=ENTRY_POINTS):
    phases = Phases()
    for name, (module_name, path) in entry_points.items():
        try:
            owner, attr, original = resolve(module_name, path)
        except (ImportError, AttributeError):
            phases.missing.append(name)
            continue
        setattr(owner, attr, phases._wrap(name, original))
    return phases


class InductorGraphs:
    """How many graphs Inductor lowered since the previous `since_last()`. A graph Inductor's FX graph cache holds
    counts too; AOT autograd's cache would skip Inductor altogether on a hit (a graph another process compiled the
    same way), so it is turned off for this process."""

    PHASE = "Inductor (_compile_fx_inner)"

    def __init__(self):
        import torch._functorch.config

        torch._functorch.config.enable_autograd_cache = False
        self.phases = install({"calls": ENTRY_POINTS[self.PHASE]})
        self._counted = 0

    def since_last(self):
        now = self.phases.calls.get("calls", 0)
        new, self._counted = now - self._counted, now
        return new


class DynamoGraphs(InductorGraphs):
    """How many graphs Dynamo traced and handed to its backend since the previous `since_last()`."""

    PHASE = "backend (call_user_compiler)"


class DeepCompileOpsLowered:
    """DeepCompile's ops (`dc::...` nodes) in the graphs handed to Inductor that call nested compile regions, summed
    in `count` (with compile_blocks_once those ops run as traced, outside Inductor)."""

    def __init__(self):
        import torch

        owner, attr, original = resolve(*ENTRY_POINTS[InductorGraphs.PHASE])
        self.count = 0

        @functools.wraps(original)
        def counting(gm, *args, **kwargs):
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            if torch.ops.higher_order.invoke_subgraph in targets:
                self.count += sum(getattr(t, "namespace", None) == "dc" for t in targets)
            return original(gm, *args, **kwargs)

        setattr(owner, attr, counting)
