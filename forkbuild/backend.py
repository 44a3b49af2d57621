"""PEP 517 build backend: the fork's wheel is upstream's setup.py run on the patched, stamped staging tree."""

import gzip
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile

from . import ForkBuildError, pin as pin_mod, series, source, stage

# What the fork's own sdist holds besides PKG-INFO and upstream/<pinned sdist> (which makes it build offline).
SDIST_CONTENT = ("pyproject.toml", "pin.toml", "README.md", "patches", "forkbuild")
SDIST_EPOCH = 315532800  # 1980-01-01: fixed, so two sdists are byte-identical
RUN_SETUP = "import sys; from setuptools.build_meta import __legacy__ as b; print(b.build_wheel(sys.argv[1]))"


def _root():
    return os.getcwd()  # PEP 517 runs hooks in the source tree


def _epoch(tree):
    """A build timestamp that depends only on the pinned sdist, so two builds are byte-identical."""
    return os.environ.get("SOURCE_DATE_EPOCH") or str(int(os.stat(os.path.join(tree, "version.txt")).st_mtime))


def _setup_env(tree):
    env = series.git_env(tree)  # upstream's setup.py asks git for a hash: it must not see an enclosing repo
    env.pop("DS_BUILD_STRING", None)  # the version label is ours (build.txt)
    env["SOURCE_DATE_EPOCH"] = _epoch(tree)
    env["PYTHONDONTWRITEBYTECODE"] = "1"
    env["PYTHONHASHSEED"] = "0"  # setup.py builds the [all] extra from a set
    return env


def _publish(src, directory):
    """Move a finished file into `directory` under its final name only when it is complete."""
    os.makedirs(directory, exist_ok=True)
    name = os.path.basename(src)
    part = os.path.join(directory, f".{name}.part")
    shutil.copyfile(src, part)
    os.replace(part, os.path.join(directory, name))
    return name


def get_requires_for_build_wheel(config_settings=None):
    return []


def get_requires_for_build_sdist(config_settings=None):
    return []


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    try:
        with stage.staged_tree(_root()) as (pin, tree):
            out = os.path.join(os.path.dirname(tree), "dist")
            proc = subprocess.run([sys.executable, "-c", RUN_SETUP, out], cwd=tree, env=_setup_env(tree),
                                  stdout=sys.stderr)
            if proc.returncode != 0:
                raise ForkBuildError(f"upstream setup.py failed (exit {proc.returncode}); no wheel was written")
            wheels = [f for f in os.listdir(out) if f.endswith(".whl")]
            expected = f"{pin.name}-{pin.fork_version}-py3-none-any.whl"
            if wheels != [expected]:
                raise ForkBuildError(f"upstream setup.py produced {wheels}, expected [{expected}]")
            return _publish(os.path.join(out, expected), wheel_directory)
    except ForkBuildError as e:
        sys.stderr.write(f"\ndeepspeed fork build failed:\n{e}\n\n")
        raise


def _pkg_info(pin):
    return (f"Metadata-Version: 2.1\nName: {pin.name}\nVersion: {pin.fork_version}\n"
            f"Summary: DeepSpeed {pin.version} with the fork's patches (builds offline from this sdist)\n"
            "License: Apache-2.0\n").encode()


def build_sdist(sdist_directory, config_settings=None):
    """The fork's sdist: its own sources plus the verified upstream sdist, so that it builds offline."""
    root = _root()
    pin = pin_mod.load(root)
    series.read_series(os.path.join(root, "patches"))
    upstream = source.obtain(pin, root)
    base = f"{pin.name}-{pin.fork_version}"
    mtime = int(os.environ.get("SOURCE_DATE_EPOCH") or SDIST_EPOCH)
    files = []
    for entry in SDIST_CONTENT:
        path = os.path.join(root, entry)
        if os.path.isdir(path):
            for d, dirs, names in os.walk(path):
                dirs[:] = sorted(x for x in dirs if x != "__pycache__")
                files += [os.path.relpath(os.path.join(d, n), root) for n in sorted(names) if not n.endswith(".pyc")]
        elif os.path.isfile(path):
            files.append(entry)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, f"{base}.tar.gz")
        with open(out, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=mtime, filename="") as gz, \
                tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar:

            def add(arcname, data, mode=0o644):
                info = tarfile.TarInfo(f"{base}/{arcname}")
                info.size, info.mtime, info.mode = len(data), mtime, mode
                tar.addfile(info, io.BytesIO(data))

            add("PKG-INFO", _pkg_info(pin))
            for rel in files:
                with open(os.path.join(root, rel), "rb") as f:
                    add(rel, f.read())
            with open(upstream, "rb") as f:
                add(f"{source.BUNDLE_DIR}/{pin.sdist}", f.read())
        return _publish(out, sdist_directory)
