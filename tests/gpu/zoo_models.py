"""The model zoo: small Hugging Face models built from their configs with random weights (nothing downloaded).

One row a family. A row names the transformers config class, the sizes that keep it small enough to compile in
seconds, and what the row is there to cover. `variant` adds what a user adds on top of the model: a PEFT LoRA
adapter on the frozen base, or HF activation checkpointing.

`loss_tol` is the relative tolerance on losses against eager DeepSpeed of the same config. It must cover the
spread between eager DeepSpeed and plain `engine.compile()` (no DeepCompile) on the same model and data, which
test_loss_tolerance_covers_compile_spread checks in every zoo run. Measured on an H100 (docs/model-zoo.md): at most
2.6e-4 for the bf16 rows, 2.4e-3 for the row with dropout (compiled and eager code draw different dropout masks
from the same seed); the bounds are about eight times that.
"""

from dataclasses import dataclass, field
from typing import Dict, Optional

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=512, max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
MOE = dict(SMALL, num_experts_per_tok=2)

BF16_LOSS_TOL = 2e-3


@dataclass(frozen=True)
class ZooModel:
    config: str  # a transformers *Config class
    sizes: Dict[str, object]
    covers: str
    variant: Optional[str] = None  # "lora", "ckpt_reentrant", "ckpt"
    loss_tol: float = BF16_LOSS_TOL
    extra: Dict[str, object] = field(default_factory=dict)


ZOO = {
    "llama": ZooModel("LlamaConfig", SMALL, "dense, GQA, SDPA attention"),
    "qwen2_moe": ZooModel("Qwen2MoeConfig",
                          dict(MOE, num_experts=4, moe_intermediate_size=64, shared_expert_intermediate_size=64),
                          "MoE block in ZeRO-3's default leaf-module list"),
    "mixtral": ZooModel("MixtralConfig", dict(MOE, num_local_experts=4), "MoE block in ZeRO-3's default leaf list"),
    "olmoe": ZooModel("OlmoeConfig", dict(MOE, num_experts=4), "MoE block not in ZeRO-3's leaf-module list"),
    "qwen2_tied": ZooModel("Qwen2Config", dict(SMALL, tie_word_embeddings=True), "tied input/output embeddings"),
    "gpt2_dropout": ZooModel("GPT2Config",
                             dict(n_embd=64, n_layer=2, n_head=4, n_positions=256, vocab_size=512, pad_token_id=0,
                                  bos_token_id=1, eos_token_id=2, resid_pdrop=0.1,
                                  embd_pdrop=0.1, attn_pdrop=0.1),
                             "dropout active, tied embeddings, Conv1D",
                             loss_tol=0.02),
    "llama_lora": ZooModel("LlamaConfig", SMALL, "PEFT LoRA adapter on a frozen base", variant="lora"),
    "llama_ckpt_reentrant": ZooModel("LlamaConfig", SMALL, "HF activation checkpointing, use_reentrant=True",
                                     variant="ckpt_reentrant"),
    "llama_ckpt": ZooModel("LlamaConfig", SMALL, "HF activation checkpointing, use_reentrant=False", variant="ckpt"),
}


def build(name):
    """The zoo's model `name` with random weights (seeded by the caller), in fp32 on the CPU."""
    import transformers

    row = ZOO[name]
    config = getattr(transformers, row.config)(**row.sizes)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if row.variant == "lora":
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    elif row.variant in ("ckpt_reentrant", "ckpt"):
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": row.variant == "ckpt_reentrant"})
    return model


def vocab_size(name):
    return ZOO[name].sizes.get("vocab_size", 512)


def token_batch(name, seed, rows, length):
    """A batch for the zoo's model `name`: `rows` rows of `length` random tokens drawn from `seed` (ids from 3, past
    the special tokens), every position attended, the labels the inputs (causal LM)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab_size(name), (rows, length), generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
