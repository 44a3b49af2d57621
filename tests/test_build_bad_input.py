"""Bad build input: a clear message, a non-zero exit, no wheel and no staging tree left behind."""

import functools
import http.server
import os
import subprocess
import sys
import threading
import zipfile

import pytest

import fakefork


@pytest.fixture
def env(tmp_path):
    return fakefork.build_env(tmp_path)


def build(tmp_path, env, patches=None, sha=None, sdist=None, **kw):
    sdist = sdist or fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist, patches=patches, sha=sha, **kw)
    env.setdefault("DS_FORK_SDIST", sdist)
    out = tmp_path / "out"
    proc = fakefork.pip_wheel(root, str(out), env)
    return proc, out


def assert_failed_cleanly(proc, out, env, *messages):
    assert proc.returncode != 0
    for m in messages:
        assert m in proc.stderr + proc.stdout, proc.stderr[-3000:]
    assert not out.exists() or list(out.iterdir()) == []  # no wheel, no partial file
    assert not [d for d in os.listdir(env["TMPDIR"]) if d.startswith("ds-fork-stage-")]


def test_good_build_applies_series_and_stamps_version(tmp_path, env):
    proc, out = build(tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    (whl, ) = out.iterdir()
    assert whl.name == "fakeds-1.0+fork.3-py3-none-any.whl"
    with zipfile.ZipFile(whl) as z:
        assert "return 42" in z.read("fakeds/__init__.py").decode()
        info = z.read("fakeds/fork_info.py").decode()
    assert "('answer.patch', 'answer 42')" in info and "version = '1.0+fork.3'" in info


def test_wrong_sha256(tmp_path, env):
    proc, out = build(tmp_path, env, sha="0" * 64)
    assert_failed_cleanly(proc, out, env, "sha256 mismatch", "expected " + "0" * 64)


@pytest.mark.parametrize("damage", ["truncated", "corrupt"])
def test_truncated_or_corrupt_archive(tmp_path, env, damage):
    good = fakefork.make_sdist(str(tmp_path))
    data = open(good, "rb").read()
    bad_dir = tmp_path / "bad"
    bad_dir.mkdir()
    bad = bad_dir / os.path.basename(good)
    bad.write_bytes(data[:len(data) // 2] if damage == "truncated" else os.urandom(len(data)))
    proc, out = build(tmp_path, env, sha=fakefork.sha256(bad), sdist=str(bad))
    assert_failed_cleanly(proc, out, env, "corrupt or truncated archive", str(bad))


def test_pinned_file_missing_while_offline(tmp_path, env):
    env.update(DS_FORK_OFFLINE="1", DS_FORK_SDIST="")
    proc, out = build(tmp_path, env)
    assert_failed_cleanly(proc, out, env, "fakeds-1.0.tar.gz is not available offline", env["DS_FORK_CACHE"])


def test_offline_build_from_cache(tmp_path, env):
    sdist = fakefork.make_sdist(str(tmp_path))
    os.makedirs(env["DS_FORK_CACHE"])
    os.link(sdist, os.path.join(env["DS_FORK_CACHE"], os.path.basename(sdist)))
    env.update(DS_FORK_OFFLINE="1", DS_FORK_SDIST="")
    proc, out = build(tmp_path, env, sdist=sdist)
    assert proc.returncode == 0, proc.stderr


@pytest.fixture
def served(tmp_path):
    """An HTTP server on loopback serving tmp_path/www."""
    www = tmp_path / "www"
    www.mkdir()
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(www))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield www, f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_download_is_verified_then_cached(tmp_path, env, served):
    www, url = served
    sdist = fakefork.make_sdist(str(www))
    env.update(DS_FORK_SDIST="", DS_FORK_SDIST_URL=f"{url}/{os.path.basename(sdist)}")
    proc, out = build(tmp_path, env, sdist=sdist)
    assert proc.returncode == 0, proc.stderr
    assert os.listdir(env["DS_FORK_CACHE"]) == [os.path.basename(sdist)]


def test_download_with_wrong_sha256_is_not_cached(tmp_path, env, served):
    www, url = served
    sdist = fakefork.make_sdist(str(www))
    env.update(DS_FORK_SDIST="", DS_FORK_SDIST_URL=f"{url}/{os.path.basename(sdist)}")
    proc, out = build(tmp_path, env, sdist=sdist, sha="1" * 64)
    assert_failed_cleanly(proc, out, env, "sha256 mismatch", "downloaded from")
    assert os.listdir(env["DS_FORK_CACHE"]) == []


TWO_FILES = fakefork.header("two files") + """--- a/fakeds/__init__.py
+++ b/fakeds/__init__.py
@@ -1,2 +1,2 @@
 def answer():
-    return 41
+    return 43
--- a/csrc/kernel.cpp
+++ b/csrc/kernel.cpp
@@ -1 +1 @@
-int kernel() { return 2; }
+int kernel() { return 3; }
"""


def test_patch_that_does_not_apply_names_patch_file_and_hunk(tmp_path, env):
    proc, out = build(tmp_path, env, patches={"answer.patch": fakefork.ANSWER_PATCH, "two.patch": TWO_FILES})
    assert_failed_cleanly(proc, out, env, "patch two.patch does not apply",
                          "file fakeds/__init__.py, hunk #1 (@@ -1,2 +1,2 @@)", "file csrc/kernel.cpp, hunk #1")


def test_series_entry_without_file(tmp_path, env):
    sdist = fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist)
    with open(os.path.join(root, "patches", "series"), "a") as f:
        f.write("gone.patch\n")
    env["DS_FORK_SDIST"] = sdist
    out = tmp_path / "out"
    proc = fakefork.pip_wheel(root, str(out), env)
    assert_failed_cleanly(proc, out, env, "gone.patch is listed but there is no file")


def test_patch_file_missing_from_series(tmp_path, env):
    sdist = fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist)
    with open(os.path.join(root, "patches", "stray.patch"), "w") as f:
        f.write(fakefork.ANSWER_PATCH)
    env["DS_FORK_SDIST"] = sdist
    out = tmp_path / "out"
    proc = fakefork.pip_wheel(root, str(out), env)
    assert_failed_cleanly(proc, out, env, "not listed in series: stray.patch")


