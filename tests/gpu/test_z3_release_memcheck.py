"""DeepCompile ZeRO-3 frees a gathered parameter by resizing its storage to zero bytes while code
Inductor generated may still hold views of it (upstream PR #8032 made the release free padded
gather buffers too). That is safe only if no alias is read after the release: run DeepCompile
ZeRO-3 training under compute-sanitizer memcheck and require zero errors, for the #8032 worker
(24 padded Linear layers in one graph) and for a dense model, an MoE-style model whose expert
dispatch runs in a skipped frame, and a tied-embedding model (workers/dc_z3_memcheck.py). A canary
job reads freed memory through a pointer taken before the free, and memcheck must report that read:
otherwise the clean reports would prove nothing.

The instrumented runs set PYTORCH_NO_CUDA_MEMORY_CACHING=1: with PyTorch's caching allocator a released
block stays allocated as far as the driver knows, and memcheck could not see a read of it.

NCCL's kernels are not instrumented (``--kernel-name-exclude kns=nccl``): they only move data into and
out of buffers DeepSpeed owns, and instrumenting them made the jobs too slow to finish.

Needs 2 GPUs and compute-sanitizer (PATH or $CUDA_HOME/bin). Set GPU_TEST_REPORT_DIR to keep the
sanitizer output of each job.
"""

import math
import os
import re
import shutil
import sys

import pytest

from dist import DistJob, skip_reason

NPROCS = 2
HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = float(os.environ.get("GPU_TEST_TIMEOUT_S", "480"))
JOBS = {
    "pr8032_padded_chain": (os.path.join(HERE, "workers", "founding_z3_release.py"), ["--steps", "2"]),
    "dense": (os.path.join(HERE, "workers", "dc_z3_memcheck.py"), ["--variant", "dense"]),
    "moe_skipped": (os.path.join(HERE, "workers", "dc_z3_memcheck.py"), ["--variant", "moe_skipped"]),
    "tied_embedding": (os.path.join(HERE, "workers", "dc_z3_memcheck.py"), ["--variant", "tied_embedding"]),
}
CANARY = (os.path.join(HERE, "workers", "dc_z3_memcheck.py"), ["--variant", "canary"])
NO_CACHING = {"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}
SUMMARY_RE = re.compile(r"========= ERROR SUMMARY: (\d+) errors?")


def sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidate = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer")
    return candidate if os.access(candidate, os.X_OK) else None


class MemcheckJob(DistJob):
    """torchrun starts each rank under compute-sanitizer (so torchrun itself and Inductor's compile
    workers are not instrumented); each rank prints its own error summary."""

    def __init__(self, tool, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool = tool

    @property
    def command(self):
        # API errors are not memory errors (NCCL probes kernels it has no image for, and says so).
        sanitizer = [
            self.tool, "--tool", "memcheck", "--report-api-errors", "no", "--print-limit", "20",
            "--kernel-name-exclude", "kns=nccl"
        ]
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={self.nprocs}",
            "--no-python", *sanitizer, sys.executable, self.script, *self.args
        ]


def _keep(report_dir, name, res):
    if report_dir:
        os.makedirs(report_dir, exist_ok=True)
        with open(os.path.join(report_dir, f"memcheck_{name}.log"), "w") as f:
            f.write(res.output)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    reason = skip_reason(NPROCS)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    tool = sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_HOME/bin)")
    report_dir = os.environ.get("GPU_TEST_REPORT_DIR")
    envs = {}
    for name in JOBS:
        caches = tmp_path_factory.mktemp(f"caches_{name}")
        envs[name] = {
            "TORCHINDUCTOR_COMPILE_THREADS": "1",
            "TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor"),
            "TRITON_CACHE_DIR": str(caches / "triton"),
        }
    # Compiling under the sanitizer is what takes it past any time limit: a plain run first fills
    # Inductor's and Triton's caches, so the instrumented run loads the same kernels from them.
    warm = {
        name: DistJob(script, args, nprocs=NPROCS, timeout=TIMEOUT_S, env=envs[name]).start()
        for name, (script, args) in JOBS.items()
    }
    canary = MemcheckJob(tool, *CANARY, nprocs=NPROCS, timeout=TIMEOUT_S, env=NO_CACHING).start()
    warmed = {name: job.wait() for name, job in warm.items()}
    started = {
        name: MemcheckJob(tool, script, args, nprocs=NPROCS, timeout=TIMEOUT_S, env=dict(envs[name],
                                                                                        **NO_CACHING)).start()
        for name, (script, args) in JOBS.items() if warmed[name].ok
    }
    started["canary"] = canary
    done = {}

    def result(name):
        if name not in started and name in warmed:
            return warmed[name]
        if name not in done:
            done[name] = started[name].wait()
            _keep(report_dir, name, done[name])
        return done[name]

    yield result
    for name in started:
        result(name)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_deepcompile_z3_release_is_memcheck_clean(jobs, name):
    res = jobs(name)
    summaries = [int(n) for n in SUMMARY_RE.findall(res.output)]
    print(f"\n{name}: {res.summary()}; memcheck error summaries {summaries}")
    assert res.ok, res.failure_message()
    assert len(summaries) == NPROCS, f"expected one memcheck summary per rank\n{res.failure_message()}"
    assert sum(summaries) == 0, res.failure_message(120)
    assert sorted(res.results) == list(range(NPROCS)), res.failure_message()
    for rank, r in sorted(res.results.items()):
        losses = r.get("losses") or [rec["loss"] for rec in r.get("records", [])]
        assert losses and all(math.isfinite(v) for v in losses), f"rank {rank}: losses {losses}"


def test_memcheck_reports_a_read_after_release(jobs):
    res = jobs("canary")
    summaries = [int(n) for n in SUMMARY_RE.findall(res.output)]
    print(f"\ncanary: {res.summary()}; memcheck error summaries {summaries}")
    assert not res.timed_out, res.failure_message()
    assert len(summaries) == NPROCS and all(n > 0 for n in summaries), res.failure_message()
    assert "Invalid __global__ read" in res.output, res.failure_message(120)
