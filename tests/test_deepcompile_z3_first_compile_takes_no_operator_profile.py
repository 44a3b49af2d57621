"""DeepCompile ZeRO-3 compiles every graph twice: at step 0, and at WARMUP with prefetching and selective gathering,
each compile planning from an operator profile of its own (every node of the graph run on the device, the nodes of
new ops and shapes fifteen times each, with collectives at several ranks). Nothing reads step 0's profile but that
graph's scheduler, which runs the graph only until WARMUP, as AOTAutograd traced it; there its timings break ties
between gathers of the same size, and the memory it measured makes a budget that does not constrain the order on a
device with room for the model. It took 10 s of the 69.5 s warm-up of Llama 1.5B with compile_blocks_once on 2x H200
and 18 s of the 121 s of Llama-3-8B (docs/warmup.md).

Here DeepCompile's ZeRO-3 pass (add_z3_gather_release) runs on the forward and backward graphs AOTAutograd made of a
chain of linear layers, under the default schedule's two entries, with a counting profiler in place of the real one,
at one gloo rank on the CPU. DeepCompile's ops are defined from the wheel's schemas (no compiled extension)."""

import cpu_worker
from test_deepcompile_graph_ids_survive_a_restart import free_port
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS

FIRST_AND_LAST_COMPILE = """
    import copy
    import json
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
    deepspeed.init_distributed(dist_backend="gloo")
    deepspeed.accelerator.get_accelerator().current_device = lambda: "cpu"
    import deepspeed.compile.backend as backend
    import deepspeed.compile.util as dc_util
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.list_schedule import DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR
    from deepspeed.compile.passes import zero3_compile
    from deepspeed.compile.profilers import ProfilingResult
    from deepspeed.compile.util import is_release_node

    class NoOpHandle:
        def __getattr__(self, name):
            return lambda *args, **kwargs: None

    backend.get_deepcompile_handle = zero3_compile.get_deepcompile_handle = lambda: NoOpHandle()
    dc_util.get_deepcompile_handle = lambda: None  # asked only for its list of aliasing ops

    profiled = []

    class CountingProfiler:
        def __init__(self, gm, debug_log=False, process_group=None):
            profiled.append(gm)
            self.gm = gm

        def run(self, *args):
            for n in self.gm.graph.nodes:  # what the profiler leaves on every node
                n.meta.update(device_time=0.1, wall_time=0.1, tensor_size=0, alloc_mem=0, max_mem=0)
            return None

    zero3_compile.ProfilingInterpreter = CountingProfiler

    widths = (16, 48, 32, 8)
    model = torch.nn.Sequential(*[torch.nn.Linear(a, b) for a, b in zip(widths, widths[1:])])
    got = {{}}

    def capture(gm, inputs):
        def keep(kind):
            def compiler(g, _):
                got[kind] = g
                return make_boxed_func(g.forward)
            return compiler
        got["inputs"] = inputs
        return aot_module_simplified(gm, inputs, fw_compiler=keep("fw"), bw_compiler=keep("bw"),
                                     partition_fn=min_cut_rematerialization_partition)

    torch.compile(model, backend=capture)(torch.randn(4, 16)).sum().backward()
    inputs = got["inputs"]
    params = [(i, 100 + i, v.shape) for i, v in enumerate(inputs) if isinstance(v, torch.nn.Parameter)]

    def compile_once():
        # One compile of the model's graphs under the entry launched last: the forward, then the backward.
        fw, bw = copy.deepcopy(got["fw"]), copy.deepcopy(got["bw"])
        managers = {{1: DSGraphParamManager(fw.graph, inputs, params)}}
        results = {{1: ProfilingResult()}}
        results[1].param_indices = params
        profiled.clear()
        bw_inputs = len(bw.graph.find_nodes(op="placeholder"))
        fw = zero3_compile.add_z3_gather_release(fw, 1, [(1, True)], results, lambda: tuple(inputs), 0.0, managers,
                                                 False)
        bw = zero3_compile.add_z3_gather_release(bw, 1, [(1, True)], results, lambda: tuple(range(bw_inputs)), 0.0,
                                                 managers, True)
        out = dict(profiles=len(profiled))
        for kind, gm in (("fw", fw), ("bw", bw)):
            budget = getattr(gm.graph, DS_SCHEDULER_BUDGET_DIAGNOSTICS_ATTR, {{}}).get("budget")
            gathers = [n for n in gm.graph.nodes if n.target == torch.ops.dc.allgather_param.default]
            out[kind] = dict(gathers=len(gathers), releases=sum(is_release_node(n) for n in gm.graph.nodes),
                             budget=budget.max_gathered_bytes if budget is not None else None,
                             largest_gather=max(n.meta["allgather_allocation_bytes"] for n in gathers))
        return out

    backend.init_schedule([(0, [zero3_compile.add_z3_gather_release]), (5, [zero3_compile.add_z3_gather_release])])
    report = {{}}
    for step in (0, 5):
        backend.launch_compile_passes(step)
        report[step] = compile_once()
    print("COMPILES " + json.dumps(report))
"""


def compiles():
    return cpu_worker.code_report(DEFINE_OPS + FIRST_AND_LAST_COMPILE.format(port=free_port()), "COMPILES ",
                                  timeout=600)


def test_a_graph_compiled_again_later_is_scheduled_without_an_operator_profile():
    report = compiles()
    first, last = report["0"], report["5"]
    # The entry that compiles the graphs for good profiles them, forward and backward; the one before it does not.
    assert last["profiles"] == 2, f"the last compile took {last['profiles']} operator profiles, not 2"
    assert first["profiles"] == 0, (f"step 0's compile took {first['profiles']} operator profiles of graphs the "
                                    "WARMUP entry compiles and profiles again")
    # Scheduled all the same (the scheduler reads every node's device_time: it would have failed without one), with
    # gathers and releases of every parameter each graph reads (the backward reads the weights of the second and
    # third layers: the input needs no gradient), at most one gather's worth of parameters resident at a time, the
    # largest (the second layer's 48 x 32 fp32 weight).
    for kind, gathered in (("fw", 6), ("bw", 2)):
        graph = first[kind]
        assert graph["gathers"] == gathered and graph["releases"] >= gathered, (kind, graph)
        assert graph["budget"] == graph["largest_gather"] == 48 * 32 * 4, (kind, graph)
