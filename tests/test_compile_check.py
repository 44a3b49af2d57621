"""Compile-check the C++/CUDA sources patches touch: JIT-build ops from the installed wheel with nvcc, no GPU.

torch.cuda.is_available() is faked to True so that op_builder takes the GPU path (arch flags, nvcc), as it
does on a GPU host with TORCH_CUDA_ARCH_LIST=9.0a (the CUDA 13 image default). Loading the built module
needs a driver and may fail here; that the shared object was compiled and linked is what is checked.

A build that succeeded is recorded in the test environment under a key of everything that decides it (the op
sources, builders and accelerator code the wheel ships, the compilers, the torch and CUDA packages whose headers it
includes, the build's environment): a later run with the same key reads that record instead of compiling again, as
ccache would (the DeepCompile op takes about 8 minutes of a 2-core host). Any patch to those files, or another
compiler or torch, builds again. COMPILE_CHECK_CACHE=0 always builds."""

import glob
import hashlib
import importlib.metadata
import importlib.util
import json
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


def build_env(tmp_path):
    site = sysconfig.get_paths()["purelib"]
    includes = [os.path.join(site, "nvidia", "cu13", "include"), os.path.join(site, "nvidia", "nccl", "include")]
    return dict(os.environ, DS_ACCELERATOR="cuda", CUDA_HOME=CUDA_HOME, TORCH_CUDA_ARCH_LIST="9.0a",
                TORCH_EXTENSIONS_DIR=str(tmp_path), MAX_JOBS=str(os.cpu_count() or 2),
                CPATH=":".join(includes + [os.environ.get("CPATH", "")]))


KEYED = ("ops/csrc", "ops/op_builder", "accelerator")  # of the installed deepspeed: what a build reads or is told


def build_key(builder, env, root=None):
    """sha256 of everything that decides whether `builder` compiles here, and how."""
    import torch
    h = hashlib.sha256()
    # Found, not imported: deepspeed imported here would pick this process's accelerator (tests/conftest.py's FIRST).
    root = root or importlib.util.find_spec("deepspeed").submodule_search_locations[0]
    for sub in KEYED:
        for dirpath, dirnames, filenames in os.walk(os.path.join(root, sub)):
            dirnames[:] = sorted(d for d in dirnames if d != "__pycache__")  # in place: the walk follows it
            for name in sorted(filenames):
                path = os.path.join(dirpath, name)
                h.update(os.path.relpath(path, root).encode() + b"\0")
                with open(path, "rb") as f:
                    h.update(hashlib.sha256(f.read()).digest())
    tools = [subprocess.run([cmd, "--version"], capture_output=True, text=True).stdout for cmd in (NVCC, "c++")]
    packages = sorted(f"{d.metadata['Name']}=={d.version}" for d in importlib.metadata.distributions()
                      if (d.metadata["Name"] or "").lower().startswith(("nvidia", "torch")))
    setting = {k: env.get(k, "") for k in ("TORCH_CUDA_ARCH_LIST", "CPATH", "CUDA_HOME", "CXX", "NVCC_FLAGS")}
    h.update(json.dumps([builder, SCRIPT, torch.__version__, torch.version.cuda, sys.version, tools, packages,
                         setting]).encode())
    return h.hexdigest()


def jit_build(builder, name, tmp_path):
    """The build.ninja of a JIT build of `builder` that compiled and linked (compiled now, or recorded by an earlier
    run under the same key)."""
    env = build_env(tmp_path)
    record = os.path.join(sys.prefix, "compile-check", f"{builder}-{build_key(builder, env)[:32]}.json")
    if os.environ.get("COMPILE_CHECK_CACHE") != "0" and os.path.exists(record):
        with open(record) as f:
            return json.load(f)["build.ninja"]
    proc = subprocess.run([sys.executable, "-c", SCRIPT, builder], capture_output=True, text=True, env=env,
                          timeout=1800)
    log = proc.stdout + proc.stderr
    assert "invalid literal for int()" not in log
    built = glob.glob(os.path.join(str(tmp_path), name, f"{name}*.so"))
    assert built, f"{builder} did not compile:\n{log[-6000:]}"
    with open(os.path.join(str(tmp_path), name, "build.ninja")) as f:
        ninja = f.read()
    os.makedirs(os.path.dirname(record), exist_ok=True)
    with open(record + ".tmp", "w") as f:
        json.dump({"built": [os.path.basename(p) for p in built], "build.ninja": ninja}, f)
    os.replace(record + ".tmp", record)  # whole or not at all
    return ninja


def test_fused_adam_builds_for_sm_90a(tmp_path):
    ninja = jit_build("FusedAdamBuilder", "fused_adam", tmp_path)
    assert "arch=compute_90a,code=sm_90a" in ninja


def test_deepcompile_op_builds(tmp_path):
    jit_build("DeepCompileBuilder", "dc", tmp_path)


def test_a_changed_source_or_setting_builds_again(tmp_path):
    """The record of an earlier build stands only for the same sources and settings."""
    installed = importlib.util.find_spec("deepspeed").submodule_search_locations[0]
    root = tmp_path / "deepspeed"
    for sub in KEYED:
        shutil.copytree(os.path.join(installed, sub), root / sub, ignore=shutil.ignore_patterns("__pycache__"))
    env = build_env(tmp_path)
    key = build_key("DeepCompileBuilder", env, str(root))
    assert build_key("DeepCompileBuilder", env, str(root)) == key
    # Python's bytecode of the builders, written as they are imported, is not a source.
    (root / "ops" / "op_builder" / "__pycache__").mkdir(exist_ok=True)
    (root / "ops" / "op_builder" / "__pycache__" / "builder.cpython-311.pyc").write_bytes(b"\0")
    assert build_key("DeepCompileBuilder", env, str(root)) == key
    source = root / "ops" / "csrc" / "compile" / "z3.cpp"
    source.write_bytes(source.read_bytes() + b"\n")
    assert build_key("DeepCompileBuilder", env, str(root)) != key
    source.write_bytes(source.read_bytes()[:-1])
    assert build_key("DeepCompileBuilder", env, str(root)) == key
    assert build_key("DeepCompileBuilder", dict(env, TORCH_CUDA_ARCH_LIST="9.0"), str(root)) != key
    assert build_key("FusedAdamBuilder", env, str(root)) != key
