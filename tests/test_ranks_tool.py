"""tools/ranks.py: a worker started at several ranks is stopped with every rank, though torchrun puts each rank in a
session of its own, out of reach of a signal to the launched process's group."""

import os
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "tools"))
import ranks  # noqa: E402

# A rank that will not stop on SIGTERM (stuck in a call that ignores it): only a kill ends it.
STUBBORN = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
open(os.path.join(sys.argv[1], "rank" + os.environ["RANK"]), "w").write(str(os.getpid()))
time.sleep(600)
"""


def alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("n", [1, 2])
def test_stop_ends_every_rank_even_one_that_ignores_sigterm(tmp_path, n):
    pytest.importorskip("torch")
    script = tmp_path / "stubborn.py"
    script.write_text(STUBBORN)
    env = dict(os.environ)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    p = subprocess.Popen(ranks.command([str(script), str(tmp_path)], n, env), env=env, start_new_session=True,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 120
    while len([f for f in os.listdir(tmp_path) if f.startswith("rank")]) < n:
        assert p.poll() is None and time.monotonic() < deadline, "the ranks did not start"
        time.sleep(0.2)
    pids = [int((tmp_path / f"rank{r}").read_text()) for r in range(n)]
    start = time.monotonic()
    ranks.stop(p, grace=2)
    assert time.monotonic() - start < 30
    assert p.returncode is not None
    time.sleep(0.5)
    assert not [pid for pid in pids if alive(pid)], "ranks left running after stop"
