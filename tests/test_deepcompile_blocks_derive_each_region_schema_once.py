"""With compile_blocks_once, AOTAutograd traced the decoder layer's whole function again at every call of the region.

AOTAutograd asks for the schema of each call of a nested compile region (InvokeSubgraphHOP.gen_schema): at its
autograd check for input mutations, and again at functionalization. Each answer traced the region's function anew
(materialize_as_graph), so the trace the regions were to spare came back once or more for every layer: on the CPU at
16 layers, 80 traces and 19.2 s of AOTAutograd on torch 2.11 (34 traces, 21.4 s on 2.14) against 17.4 s for the
whole model's graph without regions. With the patch (deepcompile-compile-blocks-once-derives-a-region-schema-once)
compile_blocks_once derives the schema once per compile for each region and kind of operands: 3 traces and 4.6 s
(4.8 s on 2.14), the same graphs.

transformers' Llama on the CPU, its decoder layers made regions by compile_blocks_once, traced by Dynamo and
AOTAutograd with DeepCompile's partitioner, against the same with torch's own gen_schema put back (no schema kept):
the traces of a region's function are counted, the graphs compared, and the loss and gradients checked against
eager; once as it is, once with a PEFT LoRA adapter (frozen and trainable operands) over two sequence lengths (the
second compiles the graphs again with a dynamic length).
"""

import pytest
import torch

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS
from test_deepcompile_z3_partitions_nested_compile_regions import nested_llama

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

LAYERS = 4

TRACES = """
    import hashlib
    import torch._higher_order_ops.utils as hop_utils

    from deepspeed.compile.blocks import compile_blocks_once
    from torch._higher_order_ops.invoke_subgraph import InvokeSubgraphHOP

    derive = vars(InvokeSubgraphHOP)["gen_schema"]
    assert len(compile_blocks_once(model)) == layers
    if not by_deepspeed:
        InvokeSubgraphHOP.gen_schema = derive  # every call's schema derived again, as torch alone does
    traces = []
    materialize = hop_utils.materialize_as_graph

    def counted(fn, *args, **kwargs):
        traces.append(fn)
        return materialize(fn, *args, **kwargs)

    hop_utils.materialize_as_graph = counted
    compiled_model = torch.compile(model, backend=backend)
    for seq in lengths:
        model.zero_grad()
        ids = torch.randint(0, 256, (2, seq))
        loss = compiled_model(input_ids=ids, labels=ids).loss
        loss.backward()
    graphs = hashlib.sha256()
    for g in compiled["fw"] + compiled["bw"]:
        for name, module in g.named_modules():  # the graph and the regions' graphs
            graphs.update(name.encode() + module.print_readable(print_output=False).encode())
    report = dict(traces=len(traces), graphs=graphs.hexdigest())
    report.update(against_eager(loss, ids))
    print("TRACES " + json.dumps(report))
"""


def traces(by_deepspeed, lora=False, lengths=(24, )):
    code = (DEFINE_OPS + nested_llama(LAYERS, lora=lora, regions=False) +
            f"    by_deepspeed, lengths = {by_deepspeed}, {lengths}\n" + TRACES)
    return cpu_worker.code_report(code, "TRACES ", timeout=600)


@pytest.fixture(scope="module")
def deepspeed_and_torch_regions():
    return traces(by_deepspeed=True), traces(by_deepspeed=False)


@pytest.fixture(scope="module")
def with_lora_over_two_lengths():
    return traces(True, lora=True, lengths=(24, 40)), traces(False, lora=True, lengths=(24, 40))


def test_compile_blocks_once_traces_a_region_fewer_times_than_it_has_layers(deepspeed_and_torch_regions):
    ours, torchs = deepspeed_and_torch_regions
    assert ours["traces"] < LAYERS, (
        f"AOTAutograd traced the region's function {ours['traces']} times for {LAYERS} layers under "
        f"compile_blocks_once (with torch's own gen_schema: {torchs['traces']})")


@pytest.mark.parametrize("case", ["deepspeed_and_torch_regions", "with_lora_over_two_lengths"])
def test_regions_with_schemas_derived_once_compile_the_same_graphs(case, request):
    ours, torchs = request.getfixturevalue(case)
    assert ours["graphs"] == torchs["graphs"]
    assert ours["traces"] < torchs["traces"], (ours["traces"], torchs["traces"])
    for report in (ours, torchs):
        assert abs(report["loss"] - report["eager_loss"]) <= 1e-5 * abs(report["eager_loss"]), report
        assert report["grad_diff"] <= 1e-5, report
