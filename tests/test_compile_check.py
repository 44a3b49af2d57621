"""Compile-check the C++/CUDA sources patches touch: JIT-build ops from the installed wheel with nvcc, no GPU.

torch.cuda.is_available() is faked to True so that op_builder takes the GPU path (arch flags, nvcc), as it
does on a GPU host with TORCH_CUDA_ARCH_LIST=9.0a (the CUDA 13 image default). Loading the built module
needs a driver and may fail here; that the shared object was compiled and linked is what is checked."""

import glob
import os
import re
import shutil
import subprocess
import sys
import sysconfig

import pytest

CUDA_HOME = os.environ.get("CUDA_HOME", "/usr/local/cuda")
NVCC = shutil.which("nvcc") or os.path.join(CUDA_HOME, "bin", "nvcc")


def cuda_mismatch():
    """Why nvcc cannot build for the installed torch (torch.utils.cpp_extension refuses another CUDA major; CUDA's
    headers refuse an nvcc older than themselves), or None."""
    import torch
    out = subprocess.run([NVCC, "--version"], capture_output=True, text=True).stdout
    nvcc = re.search(r"release (\d+)\.(\d+)", out)
    if torch.version.cuda is None or nvcc is None:
        return f"no CUDA version to compare (torch {torch.__version__}, nvcc: {out.strip()[-80:]!r})"
    major = torch.version.cuda.split(".")[0]
    if nvcc.group(1) != major:
        return (f"nvcc {nvcc.group(1)}.{nvcc.group(2)} cannot build for torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}): the compile check of this torch needs a CUDA {major} compiler")
    torch_cuda = tuple(int(v) for v in torch.version.cuda.split(".")[:2])
    if (int(nvcc.group(1)), int(nvcc.group(2))) < torch_cuda:
        # The build includes the CUDA headers of torch's own nvidia packages; CCCL rejects an older nvcc with them
        # ("CUDA compiler and CUDA toolkit headers are incompatible"), as it would for a user with that toolchain.
        return (f"nvcc {nvcc.group(1)}.{nvcc.group(2)} is older than the CUDA {torch.version.cuda} of torch "
                f"{torch.__version__}, whose headers the build includes: the compile check needs nvcc >= "
                f"{torch.version.cuda}")
    return None


if not os.path.exists(NVCC):
    pytestmark = pytest.mark.skip(reason="nvcc not found (set CUDA_HOME): the compile check needs the CUDA compiler")
elif cuda_mismatch():
    pytestmark = pytest.mark.skip(reason=cuda_mismatch())

SCRIPT = """
import sys, torch
torch.cuda.is_available = lambda: True
from deepspeed.ops import op_builder
builder = getattr(op_builder, sys.argv[1])()
try:
    builder.jit_load(verbose=True)
except Exception as e:  # compile errors are judged by the missing .so and the log
    print(f"jit_load raised {type(e).__name__}: {e}")
"""


def jit_build(builder, name, tmp_path):
    site = sysconfig.get_paths()["purelib"]
    includes = [os.path.join(site, "nvidia", "cu13", "include"), os.path.join(site, "nvidia", "nccl", "include")]
    env = dict(os.environ, DS_ACCELERATOR="cuda", CUDA_HOME=CUDA_HOME, TORCH_CUDA_ARCH_LIST="9.0a",
               TORCH_EXTENSIONS_DIR=str(tmp_path), MAX_JOBS=str(os.cpu_count() or 2),
               CPATH=":".join(includes + [os.environ.get("CPATH", "")]))
    proc = subprocess.run([sys.executable, "-c", SCRIPT, builder], capture_output=True, text=True, env=env,
                          timeout=1800)
    log = proc.stdout + proc.stderr
    assert "invalid literal for int()" not in log
    built = glob.glob(os.path.join(str(tmp_path), name, f"{name}*.so"))
    assert built, f"{builder} did not compile:\n{log[-6000:]}"
    with open(os.path.join(str(tmp_path), name, "build.ninja")) as f:
        return f.read()


def test_fused_adam_builds_for_sm_90a(tmp_path):
    ninja = jit_build("FusedAdamBuilder", "fused_adam", tmp_path)
    assert "arch=compute_90a,code=sm_90a" in ninja


def test_deepcompile_op_builds(tmp_path):
    jit_build("DeepCompileBuilder", "dc", tmp_path)
