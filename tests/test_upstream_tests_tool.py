"""tools/upstream-tests on a tiny fake upstream tests/ tree and fake deepspeed packages (fast, CPU only)."""

import json
import re
import os
import subprocess
import sys
import tempfile
import textwrap
import xml.etree.ElementTree as ET

import pytest

import tool_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "upstream-tests")
sys.path.insert(0, os.path.join(REPO, "tools"))
from upstream_tests import report  # noqa: E402


def _load_tool():
    return tool_module.load("upstream-tests")


cli = _load_tool()

CONFTEST = """\
import os, sys
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # as upstream's does
{extra}
"""
PYTEST_INI = """\
[pytest]
addopts = -m "not sequential and not nightly"
markers =
    sequential: run alone
    nightly: not in CI
"""
TESTS = """\
import pytest
import deepspeed


def test_passes():
    assert deepspeed.__version__


def test_fails():
    assert deepspeed.missing_api()


@pytest.mark.skip(reason="needs a GPU")
def test_skips():
    pass


@pytest.mark.xfail(reason="upstream knows", strict=True)
def test_upstream_xfail():
    assert False


@pytest.mark.parametrize("n", [1, 2, 3])
def test_param(n):
    assert n != 3


@pytest.mark.sequential
def test_sequential():
    pass


@pytest.mark.nightly
def test_nightly():
    pass
"""
ALL_IDS = ["unit/test_a.py::test_fails", "unit/test_a.py::test_param[1]", "unit/test_a.py::test_param[2]",
           "unit/test_a.py::test_param[3]", "unit/test_a.py::test_passes", "unit/test_a.py::test_sequential",
           "unit/test_a.py::test_skips", "unit/test_a.py::test_upstream_xfail", "unit/test_broken.py"]
HONEST = """\
# the fake's known failures
unit/test_a.py::test_fails | calls an API this deepspeed lacks
unit/test_a.py::test_param[3] | parameter 3 fails
unit/test_broken.py | imports a module that is gone
"""


def _write(path, text):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.write(text)


def _fake_deepspeed(site, version):
    _write(os.path.join(site, "deepspeed", "__init__.py"), f"__version__ = {version!r}\n")


@pytest.fixture
def fake(tmp_path):
    """An upstream checkout (with its own deepspeed/ beside tests/) and a fork install in a --target dir."""
    checkout, site = tmp_path / "checkout", tmp_path / "site"
    _fake_deepspeed(str(checkout), "0.0.0-checkout")
    _fake_deepspeed(str(site), "0.19.8+fork.1")
    tests = checkout / "tests"
    _write(str(tests / "conftest.py"), CONFTEST.format(extra=""))
    _write(str(tests / "pytest.ini"), PYTEST_INI)
    _write(str(tests / "unit" / "test_a.py"), TESTS)
    _write(str(tests / "unit" / "test_broken.py"), "import deepspeed.gone\n")
    _write(str(tmp_path / "expected.txt"), HONEST)
    return tmp_path


def run_tool(fake, *args, expected=True, site="site", plain=True):
    cmd = [sys.executable, TOOL, str(fake / "checkout" / "tests"), "--matrix", "cpu", "--out", str(fake / "out")]
    if plain:  # no xdist, no pytest-forked: fast
        cmd += ["--workers", "0", "--no-forked"]
    if site:
        cmd += ["--deepspeed-path", str(fake / site)]
    if not expected:  # none, rather than the repository's file
        _write(str(fake / "none.txt"), "")
    cmd += ["--expected", str(fake / ("expected.txt" if expected else "none.txt"))]
    env = dict(os.environ, TMPDIR=str(fake))  # the staged tree and its lock file stay inside the test's directory
    res = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=120, env=env)
    summary = None
    if os.path.exists(fake / "out" / "summary.json"):
        with open(fake / "out" / "summary.json") as f:
            summary = json.load(f)
    return res, summary


def verdicts(summary):
    return {r["nodeid"]: r["verdict"] for r in summary["tests"]}


# --- end to end on the fake tree ----------------------------------------------------------------------------


def test_runs_the_installed_package_not_the_checkouts(fake):
    res, summary = run_tool(fake)
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary["info"]["deepspeed"] == "0.19.8+fork.1" and summary["target"] == "fork"
    assert os.path.realpath(summary["info"]["deepspeed_dir"]) == os.path.realpath(fake / "site" / "deepspeed")
    assert summary["counts"] == {"passed": 4, "failed": 0, "xfailed": 4, "skipped": 1, "unexpected-pass": 0}
    assert sorted(verdicts(summary)) == ALL_IDS  # both passes; nightly deselected as upstream's pytest.ini says
    assert verdicts(summary)["unit/test_a.py::test_upstream_xfail"] == "xfailed"
    assert verdicts(summary)["unit/test_broken.py"] == "xfailed"
    cases = {c.get("name"): c for c in ET.parse(fake / "out" / "junit.xml").iter("testcase")}
    assert len(cases) == len(ALL_IDS)
    assert cases["test_fails"].find("skipped").get("message") == "calls an API this deepspeed lacks"
    assert cases["test_passes"].find("skipped") is None and cases["test_passes"].find("failure") is None


def test_guard_stops_a_conftest_that_shadows_the_package(fake):
    _write(str(fake / "checkout" / "tests" / "conftest.py"),
           CONFTEST.format(extra=f"sys.path.insert(0, {str(fake / 'checkout')!r})"))
    res, summary = run_tool(fake)
    assert res.returncode == 2 and summary is None
    assert "deepspeed is imported from" in res.stderr and "shadows it" in res.stderr


def test_guard_refuses_a_package_inside_the_checkout(fake):
    res, _ = run_tool(fake, site="checkout")
    assert res.returncode == 2 and "lies inside the upstream checkout" in res.stderr


def test_a_pytest_that_misses_upstreams_distributed_fixtures_is_refused(fake):
    # From pytest 8.4 on, upstream's DistributedFixture fixtures are not found: every test taking one would fail at
    # setup ("fixture 'baseline_ws2' not found"), false failures charged to the package under test. The pytest the
    # test runs import (here a fake one first on their path) is checked before anything runs.
    _write(str(fake / "site" / "pytest" / "__init__.py"), "__version__ = '8.4.2'\n")
    res, summary = run_tool(fake)
    assert res.returncode == 2 and summary is None, res.stdout + res.stderr
    assert "pytest 8.4.2: upstream's tests need pytest < 8.4" in res.stderr, res.stderr


