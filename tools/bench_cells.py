"""What tools/bench measures: the models, the subjects and the named cell sets.

A subject is how a training step is run: plain PyTorch (`torch`), `torch.compile` of the model (`compile`; `compile-amp`
with fp32 weights and optimizer states and bf16 autocast, the precision of DeepSpeed's bf16), eager
DeepSpeed ZeRO-N (`ds-zN`; `ds-z2-oc` with overlap_comm), DeepCompile ZeRO-N (`dc-zN`; `dc-zN-bf16` without fp32
master weights; `dc-z3-pad` with Inductor's `force_shape_pad`, padding every matmul of odd size without a benchmark;
`dc-z3-rbauto` and `dc-z3-rb1e8` with a reduce bucket of what the Hugging Face Trainer fills in for "auto", hidden
size squared, or of 10**8 elements, where DeepSpeed's default is 5e8; `dc-z3-blocks` with `compile_blocks_once`, each
decoder layer one nested compile region; `-causal` with transformers passing SDPA no
causal mask under torch.compile, as newer transformers and torch do: bench_step.skip_causal_mask_under_compile),
or FSDP2 with a `torch.compile` per block (`fsdp2`). Every subject trains the same model from the same
seed with AdamW (torch's fused implementation: the optimizer a PyTorch user would pick; DeepSpeed gets it as the client
optimizer) on bf16: DeepSpeed and FSDP2 keep fp32 master weights, gradients and optimizer states (`dc-zN-bf16`: bf16
ones), `torch` and `compile` train bf16 parameters.

A group is run together: its processes warm up side by side on the GPU, then take turns at timed blocks (A B C, A B
C, ...), so versions of one cell are interleaved while each keeps its compiled code warm. Groups hold subjects of
about the same memory, because DeepCompile sizes its prefetching from the free device memory it sees.
"""

LLAMA_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256)
LLAMA_15B = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
LLAMA_05B = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                 num_key_value_heads=8, vocab_size=128256)

# name: transformers config class and sizes. Parameter counts are of the model as built (tools/bench prints them).
MODELS = {
    # A host-bound model: 435 small parameter tensors (48 layers x 9, embeddings, final norm, head).
    "many-tensor": ("LlamaConfig", dict(hidden_size=256, intermediate_size=688, num_hidden_layers=48,
                                        num_attention_heads=4, num_key_value_heads=4, vocab_size=32000)),
    # Llama-style, Llama 3's vocabulary (a large embedding): about 0.55B and 1.5B parameters.
    "llama-0.5b": ("LlamaConfig", LLAMA_05B),
    # The 0.55B Llama with GPT-2's vocabulary, 50257 rows: an output projection of odd size, which Inductor may pad.
    "llama-0.5b-gpt2-vocab": ("LlamaConfig", dict(LLAMA_05B, vocab_size=50257)),
    "llama-1.5b": ("LlamaConfig", LLAMA_15B),
    # Llama-3-8B-shaped (8.0B parameters), and its width at 8 and 16 layers (2.8B, 4.5B): warm-up against depth.
    "llama-8b": ("LlamaConfig", LLAMA_8B),
    **{f"llama-8b-{n}l": ("LlamaConfig", dict(LLAMA_8B, num_hidden_layers=n)) for n in (8, 16)},
    # The 1.5B model's width at 8 and 32 layers (1.0B, 2.5B parameters): DeepCompile's passes cost what the
    # graph's node count costs, which the depth decides.
    **{f"llama-1.5b-{n}l": ("LlamaConfig", dict(LLAMA_15B, num_hidden_layers=n)) for n in (8, 32)},
    # Qwen3-8B-shaped (8.2B parameters): the model of the defect report DeepSpeed PR #8036 measured on 8 GPUs.
    "qwen3-8b": ("Qwen3Config", dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936)),
    # Qwen2-MoE-style, 16 routed experts of which 2 a token and a shared expert in every layer, Llama 3's vocabulary:
    # about 0.77B parameters, 0.27B of them computed per token (the input embedding and 14 of 16 experts not).
    "qwen2-moe": ("Qwen2MoeConfig", dict(hidden_size=1024, intermediate_size=2816, moe_intermediate_size=704,
                                         shared_expert_intermediate_size=1408, num_experts=16, num_experts_per_tok=2,
                                         num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=8,
                                         vocab_size=128256)),
    # CPU-sized models for the tool's own tests.
    "tiny": ("LlamaConfig", dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, vocab_size=128)),
    "tiny-moe": ("Qwen2MoeConfig", dict(hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        vocab_size=128)),
}

