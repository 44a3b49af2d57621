"""DeepCompile's compile-pass schedule after load_checkpoint (patch deepcompile-schedule-resumes-past-its-steps).

An engine resumed from a checkpoint starts at the checkpoint's global step. Upstream 0.19.8 started a schedule entry
only at exactly its step, so a resumed engine never got passes and its first compile failed ("'NoneType' object is
not iterable"). The GPU zoo resumes every model from a checkpoint (tests/gpu/test_model_zoo.py); this checks the
schedule itself on the CPU, with DeepCompile's native handle stubbed.
"""

import pytest


class _Handle:
    resets = 0

    def reset(self):
        _Handle.resets += 1


@pytest.fixture
def backend(monkeypatch):
    pytest.importorskip("deepspeed")
    import deepspeed.compile.backend as backend

    _Handle.resets = 0
    monkeypatch.setattr(backend, "get_deepcompile_handle", lambda: _Handle())
    monkeypatch.setattr(backend, "next_passes", None)
    monkeypatch.setattr(backend, "log_rank0", lambda *args, **kwargs: None)  # no process group here
    return backend


FIRST, SECOND = ["gather_release"], ["gather_release", "prefetch"]


@pytest.mark.parametrize(
    "resumed_at, expected",
    [
        (0, FIRST),  # a fresh engine: unchanged
        (3, FIRST),  # resumed between the entries
        (5, SECOND),  # resumed exactly at the second entry
        (12, SECOND),  # resumed past every entry: the latest applies, once
    ])
def test_resumed_engine_gets_the_latest_schedule_entry_due(backend, resumed_at, expected):
    backend.init_schedule([(0, FIRST), (5, SECOND)])
    backend.launch_compile_passes(resumed_at)
    assert backend.next_passes == expected
    assert _Handle.resets == 1
    if expected is FIRST:
        backend.launch_compile_passes(resumed_at + 1)
        backend.launch_compile_passes(5)
        assert backend.next_passes == SECOND and _Handle.resets == 2
    # Nothing is started twice.
    backend.launch_compile_passes(resumed_at + 20)
    assert backend.next_passes == SECOND and _Handle.resets == (1 if expected is SECOND else 2)
