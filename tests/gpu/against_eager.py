"""A worker run at each ZeRO stage, eagerly and under DeepCompile, one process each, side by side on one GPU; and the
check that DeepCompile's figures are eager ZeRO's of the same stage.

The worker takes `--stage S --mode eager|deepcompile --deadline SECONDS` and reports a "run" holding lists of numbers
(losses, gradient norms...) under the keys the test compares.
"""

import pytest

from dist import DistJob, skip_reason

MODES = ("eager", "deepcompile")
# Six processes compile at once: one compile worker each keeps the host from thrashing.
ENV = {"TORCHINDUCTOR_COMPILE_THREADS": "1"}


def run_stages(worker, stages, deadline, name):
    """Every (stage, mode) job of `worker`, started together and waited for; each result saved as NAME_z<stage>_<mode>
    (GPU_TEST_REPORT_DIR). Skips where there is no GPU."""
    reason = skip_reason(1)
    if reason:
        pytest.skip(reason)
    started = {(s, m): DistJob(worker, ["--stage", str(s), "--mode", m, "--deadline", str(deadline)], nprocs=1,
                               timeout=deadline + 60, env=ENV).start()
               for s in stages for m in MODES}
    done = {}
    for (stage, mode), job in started.items():
        done[stage, mode] = job.wait()
        done[stage, mode].save(f"{name}_z{stage}_{mode}")
    return done


def runs(done, stage):
    """(DeepCompile's run, eager's run) at `stage`, once both jobs are known to have ended well."""
    got = {}
    for mode in MODES:
        res = done[stage, mode]
        assert res.ok, res.failure_message()
        got[mode] = res.results[0]["run"]
    return got["deepcompile"], got["eager"]


def assert_as_eager(dc, eager, keys, rtol):
    """Every number under `keys` of DeepCompile's run within `rtol` of eager's, as many of them."""
    for key in keys:
        assert len(dc[key]) == len(eager[key]), (key, dc[key], eager[key])
        for a, b in zip(dc[key], eager[key]):
            assert abs(a - b) <= rtol * abs(b), (key, dc[key], eager[key])
