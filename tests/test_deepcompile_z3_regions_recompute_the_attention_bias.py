"""With compile_blocks_once, every decoder layer of a Llama saved its own attention bias for its backward.

SDPA's backward takes the float attention bias its forward makes of the boolean causal mask, where(mask, 0, -inf), a
tensor of sequence x sequence. A whole model's graph makes it once, for every layer, and saves it once. A nested
compile region is partitioned on its own, and its forward made and saved its own bias: one more for every layer, 32 MiB
each at seq 4096 in bf16. On one H200, DeepCompile ZeRO-3 on Llama 1.5B (16 layers, seq 4096) peaked 0.47 GiB higher
with compile_blocks_once than without (docs/warmup.md): the size of fifteen such biases. With the patch
(deepcompile-z3-regions-recompute-what-their-inputs-alone-make) a region's backward makes the bias again from the mask,
which reaches it anyway.

transformers' Llama on the CPU, each decoder layer a nested compile region or none, traced by Dynamo and AOTAutograd
with DeepCompile's partitioner; what the backward graph takes from the forward is counted, and the loss and gradients
are checked against eager. On torch 2.11 the regions saved 4 biases where the whole model's graph saves 1; torch
2.14's partitioner recomputes the bias in both, patch or not.
"""

import pytest
import torch

import cpu_worker
from test_deepcompile_prefetch_survives_dead_code_elimination import DEFINE_OPS
from test_deepcompile_z3_partitions_nested_compile_regions import nested_llama

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

LAYERS, BATCH, SEQ = 4, 2, 24

SAVED = """
    ids = torch.randint(0, 256, ({batch}, {seq}))
    loss = torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss
    loss.backward()
    (fw,), (bw,) = compiled["fw"], compiled["bw"]
    fw_inputs = {{n.name for n in fw.graph.find_nodes(op="placeholder")}}
    # What the backward takes that is neither a graph input (parameters, ids) nor a gradient: what the forward saved.
    saved = [n.meta["val"] for n in bw.graph.find_nodes(op="placeholder")
             if n.name not in fw_inputs and not n.name.startswith("tangents")
             and isinstance(n.meta.get("val"), torch.Tensor)]
    report = dict(biases=sum(v.is_floating_point() and tuple(v.shape) == ({batch}, 1, {seq}, {seq}) for v in saved))
    report.update(against_eager(loss, ids))
    print("SAVED " + json.dumps(report))
"""


def saved(regions):
    code = DEFINE_OPS + nested_llama(LAYERS, regions=regions) + SAVED.format(batch=BATCH, seq=SEQ)
    return cpu_worker.code_report(code, "SAVED ", timeout=600)


@pytest.fixture(scope="module")
def whole_and_regions():
    return saved(regions=False), saved(regions=True)


def test_regions_save_no_attention_bias_of_their_own(whole_and_regions):
    # torch 2.11 saves one in the whole model's graph; 2.14's partitioner recomputes it there and in the regions.
    whole, regions = whole_and_regions
    assert regions["biases"] <= whole["biases"] <= 1, (
        f"with each of the {LAYERS} layers a nested compile region the forward saved {regions['biases']} float "
        f"attention biases of {BATCH} x 1 x {SEQ} x {SEQ} for the backward; the whole model's graph {whole['biases']}")


def test_regions_that_recompute_the_bias_train_as_eager(whole_and_regions):
    for report in whole_and_regions:
        assert abs(report["loss"] - report["eager_loss"]) <= 1e-5 * abs(report["eager_loss"]), report
        assert report["grad_diff"] <= 1e-5, report
