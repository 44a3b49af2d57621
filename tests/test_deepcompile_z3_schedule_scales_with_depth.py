"""DeepCompile ZeRO-3's scheduler (fast_free_schedule) must not grow with the cube of a model's depth.

The scheduler weighs every gather still to place at every step, and asked, for each, which nodes it needs: each
question made a set of everything scheduled so far (and a copy of that list plus the candidate's path). At the 8B
model's width on 4xH200 the passes of the first step took 3.6 s at 8 layers, 7.5 s at 16 and 42.5 s at 32
(docs/warmup.md), the largest share of a 120 s first step. Here, on the CPU, the work is
counted as the hashes of graph nodes one schedule of a Llama forward graph takes, with DeepCompile's own gather and
release insertion: 0.19.8 hashed 1.25M times at 4 layers and 54.2M at 16 (43x for 4x the depth); with the patch,
0.13M and 1.67M (12.7x). The schedule itself is unchanged (checked here: a valid order of every node, gathers and
releases included, each after what it depends on; the patch was checked against 0.19.8's order node for node on
4 to 32 layers, with and without a memory budget).

The scheduler also walked every candidate's dependencies from scratch at every step, reading each node's arguments
again each time (380,214 reads of a 16-layer graph's 1,960 nodes, over a third of its time): the patch
deepcompile-z3-schedule-reads-each-nodes-arguments-once keeps them for the schedule, so each node's are read once
(one forward schedule at 16 layers: 0.52 s against 0.82 s here; at 32: 1.05 s against 1.68 s; the same order).

Its work still grew with the square of the depth: it learned which gathers each gather's last use, each reduction and
each output needs by walking the graph back from each of them (53 nodes visited per graph node at 4 layers, 194 at
16), and searched those sets after every step. deepcompile-z3-schedule-finds-each-nodes-gathers-in-one-pass finds
them in one pass over the graph (1.1 nodes visited per node at any depth; the same hashes per node at 4 and 16
layers; a 32-layer forward schedule in 0.3 s; the same order, node for node, forward and backward, 2 to 32 layers).

The graphs come from transformers' Llama at a small width (the node count does not depend on the width), traced by
Dynamo and AOTAutograd on the CPU; DeepCompile's ops are defined from the wheel's schemas (no compiled extension)."""

import pytest

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS

