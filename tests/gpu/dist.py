"""Launch a worker script on several local GPUs and collect what each rank reports.

The worker is started with ``python -m torch.distributed.run --standalone`` (torchrun), which
picks a free rendezvous port, so several jobs may run side by side; a one-rank job is started
without the launcher, with the environment torchrun would give it. Each rank writes one JSON
object to ``$DIST_RESULT_DIR/rank<RANK>.json`` (see :func:`result_path`); the launcher reads
those files back together with the exit code and the combined output, so that a rank killed by a
signal (SIGABRT from a failed C++ assert, say) is reported as such rather than as a bare
non-zero exit status.
"""

import importlib.util
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

try:
    # The suite's warm interpreter where the suite started one (tests/warm_python.py), else this interpreter.
    from warm_python import python_command, torchrun_command
except ImportError:  # imported from elsewhere (tools/zero-diff, a GPU host's tests/gpu alone)

    def python_command():
        return [sys.executable]

    def torchrun_command(*launcher_args):
        return [sys.executable, "-m", "torch.distributed.run", *launcher_args]


RESULT_DIR_ENV = "DIST_RESULT_DIR"
STACKS_CHARS = 8000  # of each rank's stack dump shown in a failure message

BASE_ENV = {
    # NVLink SHARP (multicast) stays off on the shared GPU hosts.
    "NCCL_NVLS_ENABLE": "0",
    "PYTHONUNBUFFERED": "1",
    "OMP_NUM_THREADS": "1",
}

_EXITCODE_RE = re.compile(r"exitcode\s*:\s*(-?\d+)")
_SIGNAL_RE = re.compile(r"Signal (\d+) \((SIG[A-Z0-9]+)\) received")


def cuda_device_count() -> int:
    try:
        import torch
    except ImportError:
        return 0
    if not torch.cuda.is_available():
        return 0
    return torch.cuda.device_count()


def skip_reason(nprocs: int) -> Optional[str]:
    """Why a test needing ``nprocs`` GPUs and deepspeed cannot run here, or None if it can."""
    count = cuda_device_count()
    if count == 0:
        return "CUDA is not available"
    if count < nprocs:
        return f"needs {nprocs} GPUs, found {count}"
    if importlib.util.find_spec("deepspeed") is None:
        return "deepspeed is not importable"
    return None


_PORTS_GIVEN = set()


def _free_port() -> int:
    """A port for a one-rank job's store. Below Linux's ephemeral range (32768 and up), so that no connection another
    job opens meanwhile is given it, and never the same twice in this process (jobs start side by side)."""
    for port in random.sample(range(20000, 32000), 200):
        if port in _PORTS_GIVEN:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _PORTS_GIVEN.add(port)
        return port
    raise RuntimeError("no free port in 20000-31999 for a one-rank job")


def result_path(rank: Optional[int] = None) -> str:
    """Path a worker rank writes its JSON result to (for use inside the worker)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0"))
    return os.path.join(os.environ[RESULT_DIR_ENV], f"rank{rank}.json")


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


@dataclass
class DistResult:
    returncode: Optional[int]
    timed_out: bool
    duration_s: float
    output: str
    results: Dict[int, dict] = field(default_factory=dict)
    command: List[str] = field(default_factory=list)
    # Each rank's Python stacks, where its deadline passed (workers' founding_common.stacks_at_deadline).
    stacks: Dict[int, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.returncode == 0 and not self.timed_out

    def rank_exit_codes(self) -> List[int]:
        """Exit codes of failed ranks as torchrun reported them (negative: killed by a signal)."""
        return [int(v) for v in _EXITCODE_RE.findall(self.output)]

    def signals(self) -> List[str]:
        names = {_signal_name(-code) for code in self.rank_exit_codes() if code < 0}
        names.update(name for _, name in _SIGNAL_RE.findall(self.output))
        if self.returncode is not None and self.returncode < 0:
            names.add(_signal_name(-self.returncode))
        return sorted(names)

    def tail(self, lines: int = 60) -> str:
        return "\n".join(self.output.splitlines()[-lines:])

    def summary(self) -> str:
        if self.timed_out:
            status = f"timed out after {self.duration_s:.0f}s"
        else:
            status = f"exit code {self.returncode} after {self.duration_s:.0f}s"
        codes = sorted(set(self.rank_exit_codes()))
        if codes:
            status += f"; rank exit codes {codes}"
        sigs = self.signals()
        if sigs:
            status += f"; killed by {', '.join(sigs)}"
        errors = {rank: r["error"].strip().splitlines()[-1] for rank, r in self.results.items() if r.get("error")}
        if errors:
            status += f"; worker errors {errors}"
        return status

    def save(self, name: str) -> None:
        """Keep the job's summary and per-rank reports as $GPU_TEST_REPORT_DIR/<name>.json, if that is set."""
        report_dir = os.environ.get("GPU_TEST_REPORT_DIR")
        if not report_dir:
            return
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f"{name}.json"), "w") as f:
            json.dump({"summary": self.summary(), "results": {str(k): v for k, v in self.results.items()},
                       "output_tail": "" if self.ok else self.tail(80), "stacks": self.stacks}, f, indent=1)

    def failure_message(self, lines: int = 60) -> str:
        stacks = "".join(f"\n--- rank {rank}'s stacks at its deadline ---\n{text[:STACKS_CHARS]}"
                         for rank, text in sorted(self.stacks.items()))
        return f"{' '.join(self.command)}\n{self.summary()}\n--- output tail ---\n{self.tail(lines)}{stacks}"


