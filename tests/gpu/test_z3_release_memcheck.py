"""DeepCompile ZeRO-3 frees a gathered parameter by resizing its storage to zero bytes while code
Inductor generated may still hold views of it (upstream PR #8032 made the release free padded
gather buffers too). That is safe only if no alias is read after the release: run DeepCompile
ZeRO-3 training under compute-sanitizer memcheck and require zero errors, for the #8032 worker
(24 padded Linear layers in one graph) and for a dense model, an MoE-style model whose expert
dispatch runs in a skipped frame, and a tied-embedding model (workers/dc_z3_memcheck.py).

Needs 2 GPUs and compute-sanitizer (PATH or $CUDA_HOME/bin). Set GPU_TEST_REPORT_DIR to keep the
sanitizer output of each job.
"""

import os
import re
import shutil

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
SUMMARY_RE = re.compile(r"========= ERROR SUMMARY: (\d+) errors?")


def sanitizer():
    found = shutil.which("compute-sanitizer")
    if found:
        return found
    candidate = os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "compute-sanitizer")
    return candidate if os.access(candidate, os.X_OK) else None


class MemcheckJob(DistJob):

    def __init__(self, tool, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.tool = tool

    @property
    def command(self):
        # API errors are not memory errors (NCCL probes kernels it has no image for, and says so).
        return [
            self.tool, "--tool", "memcheck", "--report-api-errors", "no", "--target-processes", "all", "--print-limit",
            "20"
        ] + super().command


@pytest.fixture(scope="module")
def jobs():
    reason = skip_reason(NPROCS)
    if reason:
        pytest.skip(f"GPU test: {reason}")
    tool = sanitizer()
    if tool is None:
        pytest.skip("compute-sanitizer not found (PATH, $CUDA_HOME/bin)")
    env = {"TORCHINDUCTOR_COMPILE_THREADS": "1", "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    started = {
        name: MemcheckJob(tool, script, args, nprocs=NPROCS, timeout=TIMEOUT_S, env=env).start()
        for name, (script, args) in JOBS.items()
    }
    done = {}

    def result(name):
        if name not in done:
            done[name] = started[name].wait()
            report_dir = os.environ.get("GPU_TEST_REPORT_DIR")
            if report_dir:
                os.makedirs(report_dir, exist_ok=True)
                with open(os.path.join(report_dir, f"memcheck_{name}.log"), "w") as f:
                    f.write(done[name].output)
        return done[name]

    yield result
    for name in started:
        result(name)


@pytest.mark.parametrize("name", sorted(JOBS))
def test_deepcompile_z3_release_is_memcheck_clean(jobs, name):
    res = jobs(name)
    summaries = [int(n) for n in SUMMARY_RE.findall(res.output)]
    print(f"\n{name}: {res.summary()}; memcheck error summaries {summaries}; "
          f"losses {[r.get('losses') for _, r in sorted(res.results.items())]}")
    assert res.ok, res.failure_message()
    # torchrun and each rank print a summary
    assert len(summaries) >= NPROCS + 1, res.failure_message()
    assert sum(summaries) == 0, res.failure_message(120)
