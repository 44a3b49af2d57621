"""tools/warmup_phases.py: the warm-up of a benchmark row split into Dynamo, AOTAutograd, Inductor, DeepCompile's
profiling and passes. A DeepCompile ZeRO-3 warm-up of a 1.4B model at 4 GPUs was still compiling after 230 s and
nothing said where that time went; the split is what decides the fix."""

import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "tools"))
import warmup_phases  # noqa: E402


class FakeTime:
    """perf_counter advanced by hand: each phase's seconds are known exactly."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture
def clock(monkeypatch):
    fake = FakeTime()
    monkeypatch.setattr(warmup_phases.time, "perf_counter", fake)
    return warmup_phases.PhaseClock(), fake


def test_a_phase_called_inside_another_counts_for_itself_alone(clock):
    clock, t = clock

    def inner():
        t.now += 3.0

    inner = clock.timed("inductor", inner)

    def outer():
        t.now += 1.0
        inner()
        t.now += 2.0

    outer = clock.timed("dynamo", outer)
    clock.begin(0)
    t.now += 0.5
    outer()
    outer()
    t.now += 4.0
    clock.end()
    (step, ) = clock.steps
    assert step["phases"] == {"dynamo": 6.0, "inductor": 6.0, "other": 4.5}
    assert step["calls"] == {"dynamo": 2, "inductor": 2}
    assert step["wall_s"] == sum(step["phases"].values()) == 16.5


def test_garbage_collections_are_counted_per_generation_within_the_phases(clock):
    clock, t = clock
    clock.begin(0)
    for generation, seconds in ((0, 0.25), (2, 1.5), (2, 0.5)):
        clock.gc_callback("start", {"generation": generation})
        t.now += seconds
        clock.gc_callback("stop", {"generation": generation, "collected": 0, "uncollectable": 0})
    t.now += 1.0
    clock.end()
    (step, ) = clock.steps
    assert step["gc"] == {"0": [1, 0.25], "2": [2, 2.0]}
    assert step["phases"] == {"other": 3.25}, "a collection is part of the phase it ran in, not a phase of its own"
    assert warmup_phases.totals(clock.steps)["gc"] == {"0": [1, 0.25], "2": [2, 2.0]}
    assert warmup_phases.totals([{"step": 0, "wall_s": 1.0, "phases": {"other": 1.0}}])["gc"] is None


def test_install_counts_a_real_full_collection():
    import gc
    clock = warmup_phases.PhaseClock()
    warmup_phases.install(clock, targets=())
    try:
        clock.begin(0)
        gc.collect()
        clock.end()
    finally:
        gc.callbacks.remove(clock.gc_callback)
    (step, ) = clock.steps
    assert step["gc"]["2"][0] == 1 and step["gc"]["2"][1] > 0, step


def test_compile_after_the_first_step_is_the_recompile(clock):
    clock, t = clock
    compile_ = clock.timed("inductor", lambda s: setattr(t, "now", t.now + s))
    for k, seconds in enumerate((10.0, 0.0, 7.0)):
        clock.begin(k)
        compile_(seconds)
        t.now += 1.0
        clock.end()
    total = warmup_phases.totals(clock.steps)
    assert total["phases"] == {"inductor": 17.0, "other": 3.0}
    assert total["wall_s"] == 20.0 and total["compile_after_first_step_s"] == 7.0


def test_a_warm_up_cut_short_keeps_what_it_measured(clock, monkeypatch):
    """A process past its deadline is ended by faulthandler: what it measured until then is handed out as it goes."""
    _, t = clock
    seen = []
    monotonic = iter(range(0, 10**6, 10))
    monkeypatch.setattr(warmup_phases.time, "monotonic", lambda: next(monotonic))
    clock = warmup_phases.PhaseClock(on_update=seen.append, update_every_s=5.0)
    profile = clock.timed("dc_profiling", lambda: setattr(t, "now", t.now + 30.0))
    clock.begin(0)
    profile()
    assert seen, "no update while the step was under way"
    (step, ) = seen[-1]
    assert step["unfinished"] and step["phases"]["dc_profiling"] == 30.0 and step["wall_s"] == 30.0


def test_profiler_nodes_and_votes_are_counted_apart_from_the_phases(clock):
    """What DeepCompile's profiling is made of: the nodes timed by op, those run once, the votes."""
    clock, t = clock

    class Node:
        def __init__(self, target):
            self.target = target

    def profile_node(self, n, args, kwargs, cache_key, cache_hit):
        t.now += 0.5 if cache_hit else 3.0

    profile_node = clock.counted("node", profile_node)
    vote = clock.counted("vote", lambda *args, **kwargs: setattr(t, "now", t.now + 0.25))
    mm, region = Node("aten.mm.default"), Node("invoke_subgraph")
    profile = clock.timed("dc_profiling", lambda: [vote(), profile_node(None, mm, (), {}, "k", False), vote(),
                                                   profile_node(None, mm, (), {}, "k", True),
                                                   profile_node(None, region, (), {}, "j", False)])
    clock.begin(0)
    profile()
    clock.end()
    clock.begin(1)
    vote()
    clock.end()
    assert clock.steps[0]["profiler"] == {"vote": [2, 0.5], "timed aten.mm.default": [1, 3.0], "reused": [1, 0.5],
                                          "timed invoke_subgraph": [1, 3.0]}
    assert clock.steps[0]["phases"] == {"dc_profiling": 7.0, "other": 0.0}  # counted, not phases of their own
    assert warmup_phases.totals(clock.steps)["profiler"]["vote"] == [3, 0.75]
    assert warmup_phases.totals([{"step": 0, "wall_s": 1.0, "phases": {}}])["profiler"] == {}  # records before them