def test_patch_without_dep3_header(tmp_path, env):
    bare = fakefork.ANSWER_PATCH.replace("Bug: https://example.invalid/fakeds/issues/1\n", "").replace(
        "Forwarded: no\n", "")
    proc, out = build(tmp_path, env, patches={"answer.patch": bare})
    assert_failed_cleanly(proc, out, env, "patch answer.patch: DEP-3 header lacks Bug, Forwarded")


def kernel_patch(path, value=2):
    return fakefork.header("kernel") + f"""--- a/{path}
+++ b/{path}
@@ -1 +1 @@
-int kernel() {{ return 1; }}
+int kernel() {{ return {value}; }}
"""


def test_patch_changing_a_packaged_copy_is_refused(tmp_path, env):
    # Upstream's git holds csrc/ once (its packaged copy is a link): a patch upstream could take changes that one.
    proc, out = build(tmp_path, env, patches={"kernel.patch": kernel_patch("fakeds/ops/csrc/kernel.cpp")})
    assert_failed_cleanly(proc, out, env, "patch kernel.patch changes fakeds/ops/csrc/kernel.cpp, a packaged copy; "
                          "change csrc/kernel.cpp")


def test_patch_of_the_canonical_copy_reaches_the_packaged_copy(tmp_path, env):
    sdist = fakefork.make_sdist(str(tmp_path))
    root = fakefork.make_fork(str(tmp_path / "fork"), sdist, patches={"kernel.patch": kernel_patch("csrc/kernel.cpp")})
    env["DS_FORK_SDIST"] = sdist
    show = ("from forkbuild import stage\n"
            "with stage.staged_tree('.') as (pin, tree):\n"
            "    print([open(f'{tree}/{p}').read().strip() for p in ('csrc/kernel.cpp', 'fakeds/ops/csrc/kernel.cpp')])")
    proc = subprocess.run([sys.executable, "-c", show], cwd=root, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == str(["int kernel() { return 2; }"] * 2)