def test_unexpected_failure_and_unexpected_pass_exit_nonzero(fake):
    _write(str(fake / "expected.txt"), "unit/test_a.py::test_passes | wrongly listed\nunit/test_broken.py | gone\n")
    res, summary = run_tool(fake)
    assert res.returncode == 1
    v = verdicts(summary)
    assert v["unit/test_a.py::test_passes"] == "unexpected-pass" and v["unit/test_a.py::test_fails"] == "failed"
    assert "UNEXPECTED-PASS unit/test_a.py::test_passes" in res.stdout
    assert "FAILED unit/test_a.py::test_fails" in res.stdout


def test_fork_only_entries_do_not_apply_to_upstream(fake):
    fork_only = HONEST.replace("unit/test_a.py::test_fails |", "[fork] unit/test_a.py::test_fails |")
    _write(str(fake / "expected.txt"), fork_only)
    assert run_tool(fake, "--only", "test_fails")[0].returncode == 0
    _fake_deepspeed(str(fake / "site"), "0.19.8")
    res, summary = run_tool(fake, "--only", "test_fails")
    assert res.returncode == 1 and summary["target"] == "upstream"
    assert verdicts(summary) == {"unit/test_a.py::test_fails": "failed"}


def test_shards_partition_the_matrix(fake):
    seen = []
    for i in (1, 2, 3):
        res, summary = run_tool(fake, "--shard", f"{i}/3")
        assert res.returncode == 0, res.stdout + res.stderr
        seen.append(sorted(verdicts(summary)))
    assert [len(s) for s in seen] == [3, 3, 3]
    assert sorted(sum(seen, [])) == ALL_IDS


def test_only_narrows_the_selection(fake):
    res, summary = run_tool(fake, "--only", "test_param", "--only", "test_passes")
    assert res.returncode == 0
    assert sorted(verdicts(summary)) == ["unit/test_a.py::test_param[1]", "unit/test_a.py::test_param[2]",
                                         "unit/test_a.py::test_param[3]", "unit/test_a.py::test_passes"]


def test_stale_entry_fails_the_run(fake):
    _write(str(fake / "expected.txt"), HONEST + "unit/test_a.py::test_renamed | gone upstream\n")
    res, summary = run_tool(fake)
    assert res.returncode == 1 and summary["stale"] == ["line 5: unit/test_a.py::test_renamed"]


