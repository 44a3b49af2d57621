"""tests/warm_python.py: a worker started warm (a fork of this pytest process's server) is the process it would have
been started cold, with what it was given, and its end is the command's; what could differ runs cold."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

import warm_python as warm
from cpu_worker import cpu_env

CODE = """
import os, sys, torch
print("argv", sys.argv, "cwd", os.getcwd(), "var", os.environ.get("WARM_TEST_VAR"), "name", __name__)
print("stdin", sys.stdin.read().strip(), "accelerator", os.environ.get("DS_ACCELERATOR"))
print("to stderr", file=sys.stderr)
sys.exit(3)
"""


@pytest.fixture(scope="module")
def server_log(warm_python, tmp_path_factory):
    """The session's first server's log, once every server listens."""
    if warm_python is None:
        pytest.skip("no warm server in this run (FORK_TESTS_COLD, or deepspeed not installed)")
    path = os.environ[warm.SOCKET_ENV]
    deadline = time.monotonic() + 180
    for k in range(warm.RANK_SERVERS):
        while not os.path.exists(warm.server_socket(path, k)):
            assert warm_python.poll() is None, "the warm server exited"
            assert time.monotonic() < deadline, f"warm server {k} did not listen within 180 s"
            time.sleep(0.2)
    return path + ".log"


def run(command, tmp_path, **env):
    return subprocess.run([*command, "-c", CODE, "an", "argument"], input="from stdin", capture_output=True, text=True,
                          cwd=tmp_path, env=cpu_env(**{"WARM_TEST_VAR": "set", **env}), timeout=120)


def logged(log, needle):
    with open(log) as f:
        return [line for line in f if needle in line]


def test_a_warm_worker_gets_and_gives_what_a_cold_one_does(server_log, tmp_path):
    command = warm.python_command()
    assert command[1:] == [warm.CLIENT], command
    forked, cold = run(command, tmp_path), run([sys.executable], tmp_path)
    assert (forked.returncode, forked.stdout) == (cold.returncode, cold.stdout) == (3, cold.stdout), (forked, cold)
    assert "to stderr" in forked.stderr and "argv ['-c', 'an', 'argument']" in forked.stdout
    assert any(line.startswith("warm") for line in logged(server_log, "WARM_TEST_VAR")), "it did not run warm"


def test_another_accelerator_runs_cold(server_log, tmp_path):
    """DS_ACCELERATOR is read when deepspeed is imported, which the server has done with the CPU accelerator."""
    out = run(warm.python_command(), tmp_path, DS_ACCELERATOR="cuda", WARM_TEST_VAR="cold")
    assert out.returncode == 3 and "accelerator cuda" in out.stdout, out
    assert any("cold (['DS_ACCELERATOR'])" in line for line in logged(server_log, "WARM_TEST_VAR"))


def test_a_killed_client_takes_its_fork_with_it(server_log, tmp_path):
    marker = f"sleeping-{os.getpid()}-{time.monotonic()}"
    client = subprocess.Popen([*warm.python_command(), "-c", f"import time; print({marker!r}, flush=True); "
                               "time.sleep(300)"], stdout=subprocess.PIPE, text=True, env=cpu_env())
    assert client.stdout.readline().strip() == marker
    fork = int(re.match(r"warm (\d+):", logged(server_log, marker)[-1]).group(1))
    os.kill(fork, 0)  # running
    client.send_signal(signal.SIGKILL)
    client.wait(timeout=30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(fork, 0)
        except ProcessLookupError:
            return
        time.sleep(0.2)
    pytest.fail(f"the fork {fork} outlived its client")


# One write a line: both ranks share torchrun's unbuffered stdout, where print() writes each of its arguments apart and
# the other rank's line could land between them.
RANK = """
import os, random, sys
sys.stdout.write(f"rank {os.environ['RANK']} hash {hash('warm ranks')} random {random.random()}\\n")
sys.exit(int(os.environ["RANK"]) * int(sys.argv[1]))
"""


def test_torchrun_ranks_are_forks_of_different_servers_and_their_ends_reach_torchrun(server_log, tmp_path):
    """Two cold ranks hash strings differently and draw different random numbers, and so does a rank of the next job:
    so do warm ones. A rank's exit status is what torchrun sees of it."""
    script = tmp_path / "rank.py"
    script.write_text(RANK)

    def torchrun(code):
        return subprocess.run([*warm.torchrun_command("--standalone", "--nproc_per_node=2"), str(script), str(code)],
                              capture_output=True, text=True, cwd=tmp_path, env=cpu_env(), timeout=180)

    ran = torchrun(0)
    assert ran.returncode == 0, ran
    printed = dict(line.split(" ", 2)[1:] for line in ran.stdout.splitlines() if line.startswith("rank "))
    assert sorted(printed) == ["0", "1"], ran.stdout
    if not os.environ.get("PYTHONHASHSEED"):  # set, it makes every cold interpreter hash alike too
        assert printed["0"].split()[1] != printed["1"].split()[1], f"the ranks hash alike: {printed}"
    assert printed["0"].split()[3] != printed["1"].split()[3], f"the ranks draw the same numbers: {printed}"
    for k in range(warm.RANK_SERVERS):
        log = warm.server_socket(os.environ[warm.SOCKET_ENV], k) + ".log"
        assert any(line.startswith("warm") for line in logged(log, str(script))), f"no rank ran warm on server {k}"

    failed = torchrun(7)  # rank 1 exits with 7
    assert failed.returncode != 0 and re.search(r"exitcode\s*:\s*7", failed.stderr + failed.stdout), failed
    again = dict(line.split(" ", 2)[1:] for line in failed.stdout.splitlines() if line.startswith("rank "))
    assert again["0"].split()[3] != printed["0"].split()[3], "two forks of one server drew the same numbers"
