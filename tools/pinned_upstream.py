"""Upstream's pinned release, installed for side-by-side runs (tools/zero-diff, tools/bench: --site LABEL=pinned)."""

import hashlib
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def site(out, label):
    """OUT/site-LABEL: a `pip install --target` of the pinned upstream sdist (the file the fork's build verifies, or
    $DS_FORK_SDIST), built on first use and reused after."""
    target = os.path.join(out, f"site-{label}")
    if not os.path.isdir(os.path.join(target, "deepspeed")):
        sys.path.insert(0, REPO)
        from forkbuild import pin, source
        sdist = source.obtain(pin.load(REPO), REPO)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target",
                        target, sdist], check=True)
    return target


def installed_versions(target):
    """The versions of the deepspeed dist-infos `pip install --target TARGET` put there."""
    try:
        names = os.listdir(target)
    except OSError:
        return []
    return [n[len("deepspeed-"):-len(".dist-info")] for n in names
            if n.startswith("deepspeed-") and n.endswith(".dist-info")]


def installed_version(target):
    """The version of the deepspeed installed in TARGET (None: none or several), without importing it: a record of a
    run whose processes never reported it (cut short before ready) still names what it measured."""
    versions = installed_versions(target)
    return versions[0] if len(versions) == 1 else None


def holds_upstream_release(target):
    """Whether the deepspeed that `pip install --target TARGET` put there is an upstream release (its dist-info
    version has no +fork), such as a wheel of 0.19.8 carried to a host without internet: its op builder needs
    plain_arch_list as much as a pinned site's does."""
    versions = installed_versions(target)
    return bool(versions) and all("+fork" not in v for v in versions)


def plain_arch_list(value):
    """TORCH_CUDA_ARCH_LIST without architecture suffixes ("9.0a;10.0f+PTX" -> "9.0;10.0+PTX"), or None if nothing
    changes. Upstream 0.19.8's op builder reads each entry as numbers and stops at a suffix (`invalid literal for
    int() with base 10: '0a'`, on hosts whose image sets 9.0a); the fork's patch op-builder-arch-suffixes fixes that.
    A JIT-built op of the pinned release is built for the plain architecture instead."""
    if not value:
        return None
    plain = re.sub(r"(\d+\.\d+)[a-zA-Z]+", r"\1", value)
    return plain if plain != value else None


def site_env(site, upstream):
    """What a process importing the deepspeed installed in `site` (a `pip install --target` folder) ahead of the
    importable one needs in its environment: the site first on PYTHONPATH; a JIT build folder of its own, since
    deepspeed builds each op under one name in every version and two versions sharing a folder rebuild over each
    other; and, where `upstream` (an upstream release), TORCH_CUDA_ARCH_LIST without architecture suffixes.
    A site is taken by its real path: reached through a link, it shares the build folder of the folder linked to, and
    its ops' sources have the same paths there, so ninja finds them built (a build is a minute of CPU a site)."""
    site = os.path.realpath(site)
    env = {"PYTHONPATH": os.pathsep.join(p for p in (site, os.environ.get("PYTHONPATH")) if p)}
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.expanduser("~/.cache/torch_extensions")
    env["TORCH_EXTENSIONS_DIR"] = os.path.join(base, "site-" + hashlib.sha1(site.encode()).hexdigest()[:10])
    plain = plain_arch_list(os.environ.get("TORCH_CUDA_ARCH_LIST")) if upstream else None
    if plain:
        env["TORCH_CUDA_ARCH_LIST"] = plain
    return env
