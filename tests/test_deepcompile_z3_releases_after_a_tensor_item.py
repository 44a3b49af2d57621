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

import pytest
import torch

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS
from test_deepcompile_z3_partitions_nested_compile_regions import nested_llama

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

RELEASES = """
    from deepspeed.compile.graph_param import DSGraphParamManager
    from deepspeed.compile.passes.zero3_compile import add_gather_and_release
    from deepspeed.compile.util import get_param_nodes

    run = torch.compile(model, backend=backend)
    for length in (24, 20):  # the second length compiles the graph again, its length a symbol
        ids = torch.randint(0, 256, (2, length))
        run(input_ids=ids, labels=ids).loss.backward()
    graph = compiled["fw"][-1].graph  # the second length's forward
    manager = DSGraphParamManager(graph, compiled["inputs"], compiled["params"])
    graph = add_gather_and_release(0, graph, manager, get_param_nodes(graph, compiled["params"]))
    releases = [n for n in graph.nodes if n.target == torch.ops.dc.release_param.default]

    after = [type(under_deepcompile_ops(n.args[0]).meta.get("val")).__name__ for n in releases]
    region_items = [n for n in graph.nodes if n.op == "call_function" and n.target is operator.getitem
                    and "invoke_subgraph" in str(n.args[0].target)]
    print("RELEASES " + json.dumps(dict(
        releases=len(releases), after=after,
        region_size_items=sum(not isinstance(n.meta.get("val"), torch.Tensor) for n in region_items))))
"""


def test_every_release_waits_on_a_tensor():
    report = cpu_worker.code_report(DEFINE_OPS + nested_llama(2) + RELEASES, "RELEASES ", timeout=600)
    assert report["region_size_items"] > 0, report  # the case: the regions return sizes among their outputs
    assert report["releases"] > 0, report
    assert set(report["after"]) == {"FakeTensor"}, report  # 0.19.8: some after a SymInt
