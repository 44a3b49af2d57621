"""DeepSpeed configs of the GPU workers: one builder instead of a dictionary per worker."""


def zero_adamw(stage, micro_batch, grad_acc, lr, deepcompile=False, bf16=False, clip=None):
    """ZeRO `stage` with torch's AdamW (no weight decay). Every ZeRO-3 parameter is partitioned
    (`stage3_param_persistence_threshold` 0): the workers' models are tiny, and would otherwise stay gathered."""
    cfg = {
        "train_micro_batch_size_per_gpu": micro_batch,
        "gradient_accumulation_steps": grad_acc,
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": lr,
                "weight_decay": 0.0,
                "torch_adam": True
            }
        },
        "zero_optimization": {
            "stage": stage,
            "stage3_param_persistence_threshold": 0
        },
        "steps_per_print": 1_000_000_000,
    }
    if clip is not None:
        cfg["gradient_clipping"] = clip
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if deepcompile:
        cfg["compile"] = {"deepcompile": True}
    return cfg