def test_xdist_and_forked_passes(fake):
    pytest.importorskip("xdist")
    pytest.importorskip("pytest_forked")
    res, summary = run_tool(fake, "--workers", "2", plain=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary["counts"]["xfailed"] == 4 and summary["counts"]["passed"] == 4


def test_gpu_compile_runs_launcher_scripts_not_collects_them(fake):
    tests = fake / "checkout" / "tests"
    _write(str(tests / "unit" / "v1" / "compile" / "test_c.py"), "def test_c():\n    pass\n")
    _write(str(tests / "torch_compile" / "test_compile.py"), "raise SystemExit('not a pytest file')\n")
    _write(str(tests / "torch_compile" / "test_deepcompile_z3_release.py"), "def test_z():\n    pass\n")
    res, summary = run_tool(fake, "--matrix", "gpu-compile", expected=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert verdicts(summary) == {"torch_compile/test_compile.py::launcher[ds_config_z2.json]": "skipped",
                                 "torch_compile/test_compile.py::launcher[ds_config_z3.json]": "skipped",
                                 "torch_compile/test_deepcompile_z3_release.py::test_z": "passed",
                                 "unit/v1/compile/test_c.py::test_c": "passed"}


DISTRIBUTED = """\
class DistributedTest:
    world_size = 2


class TestTwoRanks(DistributedTest):
    def test_a(self):
        pass

    def test_b(self):
        pass


class TestPlain:
    def test_c(self):
        pass


def test_d():
    pass
"""


def test_plan_and_shards_weigh_distributed_tests(fake):
    tests = fake / "checkout" / "tests"
    _write(str(tests / "unit" / "v1" / "zero" / "test_z.py"), DISTRIBUTED)
    res, _ = run_tool(fake, "--matrix", "gpu-zero", "--plan", "40", expected=False)
    # estimates: 30 s for each DistributedTest method, 2 s for the other two: 64 s, two shards of <= 40 s
    assert res.returncode == 0, res.stdout + res.stderr
    assert "4 node ids, estimated 64 s; 2 shards of at most 40 s" in res.stdout
    assert "shard 1/2: 2 node ids, estimated 32 s" in res.stdout and "shard 2/2: 2 node ids, estimated 32 s" in res.stdout
    res, _ = run_tool(fake, "--matrix", "gpu-zero", "--shard", "1/2", "--collect-only", expected=False)
    ids = [line for line in res.stdout.splitlines() if line.startswith("unit/")]
    assert len(ids) == 2 and sum("TestTwoRanks" in x for x in ids) == 1  # one distributed test per shard


def test_measured_durations_replace_estimates(fake):
    tests = fake / "checkout" / "tests"
    _write(str(tests / "unit" / "v1" / "zero" / "test_z.py"), DISTRIBUTED)
    measured = fake / "earlier.json"
    rows = [{"nodeid": "unit/v1/zero/test_z.py::TestTwoRanks::test_a", "seconds": 100.0, "message": ""},
            {"nodeid": "unit/v1/zero/test_z.py::TestTwoRanks::test_b", "seconds": 0.0, "message": "no result: x"}]
    _write(str(measured), json.dumps({"tests": rows}))
    res, _ = run_tool(fake, "--matrix", "gpu-zero", "--plan", "100", "--durations", str(measured), expected=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "estimated 134 s; 2 shards" in res.stdout and "shard 1/2: 1 node ids, estimated 100 s" in res.stdout


def test_merge_adds_up_shards(fake):
    dirs = []
    for i in (1, 2):
        run_tool(fake, "--shard", f"{i}/2")
        dirs.append(str(fake / f"out{i}"))
        os.rename(fake / "out", dirs[-1])
    res = subprocess.run([sys.executable, TOOL, "--merge"] + dirs, capture_output=True, text=True)
    assert res.returncode == 0 and "4 passed, 0 failed, 4 xfailed, 1 skipped, 0 unexpected-pass" in res.stdout


def test_the_repositorys_expected_failures_file():
    """Parses; uses only the documented tags; a fork-only entry names the patch of patches/series behind it."""
    entries = report.load(os.path.join(REPO, "tests", "upstream", "expected-failures.txt"))
    assert entries
    assert set().union(*(e.tags for e in entries)) <= {"fork", "upstream", "edaa722", "offline", "gpu-forked"}
    with open(os.path.join(REPO, "patches", "series")) as f:
        patches = [line.strip().removesuffix(".patch") for line in f if line.strip() and not line.startswith("#")]
    for e in entries:
        assert e.nodeid.startswith(("unit/", "torch_compile/")), e
        if "fork" in e.tags:
            assert any(f"patch {p} " in e.reason for p in patches), e


FAKE_ACCELERATOR = """\
import os, sys


class _Builder:
    def __init__(self, name):
        self.name = name

    def load(self):
        if self.name == "BrokenBuilder":
            raise ValueError("not implemented on this backend")
        with open(os.environ["FAKE_BUILD_LOG"], "a") as f:
            f.write(f"{self.name} {os.getcwd()}\\n")


class _Accelerator:
    def create_op_builder(self, name):
        return _Builder(name)


def get_accelerator():
    return _Accelerator()
"""


def test_prebuild_builds_in_the_same_staged_tree_each_run(fake, monkeypatch):
    _write(str(fake / "site" / "deepspeed" / "accelerator" / "__init__.py"), FAKE_ACCELERATOR)
    monkeypatch.setenv("FAKE_BUILD_LOG", str(fake / "builds.txt"))
    for _ in range(2):
        res, _ = run_tool(fake, "--prebuild", "BrokenBuilder", "FusedAdamBuilder", "--prebuild-only")
        assert res.returncode == 0, res.stdout + res.stderr
        assert "prebuilding BrokenBuilder failed" in res.stdout and "prebuilt FusedAdamBuilder" in res.stdout
    with open(fake / "builds.txt") as f:
        builds = f.read().split()
    assert builds[0::2] == ["FusedAdamBuilder", "FusedAdamBuilder"]
    # both runs built under one directory (build flags name it, so the second run reuses the first's ops)
    assert builds[1] == builds[3] and builds[1].endswith("/tests")


def test_staged_tree_is_fixed_per_package_unless_in_use(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    tests = tmp_path / "tests"
    _write(str(tests / "conftest.py"), "")
    root1, lock1 = cli.stage(str(tests), str(tmp_path / "pkg"))
    root2, lock2 = cli.stage(str(tests), str(tmp_path / "pkg"))  # while the first holds it
    other, lock3 = cli.stage(str(tests), str(tmp_path / "pkg2"))
    try:
        assert lock1 and lock2 is None and root2 != root1 and lock3 and other != root1
        assert os.path.isfile(os.path.join(root2, "tests", "conftest.py"))
    finally:
        for lock in (lock1, lock3):
            lock.close()
    root4, lock4 = cli.stage(str(tests), str(tmp_path / "pkg"))
    lock4.close()
    assert root4 == root1 and all(r.startswith(str(tmp_path)) for r in (root1, root2, other))


# --- the pieces ---------------------------------------------------------------------------------------------


def test_expected_file_format():
    entries = report.parse(textwrap.dedent("""\
        # comment

        unit/a.py::T::t[I am 6' tall] | needs libaio | and NVMe
        [fork] unit/v1/compile/test_f.py::test_g | the fork's end_backward takes two arguments
        [upstream,offline] unit/b/ | downloads a model
        """))
    assert [(e.nodeid, e.tags, e.line) for e in entries] == [
        ("unit/a.py::T::t[I am 6' tall]", frozenset(), 3),
        ("unit/v1/compile/test_f.py::test_g", {"fork"}, 4),
        ("unit/b/", {"upstream", "offline"}, 5)]
    assert entries[0].reason == "needs libaio | and NVMe"
    for bad in ("unit/a.py::t\n", "unit/a.py::t | \n", "[fork unit/a.py::t | r\n", "a.py | r\na.py | r2\n"):
        with pytest.raises(ValueError):
            report.parse(bad)


def test_entries_match_at_node_id_boundaries_and_the_longest_wins():
    entries = report.parse("unit/a.py::T | class\nunit/a.py::T::t[1] | one\nunit/b | dir\n[fork] unit/c.py | c\n")
    assert report.lookup(entries, "unit/a.py::T::t[1]", frozenset()).reason == "one"
    assert report.lookup(entries, "unit/a.py::T::t[2]", frozenset()).reason == "class"
    assert report.lookup(entries, "unit/a.py::Tx::t", frozenset()) is None
    assert report.lookup(entries, "unit/b/x.py::t", frozenset()).reason == "dir"
    assert report.lookup(entries, "unit/bx.py::t", frozenset()) is None
    assert report.lookup(entries, "unit/c.py::t", frozenset(["upstream"])) is None
    assert report.lookup(entries, "unit/c.py::t", frozenset(["fork", "offline"])).reason == "c"


@pytest.mark.parametrize("outcome,listed,expected", [
    ("passed", False, "passed"), ("passed", True, "unexpected-pass"), ("failed", False, "failed"),
    ("failed", True, "xfailed"), ("skipped", True, "skipped"), ("xfailed", False, "xfailed")])
def test_verdicts(outcome, listed, expected):
    entry = report.Entry("x", "reason", frozenset(), 1) if listed else None
    assert report.verdict(outcome, entry) == expected


def test_a_failure_that_depends_on_the_workers_state_may_pass():
    """4xH100: 0.19.8 passed test_to_leaves_pinned_host_tensors_alone, which it had failed the day before
    ([gpu-forked]: CUDA initialized in the xdist worker before the fork); such an entry takes a pass as a pass,
    and still a failure as listed."""
    forked = report.Entry("x", "reason", frozenset(["gpu-forked"]), 1)
    assert report.verdict("passed", forked) == "passed"
    assert report.verdict("failed", forked) == "xfailed"
    assert report.verdict("passed", report.Entry("x", "reason", frozenset(["offline"]), 1)) == "unexpected-pass"


def test_summary_ok_only_without_unexpected_results():
    entries = report.parse("unit/a.py::t | r\n")
    good = report.summarize({"unit/a.py::t": ("failed", "E", 1.0), "unit/a.py::u": ("passed", "", 1.0)}, entries,
                            frozenset(), ["unit/a.py::t", "unit/a.py::u"])
    assert good["ok"] and good["counts"]["xfailed"] == 1 and good["counts"]["passed"] == 1
    assert not report.summarize({"unit/a.py::t": ("passed", "", 1.0)}, entries, frozenset(), ["unit/a.py::t"])["ok"]


def test_only_entries_inside_the_matrix_can_be_stale():
    # one file serves every matrix: an entry for another matrix's directory is not stale here
    entries = report.parse("unit/v1/zero/test_z.py::t | zero\nunit/v1/compile/test_gone.py::t | renamed\n")
    collected = ["unit/v1/compile/test_c.py::t"]
    assert report.summarize({}, entries, frozenset(), collected, scope=["unit/v1/compile"])["stale"] == [
        "line 2: unit/v1/compile/test_gone.py::t"]
    assert report.summarize({}, entries, frozenset(), collected)["stale"] == [
        "line 1: unit/v1/zero/test_z.py::t", "line 2: unit/v1/compile/test_gone.py::t"]
    assert not report.in_scope("unit/v1/compiler/x.py", ["unit/v1/compile"])


def test_only_active_entries_can_be_stale():
    entries = report.parse("[edaa722] unit/gone.py | removed in a later checkout\n")
    assert report.summarize({}, entries, frozenset(["fork"]), ["unit/a.py::t"])["ok"]
    assert report.summarize({}, entries, frozenset(["fork", "edaa722"]), ["unit/a.py::t"])["stale"] == [
        "line 1: unit/gone.py"]


def test_shard_is_a_deterministic_partition():
    ids = [f"unit/t{k}.py::test" for k in range(23)]
    shards = [cli.shard(reversed(ids), i, 4) for i in range(1, 5)]
    assert sorted(sum(shards, [])) == sorted(ids) and max(map(len, shards)) - min(map(len, shards)) <= 1
    assert shards == [cli.shard(ids, i, 4) for i in range(1, 5)]
    assert shards == [sorted(ids)[i::4] for i in range(4)]  # equal times: every 4th node id


def test_shards_balance_estimated_time():
    # every third node id is slow: dealt round-robin, all four would land in shard 1 (120 s + 0 s + 0 s)
    seconds = {f"unit/t{k:02d}.py::t": 30 if k % 3 == 0 else 2 for k in range(12)}
    parts = cli.shards(list(seconds), 3, seconds)
    assert sorted(sum(parts, [])) == sorted(seconds)
    assert [sum(seconds[x] for x in p) for p in parts] == [60, 38, 38]
    assert [sum(seconds[x] == 30 for x in p) for p in parts] == [2, 1, 1]


def test_plan_finds_the_fewest_shards_within_the_budget():
    seconds = {f"unit/slow{k}.py::t": 30 for k in range(6)}
    seconds.update({f"unit/fast{k}.py::t": 2 for k in range(10)})
    parts, loads = cli.plan(list(seconds), seconds, 70)
    assert len(parts) == 3 and max(loads) <= 70
    assert max(sum(seconds[x] for x in p) for p in cli.shards(list(seconds), 2, seconds)) > 70
    # a test longer than the budget gets a shard to itself; the others share shards within its time
    seconds = {"a": 500, "b": 1, "c": 1}
    parts, loads = cli.plan(list(seconds), seconds, 100)
    assert parts == [["a"], ["b", "c"]] and loads == [500, 2]


def test_outcome_of_reports():
    def rep(when, outcome, xfail=False, message=""):
        return {"when": when, "outcome": outcome, "xfail": xfail, "message": message}
    assert cli.outcome([rep("setup", "passed"), rep("call", "passed"), rep("teardown", "passed")]) == ("passed", "")
    assert cli.outcome([rep("setup", "failed", message="E")]) == ("failed", "setup: E")
    assert cli.outcome([rep("setup", "passed"), rep("call", "skipped", True, "x")]) == ("xfailed", "x")
    assert cli.outcome([rep("setup", "skipped", message="no GPU")]) == ("skipped", "no GPU")
    assert cli.outcome([rep("call", "passed"), rep("teardown", "failed", message="E")]) == ("failed", "teardown: E")


# --- the ledger (tools/upstream_tests/ledger.py) ------------------------------------------------------------

from upstream_tests import ledger, plugin  # noqa: E402

SHARDS = [["unit/a.py::t1", "unit/a.py::t2"], ["unit/b.py::t1"], ["unit/c.py::t1", "unit/c.py::t2"], ["unit/d.py::t"]]


def _ledger():
    led = ledger.new("c0ffee" * 6 + "c0ff", "ab" * 32)
    ledger.add_matrix(led, "gpu-zero", SHARDS, {"date": "2026-11-25"})
    return led


def _shard_summary(led, target, k, outcomes, matrix="gpu-zero"):
    """What a ledger run writes for one shard: outcomes {node id: (outcome, verdict, message)}."""
    rows = [{"nodeid": nid, "outcome": o, "verdict": v, "message": m, "reason": "", "seconds": 3.0}
            for nid, (o, v, m) in sorted(outcomes.items())]
    return {"ledger": ledger.stamp(led, matrix, target, k), "tests": rows, "stale": [], "unplanned": [],
            "host": "2x NVIDIA H100 80GB HBM3", "date": "2026-11-26", "seconds": 111, "workers": 4,
            "info": {"deepspeed": "0.19.8+fork.8" if target == "fork" else "0.19.8", "torch": "2.11.0+cu130"}}


def _write_json(path, value):
    _write(str(path), json.dumps(value))


def test_resume_runs_only_shards_without_a_complete_result():
    led = _ledger()
    assert ledger.pending(led, "gpu-zero", "fork") == [1, 2, 3, 4]
    assert ledger.pending(led, "gpu-zero", "upstream") == []  # upstream waits for the fork's results
    ledger.record(led, [
        ("s1", _shard_summary(led, "fork", 1, {n: ("passed", "passed", "") for n in SHARDS[0]})),
        ("s2", _shard_summary(led, "fork", 2, {"unit/b.py::t1": ("failed", "failed", "no result: the wall-clock "
                                                                  "limit killed the run")})),
        ("s3", _shard_summary(led, "fork", 3, {"unit/c.py::t1": ("failed", "xfailed", "E: listed"),
                                               "unit/c.py::t2": ("failed", "failed", "E: new")}))])
    states = {k: r["state"] for k, r in led["matrices"]["gpu-zero"]["results"]["fork"].items()}
    assert states == {"1": "passed", "2": "incomplete", "3": "failed"}
    assert ledger.pending(led, "gpu-zero", "fork") == [2, 4]
    # upstream 0.19.8 runs only what the fork failed: shard 3's two tests, nothing of shards 1 and 2
    assert ledger.pending(led, "gpu-zero", "upstream") == [3]
    assert ledger.selection(led, "gpu-zero", "upstream", 3) == ["unit/c.py::t1", "unit/c.py::t2"]
    assert ledger.selection(led, "gpu-zero", "upstream", 1) is None
    assert ledger.fork_failures(led, "gpu-zero") == ["unit/c.py::t1", "unit/c.py::t2"]
    # an incomplete rerun never replaces a complete result
    what = ledger.record(led, [("again", _shard_summary(led, "fork", 1, {
        "unit/a.py::t1": ("passed", "passed", ""), "unit/a.py::t2": ("failed", "failed", "no result: killed")}))])
    assert what == [("gpu-zero", "fork", 1, "kept the earlier passed result (incomplete run)")]
    assert led["matrices"]["gpu-zero"]["results"]["fork"]["1"]["state"] == "passed"


def test_recording_a_summary_changes_exactly_that_shard(tmp_path):
    path = tmp_path / "ledger.json"
    led = _ledger()
    ledger.save(str(path), led)
    before = ledger.load(str(path))
    summary = _shard_summary(led, "fork", 2, {"unit/b.py::t1": ("failed", "failed", "RuntimeError: NCCL")})
    _write_json(tmp_path / "runs" / "fork-gpu-zero-2.json", summary)
    _write(str(tmp_path / "runs" / "build-fork.log"), "not a summary\n")
    res = subprocess.run([sys.executable, TOOL, "--ledger", str(path), "--record", str(tmp_path / "runs")],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "gpu-zero fork shard 2: failed" in res.stdout
    after = ledger.load(str(path))
    result = after["matrices"]["gpu-zero"]["results"].pop("fork")
    before["matrices"]["gpu-zero"]["results"].pop("fork", None)
    assert after == before  # nothing else moved
    assert list(result) == ["2"]
    r = result["2"]
    assert (r["state"], r["passed"], r["failed"], r["xfailed"], r["skipped"]) == ("failed", 0, 1, 0, 0)
    assert (r["host"], r["date"], r["seconds"], r["deepspeed"], r["workers"]) == (
        "2x NVIDIA H100 80GB HBM3", "2026-11-26", 111, "0.19.8+fork.8", 4)
    assert r["failures"] == [["unit/b.py::t1", "failed", "RuntimeError: NCCL"]]
    with open(path) as f:
        text = f.read()
    assert '       ["unit/b.py::t1", "failed", "RuntimeError: NCCL"]\n' in text  # one failure per line


@pytest.mark.parametrize("change,message", [
    (lambda s: s["ledger"].update(sharding="0123456789abcdef"), "belongs to sharding 0123456789abcdef"),
    (lambda s: s["ledger"].update(checkout="edaa722"), "ran the tests of checkout edaa722"),
    (lambda s: s["ledger"].update(shard=9), "shard 9 is not one of the ledger's 4"),
    (lambda s: s["tests"].append(dict(s["tests"][0], nodeid="unit/x.py::t")), "not those of fork shard 2"),
    (lambda s: s.pop("ledger"), "not a ledger shard's summary")])
def test_a_summary_of_another_sharding_is_refused(tmp_path, change, message):
    path = tmp_path / "ledger.json"
    led = _ledger()
    ledger.save(str(path), led)
    with open(path, "rb") as f:
        before = f.read()
    good = _shard_summary(led, "fork", 1, {n: ("passed", "passed", "") for n in SHARDS[0]})
    bad = _shard_summary(led, "fork", 2, {"unit/b.py::t1": ("passed", "passed", "")})
    change(bad)
    _write_json(tmp_path / "good.json", good)
    _write_json(tmp_path / "bad.json", bad)
    res = subprocess.run([sys.executable, TOOL, "--ledger", str(path), "--record", str(tmp_path / "good.json"),
                          str(tmp_path / "bad.json")], capture_output=True, text=True)
    assert res.returncode == 2 and message in res.stderr, res.stderr
    with open(path, "rb") as f:
        assert f.read() == before  # all or nothing: the good summary is not recorded either


@pytest.mark.parametrize("corrupt,message", [
    (lambda text: text[:len(text) // 2], "not valid JSON"),
    (lambda text: text.replace('"unit/b.py::t1"', '"unit/b.py::t9"'), "'sharding' does not match its shards"),
    (lambda text: text.replace('"format": 1', '"format": 7'), "not a ledger of format 1")])
def test_a_corrupt_ledger_is_reported_and_left_alone(tmp_path, corrupt, message):
    path = tmp_path / "ledger.json"
    led = _ledger()
    ledger.save(str(path), led)
    with open(path) as f:
        text = corrupt(f.read())
    _write(str(path), text)
    _write_json(tmp_path / "s.json", _shard_summary(led, "fork", 2, {"unit/b.py::t1": ("passed", "passed", "")}))
    for args in (["--record", str(tmp_path / "s.json")], ["--status"]):
        res = subprocess.run([sys.executable, TOOL, "--ledger", str(path)] + args, capture_output=True, text=True)
        assert res.returncode == 2 and message in res.stderr and "left as it is" in res.stderr, res.stderr
        with open(path) as f:
            assert f.read() == text


def test_ledger_runs_resume_from_the_recorded_shards(fake):
    path, runs = fake / "ledger.json", fake / "runs"
    res, _ = run_tool(fake, "--ledger", str(path), "--init", "3")
    assert "a new ledger needs --commit" in res.stderr and res.returncode == 2
    res, _ = run_tool(fake, "--ledger", str(path), "--init", "3", "--commit", "f" * 40)
    assert res.returncode == 0, res.stdout + res.stderr
    led = ledger.load(str(path))
    shards = led["matrices"]["cpu"]["shards"]
    assert len(shards) == 3 and sorted(sum(shards, [])) == ALL_IDS  # 9 node ids of 1 s each, 3 s a shard
    res, _ = run_tool(fake, "--ledger", str(path), "--next", "1", "--summary-dir", str(runs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert os.listdir(runs) == ["fork-cpu-1.json"]
    rec = subprocess.run([sys.executable, TOOL, "--ledger", str(path), "--record", str(runs)], capture_output=True,
                         text=True)
    assert rec.returncode == 0 and "cpu fork shard 1: passed" in rec.stdout, rec.stdout + rec.stderr
    os.remove(runs / "fork-cpu-1.json")
    res, _ = run_tool(fake, "--ledger", str(path), "--next", "5", "--summary-dir", str(runs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fork has 2 of 3 shards without a result; running [2, 3]" in res.stdout
    assert sorted(os.listdir(runs)) == ["fork-cpu-2.json", "fork-cpu-3.json"]
    with open(runs / "fork-cpu-3.json") as f:
        summary = json.load(f)
    assert sorted(r["nodeid"] for r in summary["tests"]) == shards[2]
    assert summary["ledger"]["shard"] == 3 and summary["ledger"]["sharding"] == led["matrices"]["cpu"]["sharding"]
    # other tests than the ledger's: refused before anything runs
    _write(str(fake / "checkout" / "tests" / "unit" / "test_new.py"), "def test_n():\n    pass\n")
    res, _ = run_tool(fake, "--ledger", str(path), "--next", "1")
    assert res.returncode == 2 and "is not the tests/ the ledger's shards were cut from" in res.stderr


def test_shards_run_together_are_judged_and_recorded_one_by_one(fake):
    """--together runs the next shards in one pass (so xdist workers never idle at a shard's end) and must still
    leave each shard its own summary with exactly its node ids, recordable in the ledger like a shard run alone."""
    path, runs = fake / "ledger.json", fake / "runs"
    res, _ = run_tool(fake, "--ledger", str(path), "--init", "3", "--commit", "f" * 40)
    assert res.returncode == 0, res.stdout + res.stderr
    shards = ledger.load(str(path))["matrices"]["cpu"]["shards"]
    res, _ = run_tool(fake, "--ledger", str(path), "--together")
    assert res.returncode == 2 and "--together needs --ledger and --next" in res.stderr
    # a ledger shard named by its number alone still runs (the option's check once took the ledger's place)
    res, _ = run_tool(fake, "--ledger", str(path), "--shard", "3", "--summary-dir", str(fake / "one"))
    assert res.returncode == 0 and os.listdir(fake / "one") == ["fork-cpu-3.json"], res.stdout + res.stderr
    res, _ = run_tool(fake, "--ledger", str(path), "--next", "2", "--together", "--summary-dir", str(runs))
    assert res.returncode == 0, res.stdout + res.stderr
    assert "fork shards [1, 2] of 3 together: 6 node ids" in res.stdout and res.stdout.count("=== upstream-tests") == 2
    assert sorted(os.listdir(runs)) == ["fork-cpu-1.json", "fork-cpu-2.json"]
    for k in (1, 2):
        with open(runs / f"fork-cpu-{k}.json") as f:
            summary = json.load(f)
        assert sorted(r["nodeid"] for r in summary["tests"]) == sorted(shards[k - 1])
        assert sum(summary["counts"].values()) == len(shards[k - 1]) and summary["together"] == [1, 2]
    rec = subprocess.run([sys.executable, TOOL, "--ledger", str(path), "--record", str(runs)], capture_output=True,
                         text=True)
    assert rec.returncode == 0 and "cpu fork shard 2: passed" in rec.stdout, rec.stdout + rec.stderr
    st = subprocess.run([sys.executable, TOOL, "--ledger", str(path), "--status"], capture_output=True, text=True)
    assert "(one run of shards 1, 2)" in st.stdout and "| `cpu` | fork | 2 of 3 |" in st.stdout, st.stdout


# --- master ports: one range per xdist worker -------------------------------------------------------------------


def test_master_port_ranges_of_workers_are_disjoint(monkeypatch):
    ranges = [set(plugin.port_range(plugin.worker_index(f"gw{w}"), 20000)) for w in range(16)]
    assert all(not (a & b) for i, a in enumerate(ranges) for b in ranges[i + 1:])
    assert min(ranges[0]) == 20000 and max(ranges[15]) == 20000 + 16 * plugin.PORT_SPAN - 1 < 32768
    assert plugin.worker_index("") == 0 and plugin.worker_index("gw7") == 7
    import socket
    with socket.socket() as busy:
        busy.bind(("", 0))
        port = busy.getsockname()[1]
        monkeypatch.setenv("DS_UT_PORT_BASE", str(port))
        monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
        # The bound port is skipped for a later one of the range (the next, unless another process of the suite
        # holds that one: the port was the system's pick, among those it hands out to every connection).
        assert port < int(plugin.master_port()) < port + plugin.PORT_SPAN
        monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
        assert port + 2 * plugin.PORT_SPAN <= int(plugin.master_port()) < port + 3 * plugin.PORT_SPAN


COMMON = """\
def get_master_port(base_port=29500, port_range_size=1000):
    return "29500"  # every worker the same port
"""
PORT_TESTS = """\
import os
import pytest
from unit import common
from unit.common import get_master_port


@pytest.mark.parametrize("k", range(6))
def test_port(k):
    with open(os.path.join(os.environ["PORT_LOG"], f"{k}.txt"), "w") as f:
        f.write(f"{os.environ.get('PYTEST_XDIST_WORKER', '-')} {common.get_master_port()} {get_master_port()}")
"""


def test_each_xdist_worker_takes_ports_from_its_own_range(fake, monkeypatch):
    pytest.importorskip("xdist")
    tests = fake / "checkout" / "tests"
    _write(str(tests / "unit" / "__init__.py"), "")
    _write(str(tests / "unit" / "common.py"), COMMON)
    _write(str(tests / "unit" / "test_ports.py"), PORT_TESTS)
    os.remove(tests / "unit" / "test_broken.py")
    monkeypatch.setenv("PORT_LOG", str(fake / "ports"))
    os.makedirs(fake / "ports")
    res, summary = run_tool(fake, "--only", "test_ports", "--workers", "2", "--port-base", "23000", expected=False)
    assert res.returncode == 0, res.stdout + res.stderr
    assert summary["counts"]["passed"] == 6
    seen = {}
    for name in os.listdir(fake / "ports"):
        with open(fake / "ports" / name) as f:
            worker, port, imported = f.read().split()
        assert port == imported  # the module-level import is replaced too
        seen.setdefault(worker, set()).add(int(port))
    assert set(seen) == {"gw0", "gw1"}, seen
    assert all(23000 <= p < 23000 + plugin.PORT_SPAN for p in seen["gw0"])
    assert all(23000 + plugin.PORT_SPAN <= p < 23000 + 2 * plugin.PORT_SPAN for p in seen["gw1"])


@pytest.mark.parametrize("run_limit_first,message", [
    (True, "no result: the wall-clock limit killed the run"),
    (False, f"killed after {cli.LAUNCH_TIMEOUT} s"),
])
def test_launched_script_cut_by_the_run_limit_has_no_result(monkeypatch, tmp_path, run_limit_first, message):
    """The first ledger shard on 2xH100 recorded a launcher script killed by the run's wall-clock budget as a failure
    of the script: a cut-off run says nothing about it, so the shard must stay incomplete, not failed."""
    monkeypatch.setattr(cli, "run_logged", lambda *a, **k: (-9, True))
    now = cli.time.time()
    deadline = now + (60 if run_limit_first else 10 * cli.LAUNCH_TIMEOUT)
    outcome, got, _ = cli.run_launched("torch_compile/test_compile.py::launcher[ds_config_z2.json]", str(tmp_path),
                                       {}, 2, str(tmp_path / "launcher.log"), deadline)
    assert (outcome, got) == ("failed", message)


def test_an_incomplete_shard_resumes_with_only_its_node_ids_without_a_result():
    """2xH200: gpu-compile's 9 shards ran whole three times, each time 34 of 225 node ids cut off by the limit; a
    later run of an incomplete shard takes only those, and its results complete the shard's."""
    led = _ledger()
    cut = "no result: the wall-clock limit killed the run"
    ledger.record(led, [("first", _shard_summary(led, "fork", 3, {
        "unit/c.py::t1": ("failed", "xfailed", "E: listed"), "unit/c.py::t2": ("failed", "failed", cut)}))])
    assert ledger.selection(led, "gpu-zero", "fork", 3) == ["unit/c.py::t2"]
    assert ledger.pending(led, "gpu-zero", "fork") == [1, 2, 3, 4]
    # a whole-shard summary no longer matches what the ledger selects: refused, nothing recorded
    whole = _shard_summary(led, "fork", 3, {n: ("passed", "passed", "") for n in SHARDS[2]})
    whole["ledger"] = dict(whole["ledger"], selection_sha256=ledger.stamp(_ledger(), "gpu-zero", "fork", 3)[
        "selection_sha256"])
    with pytest.raises(ledger.LedgerError, match="only its node ids without a result"):
        ledger.record(led, [("whole", whole)])
    rest = _shard_summary(led, "fork", 3, {"unit/c.py::t2": ("passed", "passed", "")})
    rest["info"]["deepspeed"], rest["seconds"] = "0.19.8+fork.16", 40
    assert ledger.record(led, [("rest", rest)]) == [("gpu-zero", "fork", 3, "passed (replaces an earlier result)")]
    r = led["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r["state"], r["passed"], r["xfailed"], r["failed"]) == ("passed", 1, 1, 0)
    assert r["failures"] == [["unit/c.py::t1", "xfailed", "E: listed"]]
    assert (r["seconds"], r["deepspeed"], r["resumed"]) == (151, "0.19.8+fork.8, 0.19.8+fork.16", 1)
    assert ledger.selection(led, "gpu-zero", "fork", 3) == SHARDS[2]
    assert 3 not in ledger.pending(led, "gpu-zero", "fork")
    assert ledger.selection(led, "gpu-zero", "upstream", 3) == ["unit/c.py::t1"]  # 0.19.8 on what the fork failed
    assert "resumed 1x" in ledger.status(led)


def test_two_runs_of_the_same_node_ids_are_merged_not_counted_twice():
    """4xH100: gpu-zero's 47 shards left ran in two commands from the same ledger, the second before
    the first's summaries were recorded. Each node id counts once: a run's result where only it has one, the worse
    where both do; the other run's verdict is named."""
    led = _ledger()
    cut = "no result: the wall-clock limit killed the run"
    first = _shard_summary(led, "fork", 3, {"unit/c.py::t1": ("passed", "passed", ""),
                                            "unit/c.py::t2": ("failed", "failed", cut)})
    second = _shard_summary(led, "fork", 3, {"unit/c.py::t1": ("failed", "failed", "E: flaky"),
                                             "unit/c.py::t2": ("passed", "passed", "")})
    second["info"]["deepspeed"], second["host"], second["seconds"] = "0.19.8+fork.9", "4x NVIDIA H100 80GB HBM3", 40
    assert ledger.record(led, [("first", first), ("second", second)]) == [("gpu-zero", "fork", 3, "failed")]
    r = led["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r["passed"], r["failed"], r["state"], r["runs"]) == (1, 1, "failed", 2)
    assert r["failures"] == [["unit/c.py::t1", "failed", "E: flaky (another run: passed)"]]
    assert (r["seconds"], r["deepspeed"]) == (151, "0.19.8+fork.8, 0.19.8+fork.9")
    assert r["host"] == "2x NVIDIA H100 80GB HBM3, 4x NVIDIA H100 80GB HBM3"
    assert "2 runs of the same node ids merged" in ledger.status(led)
    assert ("`gpu-zero`, fork: 2 of 6 node ids have a result, incomplete shards included (1 passed, 0 failed as "
            "listed, 1 failed unexpectedly, 0 passed but listed, 0 skipped); 4 have none.") in ledger.status(led)
    # neither run has a result for a node id: it stays without one, and the shard incomplete
    led = _ledger()
    both_cut = [_shard_summary(led, "fork", 3, {"unit/c.py::t1": ("passed", "passed", ""),
                                                "unit/c.py::t2": ("failed", "failed", cut)}) for _ in range(2)]
    ledger.record(led, [("a", both_cut[0]), ("b", both_cut[1])])
    r = led["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r["state"], r["passed"], r["failed"]) == ("incomplete", 1, 1)
    assert "`gpu-zero`, fork: 1 of 6 node ids have a result" in ledger.status(led)
    assert ledger.selection(led, "gpu-zero", "fork", 3) == ["unit/c.py::t2"]


def test_a_test_the_limit_cut_off_while_it_ran_has_no_result(monkeypatch, tmp_path):
    """4xH100: the limit killed gpu-zero's pass during an NVMe offload test, and the tool recorded the
    test's setup without a call as a failure ("no call report") that no later run would take again."""
    def pytest_run(cmd, cwd, env, log, deadline, killed):
        with open(env["DS_UT_STATE"], "w") as f:
            for nid, when in (("unit/a.py::t1", "setup"), ("unit/a.py::t1", "call"), ("unit/a.py::t2", "setup")):
                f.write(json.dumps({"nodeid": nid, "when": when, "outcome": "passed", "xfail": False,
                                    "message": "", "seconds": 2.0}) + "\n")
        return (-9 if killed else 1), killed
    ids = ["unit/a.py::t1", "unit/a.py::t2", "unit/a.py::t3"]
    for killed, t2 in ((True, "no result: the wall-clock limit killed the run during the test"),
                       (False, "no call report")):  # pytest died in t2 by itself: t2 is to blame
        monkeypatch.setattr(cli, "run_logged", lambda *a, k=killed: pytest_run(*a, killed=k))
        out = tmp_path / str(killed)
        out.mkdir()
        got = cli.run_pass("parallel", ids, [], str(tmp_path), {}, str(out), None)
        assert got["unit/a.py::t1"] == ("passed", "", 4.0)
        assert got["unit/a.py::t2"][:2] == ("failed", t2)
        assert got["unit/a.py::t3"][1].startswith("no result")


def test_voided_failures_are_run_again_and_their_new_results_complete_the_shard(tmp_path):
    """The ledger held three such "no call report" failures from before the fix; --void turns them into no result
    (all or none), so that the fork's next run of their shards takes exactly them."""
    led = _ledger()
    ledger.record(led, [("s", _shard_summary(led, "fork", 3, {
        "unit/c.py::t1": ("failed", "failed", "no call report"),
        "unit/c.py::t2": ("failed", "xfailed", "E: listed")}))])
    before = json.dumps(led)
    with pytest.raises(ledger.LedgerError, match="shard 1 has no fork result"):
        ledger.void(led, "fork", ["unit/c.py::t1", "unit/a.py::t1"], "cut off")
    ledger.record(led, [("s1", _shard_summary(led, "fork", 1, {"unit/a.py::t1": ("passed", "passed", ""),
                                                             "unit/a.py::t2": ("passed", "passed", "")}))])
    before = json.dumps(led)
    with pytest.raises(ledger.LedgerError, match="did not fail"):
        ledger.void(led, "fork", ["unit/c.py::t1", "unit/a.py::t1"], "cut off")
    with pytest.raises(ledger.LedgerError, match="needs the reason"):
        ledger.void(led, "fork", ["unit/c.py::t1"], " ")
    with pytest.raises(ledger.LedgerError, match="no shard"):
        ledger.void(led, "fork", ["unit/z.py::t"], "cut off")
    assert json.dumps(led) == before  # refused: nothing changed
    assert ledger.void(led, "fork", ["unit/c.py::t1"], "cut off during the test") == [
        ("gpu-zero", 3, "unit/c.py::t1", "failed")]
    r = led["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r["state"], r["failed"], r["xfailed"]) == ("incomplete", 1, 1)
    assert ledger.selection(led, "gpu-zero", "fork", 3) == ["unit/c.py::t1"]
    with pytest.raises(ledger.LedgerError, match="already"):
        ledger.void(led, "fork", ["unit/c.py::t1"], "again")
    rest = _shard_summary(led, "fork", 3, {"unit/c.py::t1": ("passed", "passed", "")})
    assert ledger.record(led, [("rest", rest)]) == [("gpu-zero", "fork", 3, "passed (replaces an earlier result)")]
    r = led["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r["state"], r["passed"], r["failed"], r["xfailed"]) == ("passed", 1, 0, 1)
    assert ledger.selection(led, "gpu-zero", "upstream", 3) == ["unit/c.py::t2"]
    # the command line: --void without --why is refused, and leaves the file alone
    path = tmp_path / "ledger.json"
    ledger.save(str(path), _ledger())
    before = path.read_text()
    assert cli.main(["--ledger", str(path), "--void", "unit/c.py::t1"]) == 2
    assert path.read_text() == before


def test_failures_recorded_before_their_entry_was_written_are_judged_again(tmp_path):
    """A run listed TestAutoSPCompile ([offline]) and four [gpu-forked] tests after their failures were recorded:
    the ledger went on counting them as unexpected. --rejudge applies the expected-failures file as it is now."""
    led = _ledger()
    ledger.record(led, [("s", _shard_summary(led, "fork", 3, {
        "unit/c.py::t1": ("failed", "failed", "E: offline"), "unit/c.py::t2": ("failed", "xfailed", "E: was listed")})),
        ("s4", _shard_summary(led, "fork", 4, {"unit/d.py::t": ("passed", "unexpected-pass", "")}))])
    path, expected = tmp_path / "ledger.json", tmp_path / "expected.txt"
    ledger.save(str(path), led)
    expected.write_text("[offline] unit/c.py::t1 | downloads a model\n"
                        "[fork] unit/d.py::t | reads what a patch replaced\n")
    assert cli.main(["--ledger", str(path), "--rejudge", "--expected", str(expected), "--condition", "offline"]) == 0
    r3, r4 = (ledger.load(str(path))["matrices"]["gpu-zero"]["results"]["fork"][k] for k in "34")
    assert (r3["state"], r3["failed"], r3["xfailed"]) == ("failed", 1, 1)  # t1 listed now, t2 no longer
    assert r3["failures"] == [["unit/c.py::t1", "xfailed", "E: offline"], ["unit/c.py::t2", "failed", "E: was listed"]]
    assert (r4["state"], r4["unexpected-pass"]) == ("failed", 1)  # [fork] applies to the fork: still listed
    # without the condition, the [offline] entry is not active: t1 is unexpected again; upstream's results alone
    assert cli.main(["--ledger", str(path), "--rejudge", "--expected", str(expected)]) == 0
    r3 = ledger.load(str(path))["matrices"]["gpu-zero"]["results"]["fork"]["3"]
    assert (r3["state"], r3["failed"], r3["xfailed"]) == ("failed", 2, 0)
    assert cli.main(["--ledger", str(path), "--rejudge", "--expected", str(expected), "--target", "upstream"]) == 0
    assert ledger.load(str(path))["matrices"]["gpu-zero"]["results"]["fork"]["4"]["unexpected-pass"] == 1


def test_the_pages_gpu_table_is_the_ledgers_summary():
    """docs/upstream-tests.md's GPU table is what `--summary` makes of the committed ledger."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(repo, "docs", "upstream-tests.md")) as f:
        page = f.read()
    m = re.search(r"<!-- upstream-tests-summary: (.*?) -->\n(.*?)<!-- /upstream-tests-summary -->", page, re.S)
    assert m, "docs/upstream-tests.md has lost its upstream-tests-summary markers"
    proc = subprocess.run([sys.executable, os.path.join(repo, "tools", "upstream-tests"), *m.group(1).split()],
                          capture_output=True, text=True, timeout=60, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    assert m.group(2) == proc.stdout, "docs/upstream-tests.md's GPU table differs from the ledger's: regenerate it"
    assert "| `gpu-zero` | fork |" in m.group(2)
