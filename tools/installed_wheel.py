"""Whether the wheel tools/run-tests built is the one installed in its environment already, so that it is reinstalled
only when it differs.

  python tools/installed_wheel.py check WHEEL STAMP   exit 0 if STAMP says WHEEL (these bytes) was installed, the
                                                      installed distribution is still that install (its RECORD), and
                                                      every file of it holds the bytes its RECORD gives; else 1
  python tools/installed_wheel.py stamp WHEEL STAMP   after installing WHEEL: write STAMP

A reinstall of the same bytes gives every file a new modification time, and ninja then builds DeepSpeed's JIT ops
again (the CPU communication op: about 100 s of CPU at the start of every suite run, while the processes that need
the op wait for it). The wheel's build is reproducible (tests/test_build_pipeline.py): the same patches give the same
bytes, and other patches another wheel, which is installed.
"""

import base64
import csv
import hashlib
import importlib.metadata
import io
import os
import sys
import zipfile


def _sha256(data):
    return hashlib.sha256(data).hexdigest()


def _distribution(wheel):
    """The installed distribution of `wheel`'s project, or None."""
    with zipfile.ZipFile(wheel) as z:
        record = next(n for n in z.namelist() if n.endswith(".dist-info/RECORD"))
    project = record.split("/")[0][:-len(".dist-info")].rsplit("-", 1)[0]
    try:
        return importlib.metadata.distribution(project)
    except importlib.metadata.PackageNotFoundError:
        return None


def _stamp(wheel):
    """'WHEEL-SHA256 RECORD-SHA256': the wheel's bytes and the RECORD of the distribution installed now."""
    dist = _distribution(wheel)
    record = (dist.read_text("RECORD") or "") if dist else ""
    with open(wheel, "rb") as f:
        return f"{_sha256(f.read())} {_sha256(record.encode())}"


def _files_intact(dist):
    """Every file the installed RECORD gives a hash has those bytes (pip writes the hashes of what it installed, the
    scripts with their rewritten first line included)."""
    for row in csv.reader(io.StringIO(dist.read_text("RECORD") or "")):
        if len(row) < 2 or not row[1]:
            continue
        algorithm, _, value = row[1].partition("=")
        try:
            with open(dist.locate_file(row[0]), "rb") as f:
                digest = hashlib.new(algorithm, f.read()).digest()
        except (OSError, ValueError):
            return False
        if base64.urlsafe_b64encode(digest).rstrip(b"=").decode() != value:
            return False
    return True


def installed(wheel, stamp):
    """Whether `wheel` is installed as STAMP recorded, its files untouched since."""
    try:
        with open(stamp) as f:
            recorded = f.read().strip()
    except OSError:
        return False
    dist = _distribution(wheel)
    return dist is not None and recorded == _stamp(wheel) and _files_intact(dist)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] not in ("check", "stamp"):
        sys.exit(__doc__)
    command, wheel, stamp = sys.argv[1:]
    if command == "check":
        sys.exit(0 if installed(wheel, stamp) else 1)
    with open(stamp + ".tmp", "w") as f:
        f.write(_stamp(wheel) + "\n")
    os.replace(stamp + ".tmp", stamp)
