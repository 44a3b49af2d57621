"""A tiny stand-in upstream ('fakeds') and a fork checkout around it, for testing the build pipeline fast."""

import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SETUP_PY = '''from setuptools import setup
version = open("version.txt").read().strip() + open("build.txt").read().strip()
setup(name="fakeds", version=version, packages=["fakeds"])
'''
MODULE = "def answer():\n    return 41\n"
KERNEL = "int kernel() { return 1; }\n"


def make_sdist(directory, version="1.0", module=MODULE):
    """fakeds-<version>.tar.gz with a setup.py that reads version.txt + build.txt, like DeepSpeed's."""
    base = f"fakeds-{version}"
    files = {
        "setup.py": SETUP_PY, "version.txt": version + "\n", "build.txt": " ", "fakeds/__init__.py": module,
        "csrc/kernel.cpp": KERNEL, "fakeds/ops/csrc/kernel.cpp": KERNEL
    }
    path = os.path.join(directory, base + ".tar.gz")
    with tarfile.open(path, "w:gz") as tar:
        for name, text in sorted(files.items()):
            info = tarfile.TarInfo(f"{base}/{name}")
            data = text.encode()
            info.size, info.mtime = len(data), 1700000000
            tar.addfile(info, io.BytesIO(data))
    return path


def sha256(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def header(title, extra=""):
    return (f"Description: {title}\nAuthor: test\nBug: https://example.invalid/fakeds/issues/1\nForwarded: no\n"
            f"Last-Update: 2026-11-22\nX-Reach: every-engine\n{extra}---\n")


ANSWER_PATCH = header("answer 42") + """--- a/fakeds/__init__.py
+++ b/fakeds/__init__.py
@@ -1,2 +1,2 @@
 def answer():
-    return 41
+    return 42
"""


def make_fork(root, sdist, patches=None, release=3, sha=None, mirrors=True):
    """A fork checkout: forkbuild + pyproject from this repo, a pin for `sdist`, and the given patches."""
    os.makedirs(root)
    shutil.copytree(os.path.join(REPO, "forkbuild"), os.path.join(root, "forkbuild"),
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(os.path.join(REPO, "pyproject.toml"), root)
    name = os.path.basename(sdist)
    version = name[len("fakeds-"):-len(".tar.gz")]
    with open(os.path.join(root, "pin.toml"), "w") as f:
        f.write(f'[upstream]\nname = "fakeds"\nversion = "{version}"\nsdist = "{name}"\n'
                f'sha256 = "{sha or sha256(sdist)}"\nurl = "http://127.0.0.1:9/{name}"\n' +
                ('mirrors = ["csrc:fakeds/ops/csrc"]\n' if mirrors else "") + f"\n[fork]\nrelease = {release}\n")
    os.makedirs(os.path.join(root, "patches"))
    patches = {"answer.patch": ANSWER_PATCH} if patches is None else patches
    for pname, text in patches.items():
        with open(os.path.join(root, "patches", pname), "w") as f:
            f.write(text)
    with open(os.path.join(root, "patches", "series"), "w") as f:
        f.write("".join(n + "\n" for n in patches))
    return root


def build_env(tmp_path):
    """An environment for a build of its own: no DS_FORK_* of the caller's, a temporary folder and a sdist cache
    inside `tmp_path` (so that what a failed build leaves behind can be checked)."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("DS_FORK_")}
    env.update(TMPDIR=str(tmp), DS_FORK_CACHE=str(tmp_path / "cache"))
    return env


def pip_wheel(root, out, env=None):
    """Build the fork at `root` the way a user does (pip, PEP 517) and return the CompletedProcess."""
    return subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-w", out, root],
                          capture_output=True, text=True, env=env, timeout=300)
