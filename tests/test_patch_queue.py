"""forkbuild.pq: import -> export round trip, check, and rebase onto a new upstream release."""

import os
import subprocess
import sys
import tarfile

import pytest

import fakefork

ANSWER_UPSTREAMED = fakefork.ANSWER_PATCH.replace("Last-Update: 2026-11-22\n",
                                                  "Last-Update: 2026-11-22\nApplied-Upstream: 1.1, http://x/1\n")
# The canonical copy only (upstream's git has no other); the build and the queue mirror it into the packaged one.
KERNEL_PATCH = fakefork.header("kernel 7") + """--- a/csrc/kernel.cpp
+++ b/csrc/kernel.cpp
@@ -1 +1 @@
-int kernel() { return 1; }
+int kernel() { return 7; }
"""


def pq(root, *args):
    return subprocess.run([sys.executable, "-m", "forkbuild.pq", "--root", root, *args], cwd=root,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture
def fork(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_FORK_CACHE", str(tmp_path / "cache"))
    sdist = fakefork.make_sdist(str(tmp_path))
    monkeypatch.setenv("DS_FORK_SDIST", sdist)
    return fakefork.make_fork(str(tmp_path / "fork"), sdist, {
        "answer.patch": ANSWER_UPSTREAMED, "kernel.patch": KERNEL_PATCH
    })


def read(root, *parts):
    with open(os.path.join(root, *parts)) as f:
        return f.read()


def patches(root):
    return {n: read(root, "patches", n) for n in os.listdir(os.path.join(root, "patches"))}


def test_export_is_deterministic_and_keeps_names_order_and_headers(fork):
    """The first export normalises hand-written diffs to git's form; from then on import -> export
    reproduces patches/ byte for byte (names, series order, headers, diffs)."""
    assert pq(fork, "import").returncode == 0
    tree = os.path.join(fork, ".pq", "tree")
    log = subprocess.run(["git", "-c", "safe.directory=*", "log", "--reverse", "--format=%s", "upstream..HEAD"],
                         cwd=tree, capture_output=True, text=True).stdout.split()
    assert log == ["answer.patch", "kernel.patch"]
    assert pq(fork, "check").returncode == 1  # the hand-written form is not the exported one
    assert pq(fork, "export").returncode == 0
    first = patches(fork)
    assert first["series"] == "answer.patch\nkernel.patch\n"
    assert first["answer.patch"].startswith(ANSWER_UPSTREAMED.split("---\n")[0] + "---\ndiff --git ")
    assert pq(fork, "import", "--force").returncode == 0
    assert pq(fork, "export").returncode == 0
    assert patches(fork) == first
    res = pq(fork, "check")
    assert res.returncode == 0 and "patch queue OK" in res.stdout


def test_new_commit_becomes_a_patch_with_its_twin_mirrored(fork):
    pq(fork, "import")
    tree = os.path.join(fork, ".pq", "tree")
    with open(os.path.join(tree, "csrc", "kernel.cpp"), "w") as f:
        f.write("int kernel() { return 8; }\n")
    assert "csrc/kernel.cpp -> fakeds/ops/csrc/kernel.cpp" in pq(fork, "mirror").stdout
    msg = "eight.patch\n\n" + fakefork.header("kernel 8").replace("---\n", "")
    git = ["git", "-c", "safe.directory=*", "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run(git + ["commit", "-qam", msg], cwd=tree, check=True)
    assert pq(fork, "export").returncode == 0
    assert read(fork, "patches", "series") == "answer.patch\nkernel.patch\neight.patch\n"
    eight = read(fork, "patches", "eight.patch")
    # The packaged copy the commit changed too is left out: the build mirrors the canonical one into it.
    assert eight.startswith("Description: kernel 8\n") and "+++ b/csrc/kernel.cpp" in eight
    assert "fakeds/ops/csrc" not in eight
    assert pq(fork, "check").returncode == 0
    # A fresh import mirrors it again.
    assert pq(fork, "import", "--force").returncode == 0
    assert read(tree, "fakeds", "ops", "csrc", "kernel.cpp") == "int kernel() { return 8; }\n"


def test_check_reports_a_hand_edited_patch(fork):
    pq(fork, "import")
    pq(fork, "export")
    assert pq(fork, "check").returncode == 0
    path = os.path.join(fork, "patches", "answer.patch")
    with open(path, "a") as f:
        f.write("\n")
    res = pq(fork, "check")
    assert res.returncode == 1 and "answer.patch: differs from its import -> export round trip" in res.stdout


def test_check_reports_missing_dep3_fields(fork):
    path = os.path.join(fork, "patches", "kernel.patch")
    text = read(fork, "patches", "kernel.patch").replace("Forwarded: no\n", "")
    with open(path, "w") as f:
        f.write(text)
    res = pq(fork, "check")
    assert res.returncode == 1 and "kernel.patch: DEP-3 header lacks Forwarded" in res.stdout


@pytest.mark.parametrize("bug, why", [
    ("tracker item #4", "Bug field cites no link and no docs page: 'tracker item #4'"),
    ("docs/no-such-page.md (the defect)", "Bug field cites docs pages that do not exist: docs/no-such-page.md"),
])
def test_check_refuses_a_bug_field_that_sends_the_reader_nowhere(fork, bug, why):
    path = os.path.join(fork, "patches", "kernel.patch")
    text = read(fork, "patches", "kernel.patch").replace("Bug: https://example.invalid/fakeds/issues/1\n",
                                                         f"Bug: {bug}\n")
    with open(path, "w") as f:
        f.write(text)
    res = pq(fork, "check")
    assert res.returncode == 1 and f"kernel.patch: {why}" in res.stdout, res.stdout


def test_rebase_drops_patches_applied_upstream(fork, tmp_path):
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    new = fakefork.make_sdist(str(new_dir), version="1.1", module="def answer():\n    return 42\n")
    res = pq(fork, "rebase", "1.1", "--sha256", fakefork.sha256(new), "--sdist", new)
    assert res.returncode == 0, res.stderr
    assert "dropped (applied upstream) ['answer.patch']" in res.stdout
    assert read(fork, "patches", "series") == "kernel.patch\n"
    assert not os.path.exists(os.path.join(fork, "patches", "answer.patch"))
    pin = read(fork, "pin.toml")
    assert 'version = "1.1"' in pin and fakefork.sha256(new) in pin and "release = 1" in pin
    assert 'sdist = "fakeds-1.1.tar.gz"' in pin


def test_rebase_conflict_names_the_patch_and_writes_nothing(fork, tmp_path):
    new_dir = tmp_path / "new"
    new_dir.mkdir()
    new = fakefork.make_sdist(str(new_dir), version="1.0.1", module="def answer():\n    return 40\n")
    before = patches(fork)
    pin_before = read(fork, "pin.toml")
    res = pq(fork, "rebase", "1.0.1", "--sha256", fakefork.sha256(new), "--sdist", new)
    assert res.returncode == 2
    assert "patch answer.patch does not apply to fakeds 1.0.1: conflicts in fakeds/__init__.py" in res.stderr
    assert "Nothing was written" in res.stderr
    assert read(fork, "pin.toml") == pin_before
    assert patches(fork) == before


def test_real_queue_round_trips(repo_root):
    """The fork's own patches/ is exactly what the queue exports (so nobody hand-edited a hunk)."""
    res = pq(repo_root, "check")
    assert res.returncode == 0, res.stdout + res.stderr


GIT = ["git", "-c", "safe.directory=*", "-c", "user.name=t", "-c", "user.email=t@t"]


def upstream_git_layout(sdist, dest, mirrors):
    """The sdist's tree laid out as upstream's repository: each packaged copy of a mirrored directory a link to the
    canonical one; committed as one commit."""
    with tarfile.open(sdist) as tar:
        top = tar.getnames()[0].split("/")[0]
        if hasattr(tarfile, "data_filter"):
            tar.extractall(dest, filter="data")
        else:
            tar.extractall(dest)
    tree = os.path.join(dest, top)
    for canonical, packaged in mirrors:
        subprocess.run(["rm", "-rf", os.path.join(tree, packaged)], check=True)
        os.symlink(os.path.relpath(os.path.join(tree, canonical), os.path.dirname(os.path.join(tree, packaged))),
                   os.path.join(tree, packaged))
    for args in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "upstream"]):
        subprocess.run(GIT + args, cwd=tree, check=True, capture_output=True)
    return tree


def git_am(tree, patch_dir):
    files = sorted(os.path.join(patch_dir, f) for f in os.listdir(patch_dir))
    return subprocess.run(GIT + ["am", "-q"] + files, cwd=tree, capture_output=True, text=True)


def test_export_upstream_applies_with_git_am_to_upstream_layout(fork, tmp_path):
    res = pq(fork, "export-upstream", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    tree = upstream_git_layout(os.environ["DS_FORK_SDIST"], str(tmp_path / "up"), [("csrc", "fakeds/ops/csrc")])
    am = git_am(tree, str(tmp_path / "out"))
    assert am.returncode == 0, am.stdout + am.stderr
    log = subprocess.run(GIT + ["log", "--format=%s", "-2"], cwd=tree, capture_output=True, text=True).stdout
    assert log.splitlines() == ["kernel 7", "answer 42"]  # git am drops the "[PATCH n/N]" prefix
    assert read(tree, "csrc", "kernel.cpp") == read(tree, "fakeds", "ops", "csrc", "kernel.cpp") == \
        "int kernel() { return 7; }\n"


def test_export_upstream_refuses_a_patch_of_a_packaged_copy(fork, tmp_path):
    path = os.path.join(fork, "patches", "kernel.patch")
    with open(path, "w") as f:
        f.write(KERNEL_PATCH.replace("csrc/kernel.cpp", "fakeds/ops/csrc/kernel.cpp"))
    res = pq(fork, "export-upstream", str(tmp_path / "out"))
    assert res.returncode == 2 and "changes fakeds/ops/csrc/kernel.cpp, a packaged copy" in res.stderr


def test_real_series_applies_to_upstream_git_layout(repo_root, pin, tmp_path):
    """Every patch of the fork applies with `git am` to the pinned release laid out as upstream's git."""
    from forkbuild import source

    sdist = source.obtain(pin, repo_root)
    res = pq(repo_root, "export-upstream", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr
    tree = upstream_git_layout(sdist, str(tmp_path / "up"), pin.mirrors)
    am = git_am(tree, str(tmp_path / "out"))
    assert am.returncode == 0, am.stdout + am.stderr
    count = subprocess.run(GIT + ["rev-list", "--count", "HEAD"], cwd=tree, capture_output=True, text=True).stdout
    assert int(count) == 1 + len(os.listdir(tmp_path / "out"))
