"""With TORCH_CUDA_ARCH_LIST=9.0a (NVIDIA's CUDA 13 images set it on H100/H200), FusedAdam and the DeepCompile
op JIT-build and a DeepCompile ZeRO-1 training step runs. Upstream 0.19.8 fails in op_builder with
"invalid literal for int() with base 10: '0a'" before building anything."""

import math
import os

import pytest

from dist import run_distributed, skip_reason

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "workers", "arch_jit_step.py")


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    reason = skip_reason(1)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    import torch
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip(f"GPU test: 9.0a code runs on sm_90 (H100/H200) only, this is {torch.cuda.get_device_name()}")
    ext = os.environ.get("TORCH_EXTENSIONS_DIR") or str(tmp_path_factory.mktemp("torch_extensions"))
    return run_distributed(WORKER,
                           nprocs=1,
                           timeout=480,
                           env={
                               "TORCH_CUDA_ARCH_LIST": "9.0a",
                               "TORCH_EXTENSIONS_DIR": ext
                           })


def test_fused_adam_and_deepcompile_build_for_sm_90a_and_train(result):
    assert result.ok, result.failure_message()
    r = result.results[0]
    assert "invalid literal" not in result.output
    assert "-gencode=arch=compute_90a,code=sm_90a" in r["fused_adam_gencode"]
    assert r["optimizer"] == "FusedAdam"
    assert r["deepcompile_active"]
    assert len(r["losses"]) == 3 and all(math.isfinite(v) for v in r["losses"])
    assert r["losses"][-1] < r["losses"][0]
