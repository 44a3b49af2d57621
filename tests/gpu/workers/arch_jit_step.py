"""Worker for test_arch_specific_jit.py: with TORCH_CUDA_ARCH_LIST=9.0a, JIT-build FusedAdam and the
DeepCompile op through op_builder and run training steps that use both (ZeRO-1, bf16), with DeepCompile
(`deepcompile` argument) or without it (`eager`, the reference)."""

import json
import os
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from dist import result_path  # noqa: E402

report = {"arch_list": os.environ.get("TORCH_CUDA_ARCH_LIST")}


def save():
    with open(result_path(), "w") as f:
        json.dump(report, f)


STEPS = 4


def main(mode):
    import deepspeed
    from deepspeed.ops.op_builder import DeepCompileBuilder, FusedAdamBuilder
    report["deepspeed"] = deepspeed.__version__
    report["device"] = torch.cuda.get_device_name()
    for name, builder in (("fused_adam", FusedAdamBuilder()), ("dc", DeepCompileBuilder())):
        start = time.time()
        builder.load()
        report[f"{name}_build_s"] = round(time.time() - start, 1)
        with open(os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], name, "build.ninja")) as f:
            report[f"{name}_gencode"] = sorted(set(w for w in f.read().split() if w.startswith("-gencode")))
    save()

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(512, 512) for _ in range(3)])
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "optimizer": {
            "type": "Adam",
            "params": {
                "lr": 1e-3
            }
        },  # FusedAdam on CUDA
        "bf16": {
            "enabled": True
        },
        "zero_optimization": {
            "stage": 1
        },
    }
    if mode == "deepcompile":
        config["compile"] = {"deepcompile": True}
    engine, optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    report["optimizer"] = type(optimizer.optimizer if hasattr(optimizer, "optimizer") else optimizer).__name__
    if mode == "deepcompile":
        engine.compile()
    x = torch.randn(8, 512, device=engine.device, dtype=torch.bfloat16)
    y = torch.randn(8, 512, device=engine.device, dtype=torch.bfloat16)
    losses = []
    for _ in range(STEPS):
        loss = torch.nn.functional.mse_loss(engine(x).float(), y.float())
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    report["losses"] = losses
    report["deepcompile_active"] = bool(getattr(engine, "is_deepcompile_active", lambda: False)())
    save()


if __name__ == "__main__":
    try:
        main(sys.argv[1])
    except BaseException:
        report["error"] = traceback.format_exc()
        save()
        raise