SCHEDULE_WORK = """
    import json
    import transformers
    import deepspeed.compile.util as dc_util
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # Only the list of aliasing ops is asked of the compiled extension here, for no value of its.
    dc_util.get_deepcompile_handle = lambda: None
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.list_schedule import fast_free_schedule
    from deepspeed.compile.passes.zero3_compile import add_gather_and_release
    from deepspeed.compile.util import get_param_nodes, is_release_node

    def forward_graph(layers):
        config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                          num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
        got = {}

        def backend(gm, inputs):
            def keep(g, _):
                got.setdefault("fw", g)
                return make_boxed_func(g.forward)
            got["inputs"] = inputs
            return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep,
                                         partition_fn=min_cut_rematerialization_partition)

        torch._dynamo.reset()
        ids = torch.randint(0, 256, (1, 32))
        torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
        params = [(i, 100 + i, v.shape) for i, v in enumerate(got["inputs"]) if isinstance(v, torch.nn.Parameter)]
        graph = got["fw"].graph
        manager = DSGraphParamManager(graph, got["inputs"], params)
        graph = add_gather_and_release(0, graph, manager, get_param_nodes(graph, params))
        for n in graph.nodes:  # what the profiler leaves on every node
            n.meta["device_time"], n.meta["tensor_size"] = 0.1 * (len(n.name) % 7), 4096 * (1 + len(n.name) % 5)
        return graph

    def schedule_counting_work(graph):
        # The schedule, the hashes of graph nodes it took, the times it read a node's arguments and the nodes its
        # walks back through the graph (get_node_requirements) visited.
        import deepspeed.compile.list_schedule as list_schedule
        hashes, reads, walked = [0], [0], [0]
        node_hash, map_arg = torch.fx.Node.__hash__, list_schedule.map_arg
        requirements = list_schedule.get_node_requirements

        def counted(node):
            hashes[0] += 1
            return node_hash(node)

        def reading(arg, fn):
            reads[0] += 1
            return map_arg(arg, fn)

        def walking(*args, **kwargs):
            found = requirements(*args, **kwargs)
            walked[0] += len(found)
            return found

        torch.fx.Node.__hash__, list_schedule.map_arg, list_schedule.get_node_requirements = counted, reading, walking
        try:
            scheduled = fast_free_schedule(graph, 10**12, 0, False)
        finally:
            torch.fx.Node.__hash__, list_schedule.map_arg, list_schedule.get_node_requirements = (node_hash, map_arg,
                                                                                                 requirements)
        return scheduled, hashes[0], reads[0], walked[0]

    work, reads, walks, nodes = {}, {}, {}, {}
    for layers in (4, 16):
        graph = forward_graph(layers)
        names = [n.name for n in graph.nodes]
        nodes[layers] = len(names)
        scheduled, work[layers], reads[layers], walks[layers] = schedule_counting_work(graph)
        order = {n.name: i for i, n in enumerate(scheduled.nodes)}
        assert sorted(order) == sorted(names), "the schedule lost or added nodes"
        for n in scheduled.nodes:
            assert all(order[a.name] < order[n.name] for a in n.all_input_nodes), f"{n.name} before its inputs"
        assert any(is_release_node(n) for n in scheduled.nodes), "no release: the pass inserted nothing"
    print("SCHEDULE_WORK " + json.dumps(dict(hashes=work, argument_reads=reads, walked=walks, nodes=nodes)))
"""


@pytest.fixture(scope="module")
def schedules():
    """One schedule each of the 4- and 16-layer graphs, checked valid: {hashes, argument_reads, walked, nodes} by
    depth."""
    counts = cpu_worker.code_report(DEFINE_OPS + SCHEDULE_WORK, "SCHEDULE_WORK ", timeout=600)
    return {k: {int(layers): n for layers, n in v.items()} for k, v in counts.items()}


def test_scheduling_work_grows_no_faster_than_the_square_of_the_depth(schedules):
    work = schedules["hashes"]
    assert work[16] <= 16 * work[4], (
        f"scheduling a 16-layer graph took {work[16] / work[4]:.1f}x the work of a 4-layer one (hashes of graph "
        f"nodes: {work}); more than the square of the depth's ratio, 16x")


def test_the_scheduler_reads_each_nodes_arguments_once(schedules):
    reads, nodes = schedules["argument_reads"], schedules["nodes"]
    for layers in (4, 16):
        assert 0 < reads[layers] <= nodes[layers], (
            f"{layers} layers: the schedule read nodes' arguments {reads[layers]} times, for {nodes[layers]} nodes")


def test_the_scheduler_finds_the_gathers_each_node_needs_in_one_pass(schedules):
    # Without deepcompile-z3-schedule-finds-each-nodes-gathers-in-one-pass the walks visited 53 nodes per graph node
    # at 4 layers and 194 at 16 (one walk from every gather's last use, reduction and output), and the hashes per
    # node grew 3.5x; with it, 1.1 nodes per node at both depths and the same hashes per node.
    walked, work, nodes = schedules["walked"], schedules["hashes"], schedules["nodes"]
    for layers in (4, 16):
        assert walked[layers] <= 2 * nodes[layers], (
            f"{layers} layers: the schedule's walks visited {walked[layers]} nodes of a {nodes[layers]}-node graph")
    per_node = {layers: work[layers] / nodes[layers] for layers in (4, 16)}
    assert per_node[16] <= 1.25 * per_node[4], (
        f"hashes of graph nodes per node: {per_node[4]:.0f} at 4 layers, {per_node[16]:.0f} at 16; the scheduler's "
        "work grows faster than the graph")
