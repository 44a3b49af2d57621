"""DeepCompile ZeRO-3's fused prefetch must survive Inductor's dead code elimination.

deepcompile-keep-inductor-dead-code-elimination turned Inductor's elimination back on and registered DeepCompile's
ops as having side effects, all but `prefetch_params_fused`. That op returns nothing, so every graph leaves it
"unused", and Inductor dropped it from every compiled graph: from fork.3 to fork.32 DeepCompile ZeRO-3 prefetched no
parameter, and each one was gathered where `allgather_param` stood (0.19.8 kept it by turning elimination off).

The ops are defined here from the schemas of the installed wheel's csrc/compile/init.cpp, with Python kernels in
place of the compiled extension (built on GPU hosts). Each check runs in a process of its own: importing deepspeed
fixes its accelerator for the whole session."""

import importlib.util
import socket
import subprocess
import textwrap

import pytest

from cpu_worker import cpu_env
from warm_python import python_command

DEFINE_OPS = """
    import os, re, torch
    import deepspeed
    init_cpp = os.path.join(os.path.dirname(deepspeed.__file__), "ops", "csrc", "compile", "init.cpp")
    library = open(init_cpp).read().split("TORCH_LIBRARY(dc, m)")[1].split("TORCH_LIBRARY_IMPL")[0]
    # m.def("..." "..."): a schema may be split over adjacent string literals.
    schemas = ["".join(re.findall(r'"([^"]*)"', d)) for d in re.findall(r'm\\.def\\((.*?)\\);', library, re.S)]
    schemas = [" ".join(s.split()) for s in schemas]
    names = [s.split("(")[0] for s in schemas]
    assert "prefetch_params_fused" in names and "release_param" in names, names
    lib = torch.library.Library("dc", "DEF")
    for s in schemas:
        lib.define(s)
"""

# After DEFINE_OPS: a process of one gloo rank. Formatted with the rank's port (free_port()).
ONE_GLOO_RANK = """
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    deepspeed.init_distributed(dist_backend="gloo")
"""

# After DEFINE_OPS: DeepCompile's backend module in a process of one gloo rank, its native handle stood in for, the
# schedule's one entry launched. Formatted with the rank's port (free_port()).
ONE_RANK_BACKEND = ONE_GLOO_RANK + """
    import deepspeed.compile.backend as backend
    from deepspeed.compile.config import CompileConfig

    class Handle:
        def reset(self):
            pass

    backend.get_deepcompile_handle = lambda: Handle()
    backend.init_schedule([(0, [])])
    backend.launch_compile_passes(0)
"""


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(code):
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    script = textwrap.dedent(DEFINE_OPS) + textwrap.dedent(code)
    proc = subprocess.run([*python_command(), "-c", script], capture_output=True, text=True, timeout=600,
                          env=cpu_env())
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_op_of_deepcompiles_library_is_kept_through_dead_code_elimination():
    """What Inductor's elimination asks of a fallback kernel, for every op the extension defines (`test_call`, a
    smoke test of the extension, is no pass's)."""
    run("""
        from torch._inductor.ir import FallbackKernel
        from deepspeed.compile.inductor import keep_deepcompile_ops_through_dead_code_elimination
        keep_deepcompile_ops_through_dead_code_elimination()

        class Kernel:
            def __init__(self, op):
                self.op_overload = op

        dropped = [n for n in names if n != "test_call"
                   and not FallbackKernel.has_side_effects(Kernel(getattr(torch.ops.dc, n).default))]
        assert not dropped, f"Inductor would eliminate these DeepCompile ops from a graph that leaves them unused: {dropped}"
    """)


def test_the_fused_prefetch_runs_in_inductor_compiled_code():
    """A graph as DeepCompile's prefetch pass leaves it (the fused prefetch of a parameter, then the computation),
    compiled by Inductor as DeepCompile's compiler wrapper hands it over: the prefetch must run, once, for its ids."""
    run("""
        from torch.fx import Graph, GraphModule
        from torch._inductor.compile_fx import compile_fx_inner
        from deepspeed.compile.inductor import keep_deepcompile_ops_through_dead_code_elimination
        keep_deepcompile_ops_through_dead_code_elimination()

        prefetched = []
        lib.impl("prefetch_params_fused", lambda graph_id, params, ids, dtypes=None: prefetched.append(list(ids)),
                 "CPU")
        lib.impl("prefetch_params_fused", lambda graph_id, params, ids, dtypes=None: None, "Meta")

        g = Graph()
        x = g.placeholder("x")
        g.call_function(torch.ops.dc.prefetch_params_fused.default, args=(0, [x], [7]))
        g.output((g.call_function(torch.ops.aten.mul.Tensor, args=(x, 2)),))
        compiled = compile_fx_inner(GraphModule(torch.nn.Module(), g), [torch.ones(4)])
        out = compiled([torch.ones(4)])
        assert torch.equal(out[0], torch.full((4,), 2.0)), out
        assert prefetched == [[7]], f"the compiled graph ran the fused prefetch {len(prefetched)} times: {prefetched}"
    """)
