"""DeepCompile ran a full garbage collection where no profiler had run (patch
deepcompile-collect-garbage-only-after-a-profiling-run).

release_profiling_memory collects when device memory grew since its last call, to free what a profiling run left
in reference cycles. It is called at the start of every graph's passes and after each pass, also where nothing was
profiled: at the first compile (which takes no profile), and at the start of the WARMUP compile, after the training
steps allocated activations and the optimizer's states. There the memory grew, and a collection (0.4-0.6 s on the
8B model's heap) freed nothing of the profiler's. Now the profilers report each run of a graph, and only memory
grown since such a run is collected.

The accelerator's memory counter is scripted (tests/test_deepcompile_profiling_memory_release.py's fixture); the
profilers run on the CPU in a process of their own.
"""

import cpu_worker
from test_deepcompile_profiler_times_each_gather_shape_once import PROFILERS_ON_CPU
from test_deepcompile_profiling_memory_release import MiB, run_passes, scripted  # noqa: F401 (a fixture)


def test_no_collection_where_no_profiler_ran(scripted):  # noqa: F811
    backend, acc, collections = scripted
    acc.allocated = 100 * MiB
    run_passes(backend, acc, [])
    collections.clear()
    # The graph's passes, then the training's own memory (activations, optimizer states), then the next graph's.
    run_passes(backend, acc, [100], profile=False)
    acc.allocated = 164 * MiB
    run_passes(backend, acc, [164, 200], profile=False)
    assert collections == [], [c // MiB for c in collections]


def test_memory_a_profiler_left_is_collected(scripted):  # noqa: F811
    backend, acc, collections = scripted
    acc.allocated = 100 * MiB
    run_passes(backend, acc, [])
    collections.clear()
    run_passes(backend, acc, [100, 164], profile=False)
    run_passes(backend, acc, [180], profile=True)
    assert [c // MiB for c in collections] == [180]


PROFILERS_REPORT = """
    import deepspeed.compile.util as util

    gm = torch.fx.symbolic_trace(lambda x: (torch.relu(x) * 2, ))
    reported = {}
    for name in ("ProfilingInterpreter", "MemoryProfilingInterpreter"):
        util.release_profiling_memory()
        x = torch.randn(4, 8)
        with FakeTensorMode():
            getattr(graph_profile, name)(gm).run(x)
        reported[name] = util._profiled_since_release
    print("REPORTED " + json.dumps(reported))
"""


def test_the_profilers_report_their_runs():
    reported = cpu_worker.code_report(PROFILERS_ON_CPU + PROFILERS_REPORT, "REPORTED ")
    assert reported == {"ProfilingInterpreter": True, "MemoryProfilingInterpreter": True}, reported