SUBJECTS = ("torch", "compile", "compile-amp", "ds-z0", "ds-z1", "ds-z2", "ds-z2-oc", "ds-z3", "dc-z1", "dc-z2",
            "dc-z3", "dc-z1-bf16", "dc-z3-bf16", "dc-z3-pad", "dc-z3-rbauto", "dc-z3-rb1e8", "dc-z3-blocks", "fsdp2",
            "compile-causal", "dc-z1-causal", "dc-z3-causal", "dc-z3-blocks-causal")
# Subjects whose code is DeepSpeed's: these run once per --site; the others once.
SITED = tuple(s for s in SUBJECTS if s.startswith(("ds-", "dc-")))

# set: (model, seq, batch, [group, ...]); a group is a list of subjects. Sited subjects expand to one process a site.
SETS = {
    # Eager ZeRO's per-tensor step work on the many-tensor model.
    "eager-many-tensor": ("many-tensor", 256, 1, [["torch", "ds-z0", "ds-z1", "ds-z2", "ds-z3"]]),
    # Eager ZeRO at 0.5B, seq 2048; ds-z2-oc: overlap_comm on, where the fork calls record_stream.
    "eager-0.5b": ("llama-0.5b", 2048, 1, [["ds-z1"], ["ds-z2"], ["ds-z2-oc"], ["ds-z3"], ["torch"]]),
    # The default: DeepCompile against plain torch.compile, 0.5B at seq 2048 (the longest warm-up first).
    "default": ("llama-0.5b", 2048, 1, [["dc-z3"], ["dc-z1"], ["compile"]]),
    # The default's DeepCompile subjects with bf16 master weights, gradients and optimizer states
    # (`bf16_master_weights_and_grads`, `bf16_optimizer_states`): the precision `compile` trains in. Run it with
    # `default`, whose `compile` it is compared with.
    "bf16-states": ("llama-0.5b", 2048, 1, [["dc-z3-bf16"], ["dc-z1-bf16"]]),
    "seq-4096": ("llama-0.5b", 4096, 1, [["dc-z1"], ["compile"], ["dc-z3"]]),
    "moe": ("qwen2-moe", 2048, 1, [["dc-z3"], ["dc-z1"], ["compile"]]),
    "zero2": ("llama-0.5b", 2048, 1, [["dc-z2"], ["ds-z2"], ["compile"]]),
    "dense-1.5b": ("llama-1.5b", 2048, 1, [["compile"], ["dc-z1"], ["dc-z3"]]),
    # With --gpus N: DeepCompile ZeRO-3 against FSDP2 + compile and eager ZeRO-3, then the cell of the MFU
    # target (1.5B at seq 4096) and the MoE model, each with eager ZeRO-3 last.
    "multi-gpu": ("llama-0.5b", 2048, 1, [["fsdp2"], ["dc-z3"], ["ds-z3"]]),
    "multi-gpu-1.5b-4096": ("llama-1.5b", 4096, 1, [["dc-z3"], ["fsdp2"], ["ds-z3"]]),
    "multi-gpu-moe": ("qwen2-moe", 2048, 1, [["dc-z3"], ["fsdp2"], ["ds-z3"]]),
    # What fork.34's deepcompile-z3-ranks-agree-on-matmul-padding costs where it acts, with --gpus 2: the output
    # projection unpadded (the patch) against padded on every rank (force_shape_pad), side by side.
    "odd-vocab": ("llama-0.5b-gpt2-vocab", 2048, 1, [["dc-z3", "dc-z3-pad"]]),
    # DeepCompile ZeRO-3's reduce-scatter buckets at the MFU target's cell, DeepSpeed's default size
    # beside the Trainer's "auto" (hidden size squared: 4.2M elements here, smaller than most gradients) and 10**8.
    "reduce-buckets": ("llama-1.5b", 4096, 1, [["dc-z3", "dc-z3-rbauto"]]),
    "reduce-buckets-1e8": ("llama-1.5b", 4096, 1, [["dc-z3", "dc-z3-rb1e8"]]),
    # Warm-up against depth at the 8B model's width, seq 4096, with --gpus 4: DeepCompile ZeRO-3 and FSDP2 + compile,
    # each alone on the GPUs (processes sharing them slow each other's compiles); then the sizes people train.
    **{f"warmup-8b-{n}l": (f"llama-8b-{n}l", 4096, 1, [["dc-z3"], ["fsdp2"]]) for n in (8, 16)},
    "warmup-8b": ("llama-8b", 4096, 1, [["dc-z3"], ["fsdp2"]]),
    "warmup-1.5b-32l": ("llama-1.5b-32l", 4096, 1, [["dc-z3"], ["fsdp2"]]),
    "size-0.5b": ("llama-0.5b", 4096, 1, [["dc-z3"], ["dc-z1"], ["fsdp2"], ["ds-z3"]]),
    "size-1.5b": ("llama-1.5b", 4096, 1, [["dc-z3"], ["dc-z1"], ["fsdp2"], ["ds-z3"]]),
    "size-8b": ("llama-8b", 4096, 1, [["dc-z3"], ["fsdp2"], ["ds-z3"], ["dc-z1"]]),
    # DeepCompile's whole-model graph with SDPA's flash kernel, as fsdp2's per-block graphs get it.
    "size-8b-causal": ("llama-8b", 4096, 1, [["dc-z3-causal"], ["fsdp2"], ["dc-z1-causal"]]),
    # The 8B model's width at 8 and 16 layers: where its step goes (--profile), in a fraction of the 8B model's
    # warm-up; at 16 layers the parameters exceed what DeepCompile's prefetch pass keeps in flight (4 GB).
    **{f"step-8b-{n}l": (f"llama-8b-{n}l", 4096, 1, [["dc-z3"], ["dc-z3-causal"], ["fsdp2"], ["dc-z1-causal"]])
       for n in (8, 16)},
    # Each decoder layer compiled once (compile_blocks_once) beside the whole model; FSDP2 + per-block compile after.
    "blocks-1.5b": ("llama-1.5b", 4096, 1, [["dc-z3", "dc-z3-blocks"], ["fsdp2"]]),
    # The same at 8 and 32 layers of the 1.5B width: warm-up against depth.
    **{f"blocks-1.5b-{n}l": (f"llama-1.5b-{n}l", 4096, 1, [["dc-z3-blocks"], ["fsdp2"]]) for n in (8, 32)},
    "blocks-8b": ("llama-8b", 4096, 1, [["dc-z3", "dc-z3-blocks"], ["fsdp2"]]),
    # The 8B model's width at 8 and 16 layers with compile_blocks_once: warm-up against depth beside blocks-8b.
    **{f"blocks-8b-{n}l": (f"llama-8b-{n}l", 4096, 1, [["dc-z3-blocks"], ["fsdp2"]]) for n in (8, 16)},
    # The same with SDPA's flash kernel for the whole-model graph too (transformers >= 5.18 on torch >= 2.14 passes no
    # mask where nothing is padded): the 8B step against FSDP2 + compile as a new install trains it.
    "blocks-8b-causal": ("llama-8b", 4096, 1, [["dc-z3-blocks-causal"], ["fsdp2"]]),
    **{f"blocks-8b-{n}l-causal": (f"llama-8b-{n}l", 4096, 1, [["dc-z3-blocks-causal"], ["fsdp2"]]) for n in (8, 16)},
    "size-1.5b-causal": ("llama-1.5b", 4096, 1, [["dc-z3-causal", "dc-z3"], ["fsdp2"]]),
    # https://github.com/deepspeedai/DeepSpeed/pull/8036's setting, with --gpus 8 and a --site for each version:
    # DeepCompile ZeRO-1's step and peak memory, the fork against 0.19.8.
    "founding-8036": ("qwen3-8b", 4096, 1, [["dc-z1"]]),
    # At one GPU: DeepCompile ZeRO-1 against torch.compile at DeepSpeed's precision and at pure bf16.
    "one-gpu-0.5b": ("llama-0.5b", 2048, 1, [["dc-z1"], ["compile-amp"], ["compile"]]),
    "tiny": ("tiny", 32, 2, [["torch", "ds-z1", "ds-z3"]]),
}


