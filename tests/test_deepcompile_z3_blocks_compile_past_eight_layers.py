"""compile_blocks_once under DeepCompile ZeRO-3 failed on torch >= 2.14 for every model of more than eight layers.

torch 2.14's Dynamo reuses the trace of a nested compile region for a later call when the guards of the first call
hold for it, and raises once a region has gathered eight traces that could not be reused ("invoke_subgraph: exceeded
maximum reuse entries (8)"). Two things ZeRO-3 puts on every module kept the guards from holding:
- the eager fallback's module hooks, registered under a key of their own on each module: Dynamo guards a call on the
  keys of the module's hook dicts, so no later layer matched the first and each was traced again; on the ninth
  layer the compile failed (Llama, 10 layers, use_cache=False as gradient checkpointing sets it; torch 2.14.1 and
  2.15.0 alike);
- ZeRO-3's parameter dicts (ZeROOrderedDict), read by Dynamo by key position: a reused trace reads the next layer's
  dict, which Dynamo had not marked for guarding on its key order, and building the guards failed ("Expecting
  clean index here").
With the patch (deepcompile-z3-blocks-reuse-the-first-layers-trace) the hooks share one key on every module and
ZeRO-3's parameter dicts are guarded on their key order: every later layer reuses the first layer's trace.

Checked through a real deepspeed.initialize and engine.compile() with DeepCompile's backend stood in for
(tests/cpu_workers/dc_compile_blocks_once.py), for a dense and a mixture-of-experts family: the call with labels
computes the eager loss, and where torch reuses traces (>= 2.14) every layer after the first reused the first one's;
greedy generation with the KV cache (which no trace is reused for) gives the eager tokens. torch 2.11 reuses no
trace: there the same checks run, less the count.
"""

import os

import pytest
import torch

import cpu_worker

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_compile_blocks_once.py")
LAYERS = 10

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")


@pytest.fixture(scope="module", params=["llama", "mixtral"])
def report(request, tmp_path_factory):
    args = ["--stage", "3", "--blocks", "--layers", str(LAYERS), "--no-kv-cache", "--family", request.param]
    report, _ = cpu_worker.run(WORKER, args, "BLOCKS_REPORT ", tmp_path_factory.mktemp(request.param), timeout=300)
    return report


def test_a_model_of_more_than_eight_layers_compiles_to_the_eager_loss(report):
    assert report["error"] is None, report["error"]
    train = report["train"]
    assert (train["region_calls"], train["region_graphs"]) == (LAYERS, 1), train
    assert abs(train["loss"] - train["eager_loss"]) <= 1e-6 * abs(train["eager_loss"]), train


def test_every_later_layer_reuses_the_first_layers_trace(report):
    if report["train"]["reuses"] is None:
        pytest.skip(f"torch {torch.__version__}'s Dynamo does not reuse a region's trace")
    assert report["train"]["reuses"] == LAYERS - 1, report["train"]


def test_generation_with_the_kv_cache_gives_the_eager_tokens(report):
    assert report["generate"]["tokens"] == report["generate"]["eager_tokens"], report["generate"]
