"""DeepCompile ZeRO-3 profiles a graph's memory again after each pass, node by node with collectives and device
synchronizations, for the passes that plan from those profiles (prefetch and selective_gather). 0.19.8 also did so
where nothing reads them: after the first compile's only pass (its profiles are cleared at the WARMUP recompile
before anything reads them) and after selective_gather, which leaves the graph as it was. Of the 8 memory profiles
of a warm-up's forward and backward graph, 4 were read by no one. The warm-up's profiling took 56 s at 32 layers of
the 1.5B width on one H200 (docs/warmup.md).

Here DeepCompile's run_opt_passes runs the default ZeRO-3 schedule's passes (stand-ins carrying the real passes'
attributes, which say what each reads and changes), with a counting memory profiler in place of the real one, at
one rank on gloo."""

from test_deepcompile_graph_ids_survive_a_restart import free_port
from test_deepcompile_prefetch_survives_dead_code_elimination import ONE_GLOO_RANK, run


def test_memory_is_profiled_only_where_a_later_pass_reads_it():
    run(ONE_GLOO_RANK.format(port=free_port()) + """
    import deepspeed.compile.backend as backend
    from deepspeed.compile.passes import prefetch, selective_gather, zero3_compile
    from deepspeed.compile.profilers import ProfilingResult

    runs = []

    class CountingMemoryProfiler:
        def __init__(self, gm, debug_log=False, process_group=None):
            runs.append(gm)
            self.mem_record, self.profile_complete = [], True

        def run(self, *args):
            return None

    backend.MemoryProfilingInterpreter = CountingMemoryProfiler
    # The ranks' vote on a profile's completeness, a collective on the accelerator: one rank here.
    backend._sync_memory_profile_complete = lambda complete, process_group=None: complete

    def stand_in(real):
        def rewrite(gm, *args):
            return gm
        rewrite.__dict__.update(real.__dict__)
        return rewrite

    gm = torch.fx.symbolic_trace(torch.nn.Linear(2, 2))
    # init_z3's default schedule: step 0, then WARMUP.
    schedule = {"step 0": [zero3_compile.add_z3_gather_release],
                 "WARMUP": [zero3_compile.add_z3_gather_release, prefetch.schedule_prefetch,
                            selective_gather.selective_gather]}
    counts = {}
    for cycle, passes in schedule.items():
        runs.clear()
        for bwd in (False, True):
            backend.run_opt_passes([stand_in(p) for p in passes], gm, 1, [(1, True)], {1: ProfilingResult()},
                                   lambda: (torch.randn(2, 2), ), 0.0, {}, bwd)
        counts[cycle] = len(runs)
    # step 0: nothing reads a memory profile; WARMUP: after add_z3_gather_release (for prefetch) and after
    # prefetch (for selective_gather), of the forward and the backward graph.
    assert counts == {"step 0": 0, "WARMUP": 4}, f"memory profiles taken: {counts}"
    """)
