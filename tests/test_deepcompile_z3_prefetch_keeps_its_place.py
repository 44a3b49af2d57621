"""DeepCompile ZeRO-3's prefetches must run where its prefetch pass put them, not at the end of the forward.

`prefetch_params_fused` returns nothing, so nothing in a graph depends on it and Inductor's scheduler may run it
anywhere. After fusion it sorts the kernels topologically; a causal LM's loss fuses the count of its labels (an
early node) with the division at the end, and that kernel, in the early node's place, pulls the whole forward
ahead of every node nothing depends on. So each prefetch the pass placed after that point ran after the forward,
once each parameter had been gathered where it is used. At the 8B model on 4xH200 (seq 4096) all 237 all-gathers of
the forward ran exposed: 45.1 ms of 45.1 (docs/bench.md).

Here the forward graph of a 4-layer Llama (transformers, labels given: the Trainer's loss in the graph), with
DeepCompile's gathers and releases in its schedule and its prefetch pass planned from a synthetic profile, is
compiled by Inductor on the CPU with DeepCompile's ops defined from the wheel's schemas and Python kernels that log
each call: the ops must run in the graph's order."""

import socket

from test_deepcompile_prefetch_survives_dead_code_elimination import run

PREFETCH_ORDER = """
    import transformers
    import deepspeed.comm as dist
    import deepspeed.compile.util as dc_util
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._inductor.decomposition import select_decomp_table

    dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{PORT}",
                          rank=0, world_size=1)
    dc_util.get_deepcompile_handle = lambda: None
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.inductor import register_custom_ops
    from deepspeed.compile.list_schedule import fast_free_schedule
    from deepspeed.compile.passes import prefetch
    from deepspeed.compile.passes.zero3_compile import add_gather_and_release
    from deepspeed.compile.profilers import ProfilingResult
    from deepspeed.compile.util import get_param_nodes

    calls = []
    log = lambda *entry: calls.append(entry)
    lib.impl("allgather_param", lambda a, g, i, dtype=None: (log("gather", i), a.clone())[1], "CPU")
    lib.impl("allgather_param", lambda a, g, i, dtype=None: torch.empty_like(a), "Meta")
    lib.impl("wait_allgather", lambda a, g, i: (log("wait", i), a)[1], "CPU")
    lib.impl("wait_allgather", lambda a, g, i: a, "Meta")
    lib.impl("release_param", lambda a, g, i, n: (log("release", i), a)[1], "CPU")
    lib.impl("release_param", lambda a, g, i, n: a, "Meta")
    lib.impl("prefetch_params_fused", lambda g, ps, ids, dtypes=None: log("prefetch", tuple(ids)), "CPU")
    lib.impl("prefetch_params_fused", lambda g, ps, ids, dtypes=None: None, "Meta")
    register_custom_ops()

    class Device:  # an H200's memory, for the pass's budget
        def total_memory(self):
            return 150 * 10**9
        def available_memory(self):
            return 120 * 10**9
        def memory_allocated(self):
            return 0
        def max_memory_allocated(self):
            return 0
        def current_device(self):
            return "cpu"

    prefetch.get_accelerator = Device
    prefetch.create_predictor = lambda: (lambda size: 0 if size == 0 else 1e-4 + size / 3.5e11)

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=224, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=1, vocab_size=2004)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    graphs = []  # (forward graph, its inputs) of each graph Dynamo captured

    def backend(gm, inputs):
        got = {"inputs": inputs}
        graphs.append(got)

        def keep(g, _):
            got.setdefault("fw", g)
            return make_boxed_func(g.forward)
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep,
                                     decompositions=select_decomp_table(),
                                     partition_fn=min_cut_rematerialization_partition)

    ids = torch.randint(0, 2004, (1, 32))
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    # Where Dynamo breaks the graph (older torch with newer transformers), the graph holding the most parameters
    got = max(graphs, key=lambda g: sum(isinstance(v, torch.nn.Parameter) for v in g["inputs"]))
    params = [(i, 100 + i, v.shape) for i, v in enumerate(got["inputs"]) if isinstance(v, torch.nn.Parameter)]
    gm = got["fw"]
    manager = DSGraphParamManager(gm.graph, got["inputs"], params)
    graph = add_gather_and_release(0, gm.graph, manager, get_param_nodes(gm.graph, params))

    # A profile at the 8B model's sizes (parameters 4096x as large as at width 64); the prefetch pass keeps at most
    # a quarter of them in flight, so its prefetches fall all through the graph, as at 32 layers with its 4 GB.
    def gathered_bytes(n):  # the size of the parameter an all-gather gathers
        return n.args[0].meta["val"].numel() * 2 * 4096 if n.target == torch.ops.dc.allgather_param.default else 0

    for n in graph.nodes:
        n.meta["device_time"], n.meta["tensor_size"] = 1e-4, gathered_bytes(n)
    gm.graph = fast_free_schedule(graph, 10**12, 0, False)  # as add_z3_gather_release orders a forward graph
    gm.recompile()
    profile, total = ProfilingResult(), 0
    for n in gm.graph.nodes:
        size = gathered_bytes(n)
        total += size
        profile.fwd_mem.append((n.name, 20 * 2**30, 0, 20 * 2**30))
        profile.fwd_time.append((n.name, 1e-4, 1e-4))
        profile.fwd_tensor_sizes.append((n.name, size))
    prefetch.MAX_BUFFERED_SIZE = total / 4
    gm = prefetch.schedule_prefetch(gm, 0, [(0, True)], {0: profile}, None, 0, manager, False)

    planned = []
    for n in gm.graph.nodes:
        kind = {torch.ops.dc.prefetch_params_fused.default: "prefetch",
                torch.ops.dc.allgather_param.default: "gather", torch.ops.dc.wait_allgather.default: "wait",
                torch.ops.dc.release_param.default: "release"}.get(n.target)
        if kind:
            planned.append((kind, tuple(n.args[2]) if kind == "prefetch" else n.args[2]))
    first_gather = next(k for k, c in enumerate(planned) if c[0] == "gather")
    assert any(c[0] == "prefetch" for c in planned[first_gather:]), "the pass placed every prefetch first: no test"

    inputs = [x.detach() for x in got["inputs"]]
    compile_fx_inner(gm, inputs)(list(inputs))
    last_gather = max(k for k, c in enumerate(calls) if c[0] == "gather")
    late = [c[1] for c in calls[last_gather:] if c[0] == "prefetch"]
    assert not late, (f"{len(late)} of {sum(c[0] == 'prefetch' for c in planned)} prefetches ran after the forward's "
                      f"last gather, each of their parameters gathered where it is used: {late}")
    assert calls == planned, f"Inductor ran DeepCompile's ops in another order than the graph's: {calls}"
"""


def test_prefetches_run_where_the_pass_placed_them():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    run(f"    PORT = {port}\n" + PREFETCH_ORDER)
