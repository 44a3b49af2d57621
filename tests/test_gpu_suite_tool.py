"""tools/gpu-suite: the JUnit files it writes come back from the GPU hosts, and a suite stopped by its command's
deadline still prints what ran (a fork.33 run lost both, its files named with the version's '+' and
its table never printed), stopping the file it runs, also when the interrupt comes as that file's pytest starts."""

import os
import signal
import subprocess
import sys
import time

import pytest

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "gpu-suite")

PASSES = "def test_quick():\n    assert 1 + 1 == 2\n"
# Says it is asleep (FILE.asleep) before it sleeps.
SLEEPS = ("import pathlib\nimport time\n\n\ndef test_slow():\n"
          "    pathlib.Path(__file__).with_suffix('.asleep').touch()\n    time.sleep(120)\n")


def suite(tmp_path, *files, label="0.19.8+fork.33", interrupts=signal.SIG_DFL):
    paths = []
    for name, text in files:
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    cmd = [sys.executable, TOOL, "--label", label, "--report", str(tmp_path / "report"), "--timeout", "200", *paths]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, interrupts))


def test_junit_files_are_named_without_characters_the_device_tool_leaves_out(tmp_path):
    proc = suite(tmp_path, ("test_a.py", PASSES))
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    names = os.listdir(tmp_path / "report")
    assert names == ["0.19.8-fork.33-test_a.xml"], names
    assert "test_quick" in out and "1 passed" in out, out


# Started as it is where interrupts are left to Python, or with them ignored, as a script's background job starts.
@pytest.mark.parametrize("interrupts", [signal.SIG_DFL, signal.SIG_IGN], ids=["default", "ignored-by-its-parent"])
def test_an_interrupted_suite_prints_what_ran_and_stops_the_running_file(tmp_path, interrupts):
    proc = suite(tmp_path, ("test_a.py", PASSES), ("test_b.py", SLEEPS), ("test_c.py", PASSES), interrupts=interrupts)
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
    while not (tmp_path / "test_b.asleep").exists():  # the second one is asleep in its test
        assert time.monotonic() < deadline and proc.poll() is None, proc.communicate()[0]
        time.sleep(0.2)
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


# run_file of the tool, with ^C arriving as the file's pytest has just started (inside subprocess.Popen).
INTERRUPT_AT_START = r"""
import os, signal, subprocess, sys, types
sys.path.insert(0, sys.argv[1])
import tool_module
tool = tool_module.load("gpu-suite")
signal.signal(signal.SIGINT, signal.default_int_handler)  # as the tool's main() does
real = subprocess.Popen


def popen(*args, **kwargs):
    proc = real(*args, **kwargs)
    print("started", proc.pid, flush=True)
    os.kill(os.getpid(), signal.SIGINT)
    return proc


tool.subprocess.Popen = popen
try:
    rows = tool.run_file(sys.argv[2], types.SimpleNamespace(k=None, timeout=200), dict(os.environ), sys.argv[3])
except KeyboardInterrupt:
    rows = "KeyboardInterrupt escaped run_file"
print("rows", rows, flush=True)
"""


def test_an_interrupt_while_a_file_starts_stops_that_file(tmp_path):
    (tmp_path / "test_b.py").write_text(SLEEPS)
    try:
        # Its output to a file, not a pipe: a pytest left running would hold a pipe open.
        with open(tmp_path / "out", "w") as out:
            subprocess.run([sys.executable, "-c", INTERRUPT_AT_START, os.path.dirname(os.path.abspath(__file__)),
                            str(tmp_path / "test_b.py"), str(tmp_path / "b.xml")], stdout=out,
                           stderr=subprocess.STDOUT, timeout=120)
        printed = (tmp_path / "out").read_text()
        assert "rows [('test_b.py', 'INTERRUPTED'" in printed, printed
        time.sleep(1)
        leftover = subprocess.run(["pgrep", "-f", str(tmp_path / "test_b.py")], capture_output=True,
                                  text=True).stdout
        assert not leftover.strip(), f"the interrupted file's pytest still runs: {leftover}"
    finally:
        subprocess.run(["pkill", "-9", "-f", str(tmp_path / "test_b.py")])
