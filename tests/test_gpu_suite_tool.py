"""tools/gpu-suite: the JUnit files it writes come back from the GPU hosts, and a suite stopped by its command's
deadline still prints what ran (a fork.33 run lost both, its files named with the version's '+' and
its table never printed)."""

import os
import signal
import subprocess
import sys
import time

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu-suite")

PASSES = "def test_quick():\n    assert 1 + 1 == 2\n"
SLEEPS = "import time\n\n\ndef test_slow():\n    time.sleep(120)\n"


def suite(tmp_path, *files, label="0.19.8+fork.33"):
    paths = []
    for name, text in files:
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    cmd = [sys.executable, TOOL, "--label", label, "--report", str(tmp_path / "report"), "--timeout", "200", *paths]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)


def test_junit_files_are_named_without_characters_the_device_tool_leaves_out(tmp_path):
    proc = suite(tmp_path, ("test_a.py", PASSES))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    names = os.listdir(tmp_path / "report")
    assert names == ["0.19.8-fork.33-test_a.xml"], names
    assert "test_quick" in out and "1 passed" in out, out


def test_an_interrupted_suite_prints_what_ran_and_stops_the_running_file(tmp_path):
    proc = suite(tmp_path, ("test_a.py", PASSES), ("test_b.py", SLEEPS), ("test_c.py", PASSES))
    try:
        check_interrupted(proc, tmp_path)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        subprocess.run(["pkill", "-9", "-f", str(tmp_path / "test_b.py")])


def check_interrupted(proc, tmp_path):
    report = tmp_path / "report"
    deadline = time.monotonic() + 240
    while not (report / "0.19.8-fork.33-test_a.xml").exists():  # the first file has run
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.5)
    time.sleep(5)  # the second one is asleep in its test
    stopped = time.monotonic()
    os.kill(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=60)
    assert time.monotonic() - stopped < 30, out  # it did not wait for the sleeping test
    assert proc.returncode == 1, out
    lines = out.splitlines()
    assert any(l.startswith("test_quick") and "passed" in l for l in lines), out
    assert any(l.startswith("test_b.py") and "INTERRUPTED" in l for l in lines), out
    assert any(l.startswith("test_c.py") and "not started" in l for l in lines), out
    assert "1 passed, 2 interrupted" in out, out
    leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "test_b.py")], capture_output=True, text=True).stdout
    assert not leftover.strip(), f"the interrupted file's pytest still runs: {leftover}"
