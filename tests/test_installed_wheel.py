"""The installed deepspeed is the fork's wheel, says so, and keeps upstream's identity where others check it."""

import importlib.metadata
import os
import subprocess
import sys
import zipfile

import pytest
from packaging.version import Version


def test_deepspeed_is_imported_from_the_installed_wheel(repo_root, fork_wheel):
    import deepspeed
    assert not os.path.abspath(deepspeed.__file__).startswith(repo_root + os.sep + "deepspeed")
    dist = importlib.metadata.distribution("deepspeed")
    installed = {str(f) for f in dist.files}
    with zipfile.ZipFile(fork_wheel) as whl:
        packaged = {n for n in whl.namelist() if n.startswith("deepspeed/")}
    assert packaged <= installed
    assert os.path.realpath(str(dist.locate_file("deepspeed/__init__.py"))) == os.path.realpath(deepspeed.__file__)


def test_version_is_upstream_plus_fork_label(pin):
    import deepspeed
    assert deepspeed.__version__ == f"{pin.version}+fork.{pin.release}"
    assert importlib.metadata.version("deepspeed") == deepspeed.__version__
    v = Version(deepspeed.__version__)
    assert v.public == pin.version and v.local == f"fork.{pin.release}"


def test_downstream_version_checks_accept_the_fork(pin):
    from transformers.utils.versions import require_version
    from accelerate.utils import compare_versions
    require_version(f"deepspeed>={pin.version}")
    require_version("deepspeed>=0.9.3")
    assert compare_versions("deepspeed", ">=", pin.version)
    assert compare_versions("deepspeed", "<", "0.20")
    with pytest.raises(ImportError):
        require_version("deepspeed>=99")


def test_fork_info_lists_the_series(repo_root, pin):
    from deepspeed import fork_info
    from forkbuild import series
    assert fork_info.upstream_version == pin.version and fork_info.upstream_sha256 == pin.sha256
    assert [name for name, _ in fork_info.patches] == series.read_series(os.path.join(repo_root, "patches"))
    assert all(title for _, title in fork_info.patches)


def test_ds_report_names_upstream_base_and_patches(pin):
    from deepspeed import fork_info
    bindir = os.path.dirname(sys.executable)
    out = subprocess.run([os.path.join(bindir, "ds_report"), "--hide_operator_status"], capture_output=True,
                         text=True, timeout=300, env=dict(os.environ, DS_ACCELERATOR="cpu"))
    assert out.returncode == 0, out.stderr
    assert f"{pin.version}+fork.{pin.release}" in out.stdout
    base = [line for line in out.stdout.splitlines() if line.startswith("deepspeed upstream base")]
    assert base and pin.version in base[0] and pin.sha256 in base[0]
    assert f"{len(fork_info.patches)} applied" in out.stdout
    for name, title in fork_info.patches:
        assert f"{name}: {title}" in out.stdout


def test_wheel_dependencies_are_upstreams(fork_wheel, pin, tmp_path):
    """Requires-Dist of the fork's wheel equals that of upstream's setup.py run on the pristine sdist."""
    from forkbuild import source

    def requires(whl):
        with zipfile.ZipFile(whl) as z:
            meta = z.read(next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        return sorted(line for line in meta.splitlines() if line.startswith("Requires-Dist:"))

    sdist = source.obtain(pin, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(tmp_path), sdist], check=True,
                   capture_output=True)
    (upstream_wheel, ) = tmp_path.glob("deepspeed-*.whl")
    assert requires(fork_wheel) == requires(upstream_wheel)
