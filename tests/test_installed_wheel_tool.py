"""tools/installed_wheel.py: tools/run-tests reinstalls the wheel it built only where another is installed, or the
installed files were changed since."""

import base64
import hashlib
import os
import sys
import zipfile

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
import installed_wheel  # noqa: E402


def _hash(data):
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _install(site, files):
    """A distribution `wheeltoolprobe` 1.0 in `site` as pip leaves one: its files and a RECORD of their hashes."""
    record = ""
    for name, data in files.items():
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(data)
        record += f"{name},{_hash(data)},{len(data)}\n"
    (site / "wheeltoolprobe-1.0.dist-info").mkdir(exist_ok=True)
    (site / "wheeltoolprobe-1.0.dist-info" / "RECORD").write_text(record + "wheeltoolprobe-1.0.dist-info/RECORD,,\n")


def _wheel(path, marker):
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("wheeltoolprobe/__init__.py", marker)
        z.writestr("wheeltoolprobe-1.0.dist-info/RECORD", "")
    return str(path)


def test_the_same_wheel_untouched_is_not_installed_again(tmp_path, monkeypatch):
    site = tmp_path / "site"
    monkeypatch.syspath_prepend(str(site))
    _install(site, {"wheeltoolprobe/__init__.py": b"x = 1\n", "wheeltoolprobe/op.cpp": b"int f();\n"})
    wheel, stamp = _wheel(tmp_path / "a.whl", "x = 1\n"), str(tmp_path / "stamp")
    assert not installed_wheel.installed(wheel, stamp), "no stamp: nothing is known to be installed"
    with open(stamp, "w") as f:
        f.write(installed_wheel._stamp(wheel))
    assert installed_wheel.installed(wheel, stamp)
    os.utime(site / "wheeltoolprobe" / "op.cpp", (0, 0))  # times are not contents
    assert installed_wheel.installed(wheel, stamp)
    # other bytes of the wheel (another patch series): installed again
    assert not installed_wheel.installed(_wheel(tmp_path / "b.whl", "x = 2\n"), stamp)
    # an installed file changed since: installed again
    (site / "wheeltoolprobe" / "op.cpp").write_bytes(b"int g();\n")
    assert not installed_wheel.installed(wheel, stamp)
    # another install of the project since the stamp (another RECORD): installed again
    _install(site, {"wheeltoolprobe/__init__.py": b"x = 1\n", "wheeltoolprobe/op.cpp": b"int g();\n"})
    assert installed_wheel._files_intact(installed_wheel._distribution(wheel))
    assert not installed_wheel.installed(wheel, stamp)
