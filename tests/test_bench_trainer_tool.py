"""tools/bench-trainer and its phase accounting (tests/gpu/workers/compile_phases.py), on CPU."""

import os
import subprocess
import sys
import textwrap

import tool_module
from cpu_worker import cpu_env
from warm_python import python_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "bench-trainer")


def _tool():
    return tool_module.load("bench-trainer")


def test_phase_accounting_counts_each_compile_phase_once_per_outermost_call():
    # A process of its own: the wrappers replace torch's entry points for the rest of the process.
    code = textwrap.dedent("""
        import json, sys, torch
        sys.path.insert(0, sys.argv[1])
        import compile_phases
        points = dict(compile_phases.ENTRY_POINTS, absent=("torch", "no_such_entry_point"))
        points.pop("DeepCompile run_opt_passes"); points.pop("DeepCompile operator profile")
        points.pop("DeepCompile memory profile")
        phases = compile_phases.install(points)
        f = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager", dynamic=False)
        x = torch.randn(8, requires_grad=True)
        f(x).backward()
        f(x).backward()                      # cached: no second compile
        f(torch.randn(3, requires_grad=True)).backward()   # a new shape: a second compile
        print(json.dumps(phases.snapshot()))
    """)
    out = subprocess.run([*python_command(), "-c", code, os.path.join(REPO, "tests", "gpu", "workers")],
                         capture_output=True, text=True, timeout=300, env=cpu_env())
    assert out.returncode == 0, out.stderr[-3000:]
    import json
    snap = json.loads(out.stdout.strip().splitlines()[-1])
    assert snap["missing"] == ["absent"]
    assert snap["calls"]["dynamo compile"] == 2
    assert snap["calls"]["backend (call_user_compiler)"] == 2
    assert snap["calls"]["AOT autograd, compilers included"] == 2
    assert "Inductor (_compile_fx_inner)" not in snap["calls"]  # aot_eager never reaches Inductor
    assert snap["seconds"]["dynamo compile"] >= snap["seconds"]["backend (call_user_compiler)"] > 0


def test_inductor_graphs_counts_the_graphs_lowered_since_the_last_look(tmp_path):
    """Also when AOT autograd's cache already holds the graphs (a second run of the same code): a hit there skips
    Inductor, and would have counted nothing."""
    code = textwrap.dedent("""
        import sys, torch
        sys.path.insert(0, sys.argv[1])
        import compile_phases
        lowered = compile_phases.InductorGraphs()
        f = torch.compile(lambda x: (x * 2).sin(), dynamic=False)
        counts = []
        for shape in [(3, ), (3, ), (5, 2)]:      # a compile, the cached graph, a new shape's compile
            f(torch.ones(shape))
            counts.append(lowered.since_last())
        print(counts)
    """)
    env = cpu_env(TORCHINDUCTOR_CACHE_DIR=str(tmp_path))
    for run in ("cold caches", "warm caches"):
        out = subprocess.run([*python_command(), "-c", code, os.path.join(REPO, "tests", "gpu", "workers")],
                             capture_output=True, text=True, timeout=300, env=env)
        assert out.returncode == 0, out.stderr[-3000:]
        assert out.stdout.strip().splitlines()[-1] == "[1, 0, 1]", run


def _run(stage, site, mode, train_s, phases=None):
    return {"stage": stage, "site": site, "mode": mode, "train_s": train_s, "phases": phases,
            "versions": {"deepspeed_version": f"v-{site}"}}


def test_ratio_takes_the_compile_median_of_the_stage_when_a_site_ran_no_compile():
    tool = _tool()
    runs = [_run(3, "a", "compile", 80.0), _run(3, "a", "compile", 90.0), _run(3, "a", "deepcompile", 120.0),
            _run(3, "b", "deepcompile", 170.0)]
    md = tool.table(runs, [3], ["a", "b"], ["compile", "deepcompile"]).splitlines()
    assert md[2].startswith("| ZeRO-3 | v-a | 85.0 (80.0-90.0, 2) | 120.0 (120.0-120.0, 1) | 1.41x |"), md[2]
    assert md[3].startswith("| ZeRO-3 | v-b | no run | 170.0 (170.0-170.0, 1) | 2.00x |"), md[3]


def test_phase_table_gives_median_seconds_and_calls_per_cell():
    tool = _tool()
    p = lambda s, c: {"seconds": {"dynamo compile": s}, "calls": {"dynamo compile": c}, "missing": []}  # noqa: E731
    runs = [_run(3, "a", "deepcompile", 100.0, p(40.0, 6)), _run(3, "a", "deepcompile", 110.0, p(50.0, 6)),
            _run(3, "a", "deepcompile", 120.0, p(60.0, 8)), _run(3, "a", "compile", 80.0)]
    md = tool.phase_table(runs, [3], [("a", "compile"), ("a", "deepcompile")]).splitlines()
    assert md[0] == "| phase (inclusive) | ZeRO-3 a deepcompile |"   # the compile run recorded no phases
    assert md[2] == "| trainer.train() | 110.0 |"
    assert md[3] == "| dynamo compile | 50.0 (6) |"


def test_cells_outside_sites_and_modes_are_refused_before_any_run(tmp_path):
    out = subprocess.run([sys.executable, TOOL, "--cells", "importable:compile,elsewhere:deepcompile", "--out",
                          str(tmp_path / "o")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "elsewhere:deepcompile" in out.stderr and "importable:compile" in out.stderr.split("known:")[1]
    assert not (tmp_path / "o").exists()
