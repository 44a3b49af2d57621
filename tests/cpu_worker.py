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
import textwrap

import pytest

from warm_python import python_command


def cpu_env(**extra):
    """The worker's environment; `extra` may override DS_ACCELERATOR too (a GPU test's worker takes "cuda")."""
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    env.update(extra)
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    return env


def run_code(code, marker, timeout=300):
    """Run `code` (indented as a test module's string may be) in a process of its own on DeepSpeed's CPU accelerator;
    skips where deepspeed is missing, fails unless the process ends well having printed `marker`. Returns its
    output."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")
    proc = subprocess.run([*python_command(), "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=cpu_env(), timeout=timeout)
    assert proc.returncode == 0 and marker in proc.stdout, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout + proc.stderr


def code_report(code, prefix, timeout=300):
    """run_code(code, prefix), and the JSON report the code printed last after `prefix`."""
    out = run_code(code, prefix, timeout=timeout)
    return json.loads([line for line in out.splitlines() if line.startswith(prefix)][-1][len(prefix):])


def run(script, args, prefix, cwd, timeout=600, **extra_env):
    """(the report the worker printed after `prefix`, everything it printed); skips where deepspeed is missing, fails
    when the worker does not end within `timeout` s (having printed its report or not)."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    try:
        proc = subprocess.run([*python_command(), script, *args], capture_output=True, text=True,
                              env=cpu_env(**extra_env), cwd=str(cwd), timeout=timeout)
    except subprocess.TimeoutExpired as e:
        printed = e.stdout.decode("utf-8", "replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        pytest.fail(f"{os.path.basename(script)} did not end within {timeout} s; it printed:\n{printed[-3000:]}")
    lines = [line for line in proc.stdout.splitlines() if line.startswith(prefix)]
    assert proc.returncode == 0 and lines, f"exit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return json.loads(lines[-1][len(prefix):]), proc.stdout + proc.stderr


def run_ranks(script, args, nprocs=2, timeout=240):
    """`nprocs` gloo ranks of a worker under tests/gpu/dist.py's launcher on DeepSpeed's CPU accelerator, each
    writing its report to dist.result_path(). Checks that every rank ended and reported without an error; returns
    {rank: report}."""
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not importable")
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
    from dist import DistJob
    res = DistJob(script, args, nprocs=nprocs, timeout=timeout,
                  env={"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}).start().wait()
    assert res.ok and sorted(res.results) == list(range(nprocs)), res.failure_message()
    assert [res.results[r].get("error") for r in range(nprocs)] == [None] * nprocs, res.results
    return res.results


def run_two_ranks(script, args, timeout=240):
    """run_ranks at two ranks for a worker that ends by all-reducing a bucket of 1s on rank 0 and 2s on rank 1
    (DeepCompile's collective-ordering tests); checks also that the bucket met the bucket (3.0 on both: no stray
    collective of one rank paired with it)."""
    return final_bucket_met(run_ranks(script, args, nprocs=2, timeout=timeout))


def final_bucket_met(ranks):
    """The two ranks' reports, checked that the final bucket met the other rank's (3.0 on both)."""
    assert [ranks[r].get("reduced") for r in (0, 1)] == [3.0, 3.0], ranks
    return ranks
