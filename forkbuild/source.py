"""Find the pinned upstream sdist (or download it) and verify its sha256.

Looked for, in order:
  1. $DS_FORK_SDIST                   an explicit path to the file
  2. <source>/upstream/<sdist>         bundled in the fork's own sdist, so that builds offline
  3. $DS_FORK_CACHE/<sdist>            default ~/.cache/deepspeed-fork (or $XDG_CACHE_HOME/deepspeed-fork)
  4. download into that cache from $DS_FORK_SDIST_URL, else the pin's url, else the file of that name on
     the package index ($PIP_INDEX_URL, default PyPI), unless $DS_FORK_OFFLINE=1 or $PIP_NO_INDEX is set.
A file that is found but does not match the pinned sha256 is an error, never skipped.
"""

import hashlib
import html
import os
import re
import shutil
import tempfile
import urllib.parse
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


def index_url(pin):
    """The sdist's address on the package index's simple page (PEP 503), or None."""
    index = (os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple").rstrip("/")
    page_url = f"{index}/{pin.name}/"
    with urllib.request.urlopen(page_url, timeout=60) as resp:
        page = resp.read().decode("utf-8", "replace")
    for href in re.findall(r'href="([^"]+)"', page):
        href = html.unescape(href)
        if urllib.parse.urlparse(href).path.rsplit("/", 1)[-1] == pin.sdist:
            return urllib.parse.urljoin(page_url, href.split("#", 1)[0])
    return None


def fetch(url, dest):
    with open(dest, "wb") as out, urllib.request.urlopen(url, timeout=60) as resp:
        shutil.copyfileobj(resp, out, 1 << 20)


def download(pin, dest):
    """Download to a temporary name next to `dest`; only a verified file takes the final name."""
    os.makedirs(os.path.dirname(dest), exist_ok=True)
    tried = []
    for url in (os.environ.get("DS_FORK_SDIST_URL") or pin.url, None):
        fd, tmp = tempfile.mkstemp(prefix=".download-", dir=os.path.dirname(dest))
        os.close(fd)
        try:
            url = url or index_url(pin)
            if url is None:
                tried.append(f"no {pin.sdist} on the package index")
                continue
            fetch(url, tmp)
            verify(pin, tmp, f"downloaded from {url}")
            os.replace(tmp, dest)
            return dest
        except OSError as e:
            tried.append(f"{url or 'package index'}: {e}")
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    raise ForkBuildError(f"could not download {pin.sdist}:\n  " + "\n  ".join(tried) +
                         f"\nPut it in {os.path.dirname(dest)} or point DS_FORK_SDIST at it.")


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
