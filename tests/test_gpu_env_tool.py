"""tools/gpu-env on a GPU host: a site that already holds the wheelhouse's fork release is left as it is.

Installing the same wheel again at every command renewed the times of its sources, and the next command JIT-built
DeepCompile's op again: about 45 s of device time a command on a warm H200 host (docs/warmup.md's runs)."""

import base64
import hashlib
import os
import subprocess
import zipfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def fake_wheel(folder, version):
    """A wheel named deepspeed at `version` holding one source file."""
    files = {"deepspeed/__init__.py": f"__version__ = '{version}'\n",
             f"deepspeed-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: deepspeed\nVersion: {version}\n",
             f"deepspeed-{version}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\n"
                                                     "Tag: py3-none-any\n"}

    def digest(text):
        return base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).decode().rstrip("=")

    record = "".join(f"{name},sha256={digest(text)},{len(text.encode())}\n" for name, text in files.items())
    files[f"deepspeed-{version}.dist-info/RECORD"] = record + f"deepspeed-{version}.dist-info/RECORD,,\n"
    path = folder / f"deepspeed-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
    return path


def source_gpu_env(wheelhouse, site):
    proc = subprocess.run(["bash", "-c", f". tools/gpu-env {wheelhouse} {site}"], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_the_same_release_is_not_installed_again_and_a_new_one_is(tmp_path):
    wheelhouse, site = tmp_path / "wh", tmp_path / "site"
    wheelhouse.mkdir()
    old = fake_wheel(wheelhouse, "0.0.1+fork.1")
    assert "deepspeed-0.0.1+fork.1" in source_gpu_env(wheelhouse, site)
    source = site / "deepspeed" / "__init__.py"
    installed_at = source.stat().st_mtime_ns
    os.utime(source, ns=(installed_at - 10**9, installed_at - 10**9))  # a second earlier: any rewrite shows
    said = source_gpu_env(wheelhouse, site)
    assert "deepspeed-" not in said, said
    assert source.stat().st_mtime_ns == installed_at - 10**9, "the same release was installed again"
    old.unlink()
    fake_wheel(wheelhouse, "0.0.1+fork.2")
    assert "deepspeed-0.0.1+fork.2" in source_gpu_env(wheelhouse, site)
    assert "fork.2" in source.read_text()
