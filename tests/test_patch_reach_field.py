"""X-Reach, whom a patch reaches: the build and `forkbuild.pq check` refuse a patch without it or with a value outside
forkbuild/series.py's REACH, naming the patch."""

import os
import subprocess
import sys

import pytest

import fakefork
from forkbuild import series

REACH_LINE = "X-Reach: every-engine\n"
UNREADABLE = {
    "missing": ("", "DEP-3 header lacks X-Reach"),
    "unknown": ("X-Reach: deepcompile, everyone\n", "X-Reach: unknown value 'everyone'"),
}


def answer_patch(reach):
    assert REACH_LINE in fakefork.ANSWER_PATCH
    return fakefork.ANSWER_PATCH.replace(REACH_LINE, reach)


@pytest.fixture
def env(tmp_path):
    return fakefork.build_env(tmp_path)


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_the_build_refuses_a_patch_whose_reach_it_cannot_read(tmp_path, env, case):
    reach, why = UNREADABLE[case]
    sdist = fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist, patches={"answer.patch": answer_patch(reach)})
    env["DS_FORK_SDIST"] = sdist
    out = tmp_path / "out"
    proc = fakefork.pip_wheel(root, str(out), env)
    assert proc.returncode != 0
    assert f"patch answer.patch: {why}" in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert not out.exists() or list(out.iterdir()) == []


@pytest.mark.parametrize("case", sorted(UNREADABLE))
def test_pq_check_names_the_patch_whose_reach_it_cannot_read(tmp_path, case):
    reach, why = UNREADABLE[case]
    sdist = fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist, patches={"answer.patch": answer_patch(reach)})
    env = dict(os.environ, DS_FORK_CACHE=str(tmp_path / "cache"), DS_FORK_SDIST=sdist)
    res = subprocess.run([sys.executable, "-m", "forkbuild.pq", "--root", root, "check"], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 1 and f"answer.patch: {why}" in res.stdout, res.stdout + res.stderr


@pytest.mark.parametrize("field, why", [
    ("X-Reach: every-engine\n", None),
    ("X-Reach: deepcompile, op-build (inert)\n Only DeepCompile calls the op.\n", None),
    ("X-Reach: Deepcompile\n", "X-Reach: unknown value 'Deepcompile'"),
    ("X-Reach: deepcompile (maybe)\n", "X-Reach: cannot read 'deepcompile (maybe)'"),
    ("X-Reach: \n", "X-Reach names no one"),
    ("X-Reach: deepcompile, deepcompile\n", "X-Reach: deepcompile listed twice"),
    ("X-Reach: deepcompile, op-build (inert)\n", "X-Reach: an inert value needs lines below the values"),
    ("X-Reach: op-build (inert)\n Nobody calls it.\n", "X-Reach: every value is inert"),
])
def test_reach_values_are_read_from_the_fixed_vocabulary(field, why):
    header = fakefork.header("answer 42").replace(REACH_LINE, field).removesuffix("---\n")
    problems = series.header_problems(header)
    assert (problems == []) if why is None else (len(problems) == 1 and problems[0].startswith(why)), problems


def test_every_patch_of_the_series_says_whom_it_reaches(repo_root):
    patches_dir = os.path.join(repo_root, "patches")
    for name in series.read_series(patches_dir):
        with open(os.path.join(patches_dir, name)) as f:
            header = series.split_patch(f.read())[0]
        assert series.reach_problem(header) is None, name