class DistJob:
    """A torchrun job running in the background; ``wait()`` returns its :class:`DistResult`."""

    def __init__(self,
                 script: str,
                 args: Sequence[str] = (),
                 nprocs: int = 2,
                 timeout: float = 600,
                 env: Optional[Dict[str, str]] = None,
                 cwd: Optional[str] = None):
        self.script = script
        self.args = [str(a) for a in args]
        self.nprocs = nprocs
        self.timeout = timeout
        self.extra_env = dict(env or {})
        self.cwd = cwd
        self._proc = None
        self._tmp = None
        self._log = None
        self._start = None

    @property
    def command(self) -> List[str]:
        if self.nprocs == 1:
            # One rank needs no launcher (a second Python importing torch): the environment torchrun would give it
            # is set in start().
            return [*python_command(), self.script, *self.args]
        return [*torchrun_command("--standalone", f"--nproc_per_node={self.nprocs}"), self.script, *self.args]

    def start(self) -> "DistJob":
        self._tmp = tempfile.TemporaryDirectory(prefix="dist_job_")
        result_dir = os.path.join(self._tmp.name, "results")
        os.makedirs(result_dir)
        env = dict(os.environ)
        env.update(BASE_ENV)
        env.update(self.extra_env)
        env[RESULT_DIR_ENV] = result_dir
        # Each job compiles as a first run does: DeepCompile keeps its profiles in Inductor's cache folder, and a job
        # that found an earlier test's profile of the same graph would plan from it instead of profiling.
        env.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(self._tmp.name, "inductor"))
        if self.nprocs == 1:
            env.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(_free_port()))
        self._log = open(os.path.join(self._tmp.name, "output.log"), "w+b")
        self._start = time.monotonic()
        # A new session, so that a timeout can kill torchrun together with every rank.
        self._proc = subprocess.Popen(self.command,
                                      stdout=self._log,
                                      stderr=subprocess.STDOUT,
                                      env=env,
                                      cwd=self.cwd,
                                      start_new_session=True)
        return self

    def done(self) -> bool:
        """True once the job has exited or run past its timeout (``wait()`` then returns at once)."""
        assert self._proc is not None, "start() first"
        return self._proc.poll() is not None or time.monotonic() - self._start > self.timeout

    def _kill(self):
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self._proc.pid, sig)
            except ProcessLookupError:
                return
            try:
                self._proc.wait(timeout=15)
                return
            except subprocess.TimeoutExpired:
                continue

    def wait(self) -> DistResult:
        assert self._proc is not None, "start() first"
        remaining = max(1.0, self.timeout - (time.monotonic() - self._start))
        timed_out = False
        try:
            self._proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            timed_out = True
            self._kill()
        duration = time.monotonic() - self._start
        self._log.seek(0)
        output = self._log.read().decode("utf-8", errors="replace")
        self._log.close()
        results, stacks = {}, {}
        result_dir = os.path.join(self._tmp.name, "results")
        for name in sorted(os.listdir(result_dir)):
            match = re.fullmatch(r"rank(\d+)\.stacks", name)
            if match:
                with open(os.path.join(result_dir, name), errors="replace") as f:
                    text = f.read()
                if text:
                    stacks[int(match.group(1))] = text
                continue
            match = re.fullmatch(r"rank(\d+)\.json", name)
            if not match:
                continue
            try:
                with open(os.path.join(result_dir, name)) as f:
                    results[int(match.group(1))] = json.load(f)
            except (OSError, ValueError) as exc:
                results[int(match.group(1))] = {"error": f"unreadable result file: {exc}"}
        self._tmp.cleanup()
        return DistResult(returncode=None if timed_out else self._proc.returncode,
                          timed_out=timed_out,
                          duration_s=duration,
                          output=output,
                          results=results,
                          command=self.command,
                          stacks=stacks)


def wait_for_all(started: Dict[Any, DistJob], name: Callable[[Any], str]) -> Dict[Any, DistResult]:
    """Wait for every job of `started` (key: a started job), keep each one's report under `name(key)`
    (DistResult.save), then fail with the first failed job's message: every job has ended by then and left its
    report. Returns key: result."""
    done = {key: job.wait() for key, job in started.items()}
    for key, res in done.items():
        res.save(name(key))
    for res in done.values():
        assert res.ok, res.failure_message()
    return done


def run_distributed(script: str,
                    args: Sequence[str] = (),
                    nprocs: int = 2,
                    timeout: float = 600,
                    env: Optional[Dict[str, str]] = None,
                    cwd: Optional[str] = None) -> DistResult:
    """Run ``script`` on ``nprocs`` local GPUs and wait for it (at most ``timeout`` seconds)."""
    return DistJob(script, args, nprocs=nprocs, timeout=timeout, env=env, cwd=cwd).start().wait()
