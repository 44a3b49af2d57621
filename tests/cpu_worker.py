"""Run a worker script of the CPU suite in a process of its own and read back its one-line JSON report.

Importing deepspeed in the pytest process would choose its accelerator for the whole process (tests of the CUDA op
builder would then get the CPU one), so the workers run apart: DeepSpeed's CPU accelerator, one OpenMP thread, no
torchrun variables inherited from the caller. A worker prints its report as one line starting with its prefix.
"""

import importlib.util
import json
import os
import subprocess
import sys

import pytest


def cpu_env(**extra):
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1", **extra)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run(script, args, prefix, cwd, timeout=600, **extra_env):
    """(the report the worker printed after `prefix`, everything it printed); skips where deepspeed is missing."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    proc = subprocess.run([sys.executable, script, *args], capture_output=True, text=True, env=cpu_env(**extra_env),
                          cwd=str(cwd), timeout=timeout)
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(prefix):]), proc.stdout + proc.stderr
