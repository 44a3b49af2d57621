"""Find the pinned upstream sdist (or download it) and verify its sha256.

Looked for, in order:
  1. $DS_FORK_SDIST                   an explicit path to the file
  2. <source>/upstream/<sdist>         bundled in the fork's own sdist, so that builds offline
  3. $DS_FORK_CACHE/<sdist>            default ~/.cache/deepspeed-fork (or $XDG_CACHE_HOME/deepspeed-fork)
  4. download from $DS_FORK_SDIST_URL or the pin's url into that cache, unless
     $DS_FORK_OFFLINE=1 or $PIP_NO_INDEX is set.
A file that is found but does not match the pinned sha256 is an error, never skipped.
"""

import hashlib
import os
import tempfile
import urllib.request

from . import ForkBuildError

BUNDLE_DIR = "upstream"


def sha256_of(path):
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def verify(pin, path, origin):
    actual = sha256_of(path)
    if actual != pin.sha256:
        raise ForkBuildError(f"sha256 mismatch for {path} ({origin}):\n  expected {pin.sha256} (pin.toml)\n"
                             f"  got      {actual}\nThe file is not the pinned {pin.sdist}; remove or replace it.")
    return path


def cache_dir():
    if os.environ.get("DS_FORK_CACHE"):
        return os.environ["DS_FORK_CACHE"]
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "deepspeed-fork")


def offline():
    return os.environ.get("DS_FORK_OFFLINE", "") not in ("", "0") or \
        os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on")


def download(pin, dest):
    url = os.environ.get("DS_FORK_SDIST_URL") or pin.url
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".download-", dir=os.path.dirname(dest))
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
            while True:
                block = resp.read(1 << 20)
                if not block:
                    break
                out.write(block)
        verify(pin, tmp, f"downloaded from {url}")
        os.replace(tmp, dest)
    except OSError as e:
        raise ForkBuildError(f"could not download {url}: {e}\nPut {pin.sdist} in {os.path.dirname(dest)} "
                             "or point DS_FORK_SDIST at it.") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return dest


def obtain(pin, source_root):
    """Return the path of a verified copy of the pinned sdist."""
    explicit = os.environ.get("DS_FORK_SDIST")
    if explicit:
        if not os.path.isfile(explicit):
            raise ForkBuildError(f"DS_FORK_SDIST={explicit}: no such file")
        return verify(pin, explicit, "DS_FORK_SDIST")
    bundled = os.path.join(source_root, BUNDLE_DIR, pin.sdist)
    if os.path.isfile(bundled):
        return verify(pin, bundled, "bundled in this source tree")
    cached = os.path.join(cache_dir(), pin.sdist)
    if os.path.isfile(cached):
        return verify(pin, cached, "cache")
    if offline():
        raise ForkBuildError(f"{pin.sdist} is not available offline: looked for DS_FORK_SDIST, {bundled} and "
                             f"{cached}.\nCopy the pinned file (sha256 {pin.sha256}) to one of them, "
                             "or allow downloads (unset DS_FORK_OFFLINE / PIP_NO_INDEX).")
    return download(pin, cached)
