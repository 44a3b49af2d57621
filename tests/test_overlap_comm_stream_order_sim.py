"""ZeRO-1/2 orders each gradient reduction after every stream that wrote what it reduces, and every copy into a
reused bucket buffer after the reduction that reads it: checked on CPU with simulated streams.

tests/stream_order_sim.py runs the cases of the GPU test (tests/gpu/test_overlap_comm_stream_order.py, same
worker, same injection) through the installed deepspeed's real ZeRO optimizer, attributes every op to a simulated
stream and reports each pair of conflicting accesses that no event, stream wait or host synchronization orders.
Upstream 0.19.8 has such pairs in every side-stream case without optimizer offload (an oversized gradient reduced
without waiting for the stream that wrote it; a copy from another stream into the buffer double buffering handed
back, not ordered after the reduction still reading it; without overlap_comm, nothing ordered at all); the offload
cases and the single-stream controls have none, on every version. The GPU test shows the wrong gradients.
"""

import os
import sys

import pytest

import cpu_worker

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "gpu", "workers"))
from overlap_comm_stream_order import CASES, REL_TOL, SIM_ONLY_CASES  # noqa: E402

PREFIX = "STREAM_ORDER_SIM "


def run_sim(tmp_path_factory, accelerator, cases=()):
    """The simulator's report, and everything it printed."""
    return cpu_worker.run(os.path.join(HERE, "stream_order_sim.py"), cases, PREFIX, tmp_path_factory.mktemp("sim"),
                          timeout=900, STREAM_ORDER_SIM_ACCELERATOR=accelerator)


@pytest.fixture(scope="module")
def sim_report(tmp_path_factory):
    return run_sim(tmp_path_factory, "events")[0]


@pytest.fixture(scope="module")
def sim_without_events(tmp_path_factory):
    # The offload cases are left out: their path has used events since before the fork (0.19.8 needs them too).
    return run_sim(tmp_path_factory, "without_events", list(CASES))


WITHOUT_RECORD_STREAM = {"z2_overlap_oversized_single_stream": "stops", "z2_no_overlap_buffer_reuse": "runs"}


@pytest.fixture(scope="module")
def sim_without_record_stream(tmp_path_factory):
    return run_sim(tmp_path_factory, "without_events_or_record_stream", list(WITHOUT_RECORD_STREAM))


@pytest.mark.parametrize("case", list(CASES) + list(SIM_ONLY_CASES))
def test_zero_gradient_reduction_has_no_unordered_stream_access(sim_report, case):
    rec = sim_report["cases"][case]
    assert "error" not in rec, rec.get("error")
    print(f"\n{case}: {rec['n_races']} unordered access pairs, in {rec['race_memory']}; "
          f"max relative gradient error {rec['max_rel_err']}")
    # The case ran as designed: hook order, bucket layout, the optimizer path it names.
    assert not rec["problems"], rec["problems"]
    assert rec["cpu_offload"] == (case in SIM_ONLY_CASES)
    assert rec["n_races"] == 0, (f"{sim_report['deepspeed_version']}: {rec['n_races']} pairs of accesses on "
                                 f"different streams are not ordered, e.g. {rec['races'][:4]}")
    # On CPU the ops run in program order, so the numbers are right whatever the ordering.
    assert max(rec["max_rel_err"].values()) <= REL_TOL


SINGLE_STREAM_CASES = [case for case in CASES if case.endswith("_single_stream")]


@pytest.mark.parametrize("case", list(CASES))
def test_accelerator_without_events_still_reduces_gradients(sim_without_events, case):
    """On an accelerator with streams but no events, no Stream.wait_event and no Tensor.record_stream, ZeRO-1/2 falls
    back to ordering each reduction after the current stream (as 0.19.8 did): every case runs and its gradients are
    right, and with the gradient hooks on one stream nothing is left unordered."""
    report, output = sim_without_events
    rec = report["cases"][case]
    assert "error" not in rec, rec.get("error")
    assert not rec["problems"], rec["problems"]
    assert max(rec["max_rel_err"].values()) <= REL_TOL
    if case in SINGLE_STREAM_CASES:
        assert rec["n_races"] == 0, f"{rec['n_races']} unordered pairs, e.g. {rec['races'][:4]}"


def test_accelerator_without_events_is_reported(sim_without_events):
    """The fallback says what the accelerator lacks and what is not ordered, once per optimizer."""
    report, output = sim_without_events
    said = [line for line in output.splitlines() if "gradient reductions wait for the current stream only" in line]
    assert len(said) == len(CASES), output[-3000:]
    assert "has no events, Stream.wait_event:" in said[0], said[0]


@pytest.mark.parametrize("case,outcome", WITHOUT_RECORD_STREAM.items())
def test_overlap_comm_without_record_stream_stops_with_a_clear_error(sim_without_record_stream, case, outcome):
    """overlap_comm's reductions record their stream on what they read (0.19.8 did too): where Tensor.record_stream
    fails, the optimizer stops when it is built and says which setting to change; without overlap_comm it runs."""
    report, _ = sim_without_record_stream
    rec = report["cases"][case]
    if outcome == "stops":
        error = rec.get("error") or ""
        assert "overlap_comm needs Tensor.record_stream" in error and "overlap_comm to false" in error, error[-2000:]
        assert "backward" not in error, "the error came from a gradient flush, not from building the optimizer"
    else:
        assert "error" not in rec, rec.get("error")
        assert max(rec["max_rel_err"].values()) <= REL_TOL
