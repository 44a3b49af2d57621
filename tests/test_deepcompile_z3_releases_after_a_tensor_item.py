"""DeepCompile ZeRO-3 releases a parameter used by an op that returns a tuple after a tensor item of the tuple
(patch deepcompile-z3-releases-after-a-tensor-item).

A gathered parameter is released after its last user; when that user returns a tuple, the release waits on one of
the tuple's items (operator.getitem), the first found. A nested compile region returns a tuple, and under dynamic
shapes its first items are sizes: 0.19.8 released after an int, and the graph failed at its first run ("dc::
release_param() Expected a value of type 'Tensor' for argument 'a' but instead found type 'int'. Value: 68", the
model zoo's Llama with compile_blocks_once, on an H200, at its second sequence length).

transformers' Llama on the CPU, each decoder layer a nested compile region, compiled by Dynamo and AOTAutograd at
two lengths (the second a symbol) with DeepCompile's partitioner; DeepCompile's gather-and-release pass then runs on
the forward graph, its ops defined from the wheel's schemas.
"""

import json

import pytest
import torch

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

RELEASES = """
    import json
    import operator
    import transformers
    import deepspeed.compile.util as dc_util
    from functorch.compile import make_boxed_func
    from torch._functorch.aot_autograd import aot_module_simplified
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # Only the list of aliasing ops is asked of the compiled extension here, for no value of its.
    dc_util.get_deepcompile_handle = lambda: None
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.inductor import wrap_partition_fn
    from deepspeed.compile.passes.zero3_compile import add_gather_and_release
    from deepspeed.compile.util import get_param_nodes

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=256)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    block = torch.compiler.nested_compile_region(type(model.model.layers[0]).forward)
    for layer in model.model.layers:
        layer.forward = block.__get__(layer)
    got = {}

    def backend(gm, inputs):
        params = [(i, 100 + i, v.shape) for i, v in enumerate(inputs) if isinstance(v, torch.nn.Parameter)]
        partition = wrap_partition_fn(True, min_cut_rematerialization_partition, inputs, params, 0, set())

        def keep(g, _):
            got.setdefault("fw", g)  # the forward, compiled before the backward
            return make_boxed_func(g.forward)

        got["inputs"], got["params"] = inputs, params
        return aot_module_simplified(gm, inputs, fw_compiler=keep, bw_compiler=keep, partition_fn=partition)

    compiled = torch.compile(model, backend=backend)
    for length in (24, 20):  # the second length compiles the graph again, its length a symbol
        got.clear()
        ids = torch.randint(0, 256, (2, length))
        compiled(input_ids=ids, labels=ids).loss.backward()
    graph = got["fw"].graph
    manager = DSGraphParamManager(graph, got["inputs"], got["params"])
    graph = add_gather_and_release(0, graph, manager, get_param_nodes(graph, got["params"]))
    releases = [n for n in graph.nodes if n.target == torch.ops.dc.release_param.default]

    def released_after(node):
        # releases that follow one user pass its value on: the value under them
        while node.target == torch.ops.dc.release_param.default:
            node = node.args[0]
        return type(node.meta.get("val")).__name__

    after = [released_after(n.args[0]) for n in releases]
    region_items = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                    and "invoke_subgraph" in str(n.args[0].target)]
    print("RELEASES " + json.dumps(dict(
        releases=len(releases), after=after,
        region_size_items=sum(not isinstance(n.meta.get("val"), torch.Tensor) for n in region_items))))
"""


def test_every_release_waits_on_a_tensor():
    out = cpu_worker.run_code(DEFINE_OPS + RELEASES, "RELEASES ", timeout=600)
    report = json.loads([line for line in out.splitlines() if line.startswith("RELEASES ")][-1][len("RELEASES "):])
    assert report["region_size_items"] > 0, report  # the case: the regions return sizes among their outputs
    assert report["releases"] > 0, report
    assert set(report["after"]) == {"FakeTensor"}, report  # 0.19.8: some after a SymInt