def parse_sets(names, only=""):
    """[(set name, model, seq, batch, groups)] for comma-separated set names, or ValueError naming the known ones.

    `only` (comma-separated subjects) keeps just those subjects of the sets' groups, e.g. one cell measured before
    and after a patch; a subject that none of the sets holds is an error, not an empty run."""
    keep = [s for s in only.split(",") if s]
    out = []
    for name in [n for n in names.split(",") if n]:
        if name not in SETS:
            raise ValueError(f"unknown cell set {name!r}; known: {', '.join(SETS)}")
        model, seq, batch, groups = SETS[name]
        if keep:
            groups = [kept for kept in ([s for s in g if s in keep] for g in groups) if kept]
        if groups:
            out.append((name, model, seq, batch, groups))
    if not out:
        raise ValueError("no cell set given")
    held = {s for *_, groups in out for g in groups for s in g}
    missing = [s for s in keep if s not in held]
    if missing:
        raise ValueError(f"--only {','.join(missing)}: not a subject of the sets {names}")
    return out


def flops_per_token(n_params_no_embedding, layers, hidden, seq):
    """Training FLOPs per token: 6 N (forward and backward of every weight matrix; N counts every parameter except
    the input embedding table, whose lookup multiplies nothing, and the experts a token is not routed to, the output
    head included) plus 12 L h s for the attention scores and their weighted sums (L layers, hidden size h, sequence
    length s; causal masking not discounted), as in the PaLM paper's appendix B."""
    return 6 * n_params_no_embedding + 12 * layers * hidden * seq
