"""TORCH_CUDA_ARCH_LIST parsing of the installed op_builder (patch op-builder-arch-suffixes).

Upstream 0.19.8 raises "invalid literal for int() with base 10: '0a'" on every suffixed entry below."""

import os

import pytest


@pytest.fixture
def builder(monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")  # CUDA builders on a host without GPUs
    from deepspeed.ops.op_builder import FusedAdamBuilder

    def make(arch_list, jit=True):
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch_list)
        b = FusedAdamBuilder()
        b.jit_mode = jit
        args = b.compute_capability_args()
        return args, os.environ["TORCH_CUDA_ARCH_LIST"], b.enable_bf16

    return make


@pytest.mark.parametrize("given, handed_to_torch", [
    ("8.0;9.0", "8.0;9.0+PTX"),
    ("8.0 9.0", "8.0;9.0+PTX"),
    ("9.0;8.0;9.0", "8.0;9.0+PTX"),
    ("9.0a", "9.0a+PTX"),
    ("9.0a 9.0a", "9.0a+PTX"),
    ("9.0;9.0a", "9.0+PTX;9.0a"),
    ("12.0a;8.0;8.0+PTX", "8.0+PTX;12.0a"),
    ("10.0a;9.0a;8.6", "8.6+PTX;9.0a;10.0a"),
    ("8.0;9.0a+PTX", "8.0;9.0a+PTX"),
    ("7.0;8.0+ptx", "7.0;8.0+PTX"),  # 0.19.8 took a lowercase +ptx too
])
def test_jit_arch_list_keeps_suffixes_dedupes_and_orders(builder, given, handed_to_torch):
    args, env, _ = builder(given)
    assert env == handed_to_torch
    assert args == []  # PyTorch makes the -gencode flags from the list


@pytest.mark.parametrize("given", ["9.0a", "9.0;9.0a", "10.0a;12.0a", "8.0;9.0"])
def test_pytorch_extension_builder_accepts_the_list(builder, given):
    from torch.utils.cpp_extension import _get_cuda_arch_flags
    _, env, _ = builder(given)
    flags = _get_cuda_arch_flags()
    for entry in env.split(";"):
        num = entry.split("+")[0].replace(".", "")
        assert f"-gencode=arch=compute_{num},code=sm_{num}" in flags


def test_family_targets_get_explicit_gencode_flags(builder):
    from torch.utils.cpp_extension import _get_cuda_arch_flags
    args, env, _ = builder("10.0f;9.0")
    assert env == "9.0+PTX;10.0f"
    assert args == [
        "-gencode=arch=compute_90,code=sm_90", "-gencode=arch=compute_90,code=compute_90",
        "-gencode=arch=compute_100f,code=sm_100f"
    ]
    assert _get_cuda_arch_flags(args) == []  # explicit flags make PyTorch skip its own (it rejects 10.0f)


def test_cross_compile_flags_keep_suffixes(builder):
    args, env, _ = builder("8.0;9.0a+PTX;;10.0f", jit=False)
    assert env == "8.0;9.0a+PTX;10.0f"
    assert args == [
        "-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90a,code=sm_90a",
        "-gencode=arch=compute_90a,code=compute_90a", "-gencode=arch=compute_100f,code=sm_100f"
    ]


@pytest.mark.parametrize("given, bf16", [("9.0a", True), ("7.0;9.0a", False), ("8.0;10.0f", True)])
def test_bf16_detection_ignores_suffixes(builder, given, bf16):
    assert builder(given)[2] is bf16


@pytest.mark.parametrize("bad", ["9.x", "sm_90", "9.0b", "9"])
def test_invalid_entry_names_itself(builder, bad):
    with pytest.raises(ValueError, match=f"Invalid compute capability '{bad}'"):
        builder(f"8.0;{bad}")
