"""With compile_blocks_once on torch >= 2.14, every decoder layer ran with the first layer's weights.

torch 2.14's Dynamo reuses the trace of a nested compile region for a later call whose inputs match the first call's,
and stamps it out with that call's own inputs. compile_blocks_once bound the region to each block (the block's forward
a method of its own), which hid the block from those inputs: every layer matched the first and ran with its weights.
transformers' Llama (6 layers, use_cache=False, as gradient checkpointing sets it) lost 5.5797 where eager lost 5.5488,
and only the first layer's weights got gradients; with the KV cache on, the cache's updates kept Dynamo from reusing
and hid the defect. With the patch (deepcompile-compile-blocks-once-binds-each-layers-own-weights) each block becomes
an instance of a subclass of its class whose forward is the region, and Dynamo reuses the trace with each layer's own
weights. torch 2.11 reuses nothing, so there this checks only that the layers train as eager.

Llama, Mixtral, Qwen2-MoE and GPT-2 from transformers on the CPU, their layers made regions by compile_blocks_once,
compiled with AOTAutograd (aot_eager) against the same model run eagerly: the loss and every parameter's gradient,
Dynamo's reuses of the region's trace, and that a block still copies, pickles and restores as its own class. On
fork.60 with torch 2.14.1, Mixtral's, Qwen2-MoE's and GPT-2's later layers got no gradient either.
"""

import os

import pytest
import torch

import cpu_worker

WORKERS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers")

pytestmark = pytest.mark.skipif(not hasattr(torch.compiler, "nested_compile_region"),
                                reason=f"torch {torch.__version__} has no torch.compiler.nested_compile_region")

LAYERS = 4

OWN_WEIGHTS = f"""
    import copy, io, json, sys
    import torch, transformers
    sys.path.insert(0, {WORKERS!r})
    from dc_compile_blocks_once import count_region_reuses
    from deepspeed.compile.blocks import compile_blocks_once, repeated_blocks, restore_blocks

    config = {{config}}
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")
    ids = torch.randint(0, 256, (2, 12))
    eager = model(input_ids=ids, labels=ids).loss
    eager.backward()
    eager_grads = {{n: p.grad.clone() for n, p in model.named_parameters()}}
    model.zero_grad()

    reuses = count_region_reuses()  # None where this torch's Dynamo reuses no region's trace
    layer_class = type(repeated_blocks(model)[0])
    blocks = compile_blocks_once(model)
    loss = torch.compile(model, backend="aot_eager")(input_ids=ids, labels=ids).loss
    loss.backward()
    without_grad = [n for n, p in model.named_parameters() if p.grad is None]
    grad_diff = max(float((p.grad - eager_grads[n]).abs().max()) for n, p in model.named_parameters()
                    if p.grad is not None)

    report = dict(blocks=len(blocks), loss=float(loss), eager_loss=float(eager), without_grad=without_grad,
                  grad_diff=grad_diff, reuses=None if reuses is None else len(reuses))
    try:
        copied = copy.deepcopy(blocks[1])
        saved = io.BytesIO()
        torch.save(blocks[1], saved)
        saved.seek(0)
        loaded = torch.load(saved, weights_only=False)
        report.update(copied_as=type(copied) is layer_class, loaded_as=type(loaded) is layer_class,
                      loaded_same=all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(),
                                                                       blocks[1].state_dict().values())))
    except Exception as e:
        report["copy_error"] = f"{{type(e).__name__}}: {{e}}"[:300]
    restore_blocks(blocks)
    report["restored"] = all(type(block) is layer_class and "forward" not in vars(block) for block in blocks)
    print("OWN_WEIGHTS " + json.dumps(report))
"""


# One small config per family of the model zoo, without the KV cache (with it, Dynamo reuses no trace).
SMALL = f"num_hidden_layers={LAYERS}, num_attention_heads=4, num_key_value_heads=2, vocab_size=256, use_cache=False"
FAMILIES = {
    "llama": f"transformers.LlamaConfig(hidden_size=64, intermediate_size=128, {SMALL})",
    "mixtral": f"transformers.MixtralConfig(hidden_size=64, intermediate_size=64, num_local_experts=4, {SMALL})",
    "qwen2_moe": f"transformers.Qwen2MoeConfig(hidden_size=64, intermediate_size=64, moe_intermediate_size=32, "
                 f"shared_expert_intermediate_size=64, num_experts=4, {SMALL})",
    "gpt2": f"transformers.GPT2Config(n_embd=64, n_layer={LAYERS}, n_head=4, vocab_size=256, use_cache=False, "
            f"resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)",
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def report(request):
    code = OWN_WEIGHTS.replace("{config}", FAMILIES[request.param])
    return cpu_worker.code_report(code, "OWN_WEIGHTS ", timeout=600)


def test_every_layer_trains_with_its_own_weights(report):
    assert report["blocks"] == LAYERS, report
    assert report["without_grad"] == [], f"parameters the compiled model gave no gradient: {report['without_grad']}"
    assert abs(report["loss"] - report["eager_loss"]) <= 1e-6 * abs(report["eager_loss"]), report
    assert report["grad_diff"] <= 1e-5, report


def test_dynamo_still_reuses_the_region_where_torch_can(report):
    if report["reuses"] is None:
        pytest.skip(f"torch {torch.__version__}'s Dynamo does not reuse a region's trace")
    # every layer after the first, in each graph Dynamo makes of the model (GPT-2's: several)
    assert report["reuses"] >= LAYERS - 1, report


def test_a_block_copies_pickles_and_restores_as_its_own_class(report):
    assert "copy_error" not in report, report["copy_error"]
    assert report["copied_as"] and report["loaded_as"] and report["loaded_same"], report
    assert report["restored"], report
