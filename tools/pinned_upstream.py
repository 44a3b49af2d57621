"""Upstream's pinned release, installed for side-by-side runs (tools/zero-diff, tools/bench: --site LABEL=pinned)."""

import os
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
