"""The real build: reproducible wheels, and the fork's own sdist building the same wheel offline."""

import hashlib
import os
import subprocess
import sys
import tarfile
import zipfile


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def pip_wheel(src, out, env=None, isolation=True):
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out), str(src)]
    proc = subprocess.run(cmd + ([] if isolation else ["--no-build-isolation"]), capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl, ) = [os.path.join(out, n) for n in os.listdir(out) if n.endswith(".whl")]
    return whl


def contents(whl):
    """Every file of a wheel but the two that name the build tool's version."""
    with zipfile.ZipFile(whl) as z:
        return {n: z.read(n) for n in z.namelist() if not n.endswith(("dist-info/WHEEL", "dist-info/RECORD"))}


def test_two_builds_give_byte_identical_wheels(repo_root, fork_wheel, pin, tmp_path):
    first = pip_wheel(repo_root, tmp_path / "a")
    second = pip_wheel(repo_root, tmp_path / "b")
    assert os.path.basename(first) == f"deepspeed-{pin.fork_version}-py3-none-any.whl"
    assert sha256(first) == sha256(second) == sha256(fork_wheel)


def test_fork_sdist_builds_the_same_wheel_offline(repo_root, pin, tmp_path):
    def sdist(out):
        subprocess.run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "-o", str(out), repo_root],
                       check=True, capture_output=True)
        (path, ) = out.glob("*.tar.gz")
        return path

    path = sdist(tmp_path / "s1")
    assert path.name == f"deepspeed-{pin.fork_version}.tar.gz"
    assert sha256(path) == sha256(sdist(tmp_path / "s2"))
    with tarfile.open(path) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames()}
        tar.extractall(tmp_path / "x", filter="data")
    assert {"PKG-INFO", "pin.toml", "pyproject.toml", "patches/series", "forkbuild/backend.py",
            f"upstream/{pin.sdist}"} <= names
    assert not [n for n in names if n.startswith(("tests/", ".github/", ".ci/"))]

    offline = {k: v for k, v in os.environ.items() if not k.startswith("DS_FORK_")}
    offline.update(DS_FORK_OFFLINE="1", PIP_NO_INDEX="1", DS_FORK_CACHE=str(tmp_path / "empty-cache"))
    whl = pip_wheel(tmp_path / "x" / f"deepspeed-{pin.fork_version}", tmp_path / "w", offline, isolation=False)
    # Without build isolation upstream's setup.py sees this environment's torch (version info, an extra
    # nvidia-ml-py requirement on CUDA builds), so the reference is built from the checkout the same way.
    reference = pip_wheel(repo_root, tmp_path / "r", isolation=False)
    assert contents(whl) == contents(reference)
