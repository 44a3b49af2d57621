"""tests/conftest.py keeps the tests that share a module-scoped fixture on one pytest-xdist worker (tools/run-tests'
`--dist loadgroup`). Its groups were marked after pytest-xdist had read them, so every such fixture (two versions
training, say) ran once on each worker: about 100 s of tests/test_zero_compile_diff.py's, twice in each suite."""

import importlib.util
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))

CONFTEST = f"""
import importlib.util
spec = importlib.util.spec_from_file_location("suite_conftest", {os.path.join(HERE, "conftest.py")!r})
suite = importlib.util.module_from_spec(spec)
spec.loader.exec_module(suite)
pytest_collection_modifyitems = suite.pytest_collection_modifyitems
"""

SHARING = """
import os
import pytest


@pytest.fixture(scope="module")
def trained():
    with open(os.environ["SETUPS"], "a") as f:
        f.write(os.environ.get("PYTEST_XDIST_WORKER", "main") + "\\n")


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_stage(trained, stage):
    pass


def test_control(trained):
    pass
"""

ALONE = "import pytest\n\n\n@pytest.mark.parametrize('i', range(12))\ndef test_other(i):\n    pass\n"


def test_a_module_fixture_is_set_up_once_on_two_workers(tmp_path):
    if importlib.util.find_spec("xdist") is None:
        pytest.skip("pytest-xdist is not installed: tools/run-tests installs it (tests/requirements.txt)")
    (tmp_path / "conftest.py").write_text(CONFTEST)
    (tmp_path / "test_alone.py").write_text(ALONE)
    (tmp_path / "test_sharing.py").write_text(SHARING)
    setups = tmp_path / "setups"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist",
                           "loadgroup", "--no-loadscope-reorder", str(tmp_path)], cwd=tmp_path, capture_output=True,
                          text=True, env=dict(os.environ, SETUPS=str(setups)), timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "16 passed" in proc.stdout, proc.stdout
    assert len(setups.read_text().split()) == 1, f"set up on workers {setups.read_text().split()}"
