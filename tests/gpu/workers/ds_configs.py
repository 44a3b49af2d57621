"""DeepSpeed configs of the GPU workers: one builder instead of a dictionary per worker."""


def zero(stage, micro_batch, grad_acc, lr, optimizer="Adam", deepcompile=False, bf16=True, clip=None,
         compile_options=None, **zero_options):
    """ZeRO `stage` with torch's Adam (the fix workers) or AdamW without weight decay (the model zoo); `zero_options`
    go into `zero_optimization` (reduce_bucket_size=..., stage3_param_persistence_threshold=0, ...), `compile_options`
    into DeepCompile's `compile` section."""
    params = {"lr": lr, "torch_adam": True} if optimizer == "Adam" else {"lr": lr, "weight_decay": 0.0, "torch_adam": True}
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
        "bf16": {
            "enabled": bf16
        },
        "optimizer": {
            "type": optimizer,
            "params": params
        },
        "zero_optimization": dict(stage=stage, **zero_options),
        "steps_per_print": 1_000_000_000,
    }
    if optimizer == "Adam":
        cfg["zero_allow_untested_optimizer"] = True
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if deepcompile:
        cfg["compile"] = {"deepcompile": True, **(compile_options or {})}
    return cfg
