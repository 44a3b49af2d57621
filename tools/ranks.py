"""Starting a worker script at N ranks, as tools/bench and tools/steady-state do: under torchrun for several, alone
with the variables torchrun would set for one; and stopping it with every rank."""

import os
import signal
import socket
import subprocess
import sys


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(script_and_args, ranks, env):
    """The command that starts `script_and_args` (a script, then its arguments) at `ranks` ranks; a lone process's
    rendezvous variables go into `env`."""
    if ranks > 1:
        return [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={ranks}",
                f"--master-port={free_port()}", *script_and_args]
    env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()))
    return [sys.executable, *script_and_args]


def descendants(pid):
    """Every process below pid (Linux: /proc), children first."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        pid = todo.pop()
        below = [c for c, p in parent.items() if p == pid]
        out += below
        todo += below
    return out


def stop(p, grace):
    """Stop a process started with start_new_session from `command`, and every rank of it. torchrun starts each rank
    in a session of its own, so a signal to the launched process's group reaches torchrun alone: SIGTERM, which
    torchrun forwards to its ranks (a lone worker gets it itself), then, `grace` seconds on, SIGKILL to all that was
    below it."""
    below = descendants(p.pid)
    try:
        os.killpg(p.pid, signal.SIGTERM)
        p.wait(grace)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        pass
    for pid in [p.pid] + below:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait()
