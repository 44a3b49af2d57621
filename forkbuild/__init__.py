"""Build a DeepSpeed wheel from the pinned upstream sdist plus this fork's patch series.

pin.py     reads pin.toml (which upstream sdist, its sha256, the fork release)
source.py  finds or downloads that sdist and verifies it
series.py  reads patches/series, DEP-3 headers, and applies patches with precise errors
stage.py   extracts, patches and stamps a fresh staging tree (all-or-nothing)
backend.py the PEP 517 hooks pip and `python -m build` call
pq.py      the developers' patch-queue tool (import / export / check / rebase)
"""


class ForkBuildError(Exception):
    """A build input is wrong. The message says which one and what to do."""