def test_every_phase_a_target_counts_for_has_a_column():
    assert {phase for phase, _, _ in warmup_phases.TARGETS} | {"other"} == set(warmup_phases.NAMES)


def test_every_target_exists_in_this_torch_and_deepspeed():
    """A target renamed by a torch release would silently count for `other`: the installed torch has all of them."""
    pytest.importorskip("deepspeed")
    clock = warmup_phases.PhaseClock()
    wrapped = []
    for phase, module, path in warmup_phases.TARGETS + warmup_phases.PROFILER_TARGETS:
        wrapped.append(warmup_phases.resolve(module, path))
    try:
        assert warmup_phases.install(clock) == []
        assert all(getattr(getattr(o, n), "__warmup_phase__", None) for o, n, _ in wrapped)
    finally:
        for owner, name, fn in wrapped:
            setattr(owner, name, fn)


def test_a_compile_splits_into_dynamo_and_aot():
    torch = pytest.importorskip("torch")
    from torch._dynamo.backends.common import AotAutograd
    from torch._dynamo import convert_frame
    saved = (convert_frame._compile, AotAutograd.__call__)
    clock = warmup_phases.PhaseClock()
    warmup_phases.install(clock, deepspeed=False)
    try:
        torch._dynamo.reset()
        fn = torch.compile(lambda x: (x.sin() * 2).sum(), backend="aot_eager")
        x = torch.randn(8, requires_grad=True)
        clock.begin(0)
        fn(x).backward()
        clock.end()
    finally:
        convert_frame._compile, AotAutograd.__call__ = saved
        torch._dynamo.reset()
    (step, ) = clock.steps
    assert step["calls"]["dynamo"] == 1 and step["calls"]["aot"] == 1, step
    assert step["phases"]["dynamo"] > 0 and step["phases"]["aot"] > 0
    assert abs(sum(step["phases"].values()) - step["wall_s"]) < 1e-6


def _rendered(tmp_path, rows, gpus):
    """tools/bench's tables of a run of these rows."""
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from test_bench_tool import _cli
    cli = _cli()
    data = {"device": "d", "gpus": [gpus], "torch": "t", "transformers": "tf", "peak_tflops": 100.0, "repeats": 1,
            "steps": 1, "warmup": 1, "rows": [cli.summarize(r, 100.0) for r in rows]}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    cli.render(str(tmp_path))
    return (tmp_path / "bench.md").read_text()


def test_the_table_splits_each_warm_up_and_marks_one_cut_short(tmp_path):
    steps = [{"step": 0, "wall_s": 100.0, "phases": {"dynamo": 20.0, "aot": 30.0, "inductor": 40.0, "other": 10.0}},
             {"step": 1, "wall_s": 50.0, "phases": {"dc_profiling": 40.0, "dc_memory_profiling": 5.0, "other": 5.0}}]
    rows = [{"set": "warmup-8b", "subject": "dc-z3", "site": "fork", "deepspeed": "x", "layers": 32,
             "warmup_phases": steps, "error": "no ready within 535 s"},
            {"set": "warmup-8b", "subject": "fsdp2", "site": "-", "layers": 32, "blocks": [{"step_s": [1.0]}],
             "flops_per_step": 1e12, "tokens_per_step": 10, "first_step_s": 20.0, "warmup_phases": steps[:1],
             "compile_cache_counters": {"fxgraph_cache_hit": 0, "fxgraph_cache_miss": 16,
                                        "autograd_cache_bypass": 8}}]
    table = _rendered(tmp_path, rows, gpus=4)
    assert ("| warmup-8b | dc-z3 | x | 32 | 150.0 (cut short) | 100.0 | 20.0 | 30.0 | 40.0 | 40.0 | 5.0 | 0.0 | 0.0 | "
            "15.0 | 45.0 | - | - |") in table
    assert ("| warmup-8b | fsdp2 | - | 32 | 100.0 | 100.0 | 20.0 | 30.0 | 40.0 | 0.0 | 0.0 | 0.0 | 0.0 | 10.0 | 0.0 | "
            "FX 16 miss, AOT 8 bypass | - |") in table


def test_the_profiler_table_says_what_the_profiling_timed_and_how_often_it_voted(tmp_path):
    steps = [{"step": 0, "wall_s": 10.0, "phases": {"other": 10.0}},
             {"step": 1, "wall_s": 9.0, "phases": {"dc_profiling": 8.0, "other": 1.0},
              "profiler": {"timed invoke_subgraph": [2, 0.8], "timed aten.mm.default": [4, 0.25],
                           "timed aten.view.default": [12, 0.01], "timed getitem": [28, 0.03],
                           "reused": [1482, 0.74], "vote": [4154, 1.21]}}]
    rows = [{"set": "blocks-8b-16l", "subject": "dc-z3-blocks", "site": "fork", "deepspeed": "x", "layers": 16,
             "warmup_phases": steps, "blocks": [{"step_s": [1.0]}], "flops_per_step": 1e12, "tokens_per_step": 10,
             "first_step_s": 10.0},
             {"set": "blocks-8b-16l", "subject": "fsdp2", "site": "-", "layers": 16, "warmup_phases": steps[:1],
              "blocks": [{"step_s": [1.0]}], "flops_per_step": 1e12, "tokens_per_step": 10, "first_step_s": 10.0}]
    table = _rendered(tmp_path, rows, gpus=1)
    assert ("| blocks-8b-16l | dc-z3-blocks | x | 46 in 1.09 s | invoke_subgraph 2 in 0.80 s, aten.mm.default 4 in "
            "0.25 s, getitem 28 in 0.03 s | 1482 in 0.74 s | 4154 in 1.21 s |") in table
    assert "| blocks-8b-16l | fsdp2 |" not in table.split("Where DeepCompile's profiling went")[1]
