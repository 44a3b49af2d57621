import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # forkbuild (the build pipeline) is tested from the checkout; deepspeed never is


@pytest.fixture(scope="session")
def repo_root():
    return REPO


@pytest.fixture(scope="session")
def pin():
    from forkbuild import pin as pin_mod
    return pin_mod.load(REPO)


@pytest.fixture(scope="session")
def fork_wheel():
    """The wheel tools/run-tests built and installed; tests of deepspeed run against that install."""
    path = os.environ.get("FORK_WHEEL")
    if not path or not os.path.isfile(path):
        pytest.fail("FORK_WHEEL is not set: run the suite with tools/run-tests, which builds and installs the wheel")
    return path
