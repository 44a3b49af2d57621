"""Starting a worker script at N ranks, as tools/bench and tools/steady-state do: under torchrun for several, alone
with the variables torchrun would set for one."""

import socket
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
