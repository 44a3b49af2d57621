"""DeepCompile ZeRO-3's eager fallback for frames Dynamo skips, checked on CPU against the installed wheel.

Runs tests/cpu_workers/dc_z3_skipped_frames_sim.py on 2 CPU processes (DS_ACCELERATOR=cpu): real ZeRO-3
partitioning and collectives, the engine's real forward/backward/step and DeepCompile's real init_z3, with
DeepCompile's CUDA-only op replaced by a no-op and parameter-free compiled regions (see the worker). The GPU tests
(tests/gpu/test_deepcompile_z3_skipped_frames.py) measure the same on real DeepCompile graphs.

Upstream 0.19.8 fails every variant: gradients of skipped-frame parameters are never reduced (they differ from
eager ZeRO-3, and the full-size param.grad left behind breaks zero_grad on CPU), forwards whose backward never
comes leave parameters gathered, and a frame skipped for a graph break inside a loop gets partitioned weights.

The peak of gathered parameter storage alive at once in a training step is counted through weak references to the
storages themselves (the worker's GatheredStorageCensus): a released parameter whose gathered storage something else
still references (autograd's saved tensors) counts until it is really freed, as it does in accelerator memory.
"""

import json
import os
import subprocess

import pytest

from warm_python import torchrun_command

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_workers", "dc_z3_skipped_frames_sim.py")
VARIANTS = ("modules", "loop", "checkpoint")
TIMEOUT_S = 900


def _run(variant, tmp_path):
    result_dir = tmp_path / variant
    result_dir.mkdir()
    env = dict(os.environ, DS_ACCELERATOR="cpu", DIST_RESULT_DIR=str(result_dir), OMP_NUM_THREADS="1")
    # The worker tests the installed deepspeed (or one installed with `pip install --target DIR` and DIR on
    # PYTHONPATH); nothing of this checkout may shadow it.
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    kept = [
        entry for entry in env.pop("PYTHONPATH", "").split(os.pathsep)
        if entry and not os.path.abspath(entry).startswith(repo + os.sep) and os.path.abspath(entry) != repo
    ]
    if kept:
        env["PYTHONPATH"] = os.pathsep.join(kept)
    cmd = [*torchrun_command("--standalone", "--nproc_per_node=2"), WORKER]
    proc = subprocess.Popen(cmd + ["--variant", variant],
                            env=env,
                            cwd=str(tmp_path),
                            stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT)
    return proc, result_dir


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    pytest.importorskip("deepspeed")
    tmp_path = tmp_path_factory.mktemp("dc_z3_sim")
    running = {variant: _run(variant, tmp_path) for variant in VARIANTS}
    out = {}
    for variant, (proc, result_dir) in running.items():
        try:
            output, _ = proc.communicate(timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            output, _ = proc.communicate()
        ranks = {}
        for rank in (0, 1):
            path = result_dir / f"rank{rank}.json"
            if path.exists():
                ranks[rank] = json.loads(path.read_text())
        out[variant] = (proc.returncode, output.decode("utf-8", "replace")[-6000:], ranks)
    return out


def _gathered(rec):
    return [(op, names) for op, names in rec["gathered_after"] if names]


@pytest.mark.parametrize("variant", VARIANTS)
def test_skipped_frame_parameters_match_eager_zero3_and_are_released(reports, variant):
    returncode, output, ranks = reports[variant]
    assert sorted(ranks) == [0, 1], f"exit {returncode}, reports of ranks {sorted(ranks)}\n{output}"
    for rank, r in sorted(ranks.items()):
        eager, dc = r.get("eager") or {}, r.get("deepcompile") or {}
        # What the backwards that ran left behind: every gradient reduced into its partition, none left on
        # a parameter, and the same gradients as eager ZeRO-3 (fp32 on CPU, same reduction: all but exact).
        left = [names for names in dc.get("left_grads", []) if names]
        assert not left, f"rank {rank}: full-size gradients left on parameters after backward: {left}"
        for step, (ref, got) in enumerate(zip(eager.get("grads", []), dc.get("grads", []))):
            for name, values in ref.items():
                assert got[name] == pytest.approx(values, rel=1e-4, abs=1e-6), f"rank {rank} step {step}: {name}"
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        reached = (dc["reached"], eager["reached"])
        assert dc["deepcompile_active"] and reached == ("done", "done"), reached
        assert len(dc["grads"]) == len(eager["grads"]) > 0
        assert dc["train_losses"] == pytest.approx(eager["train_losses"], rel=1e-5, abs=1e-6)
        # Nothing stays gathered after any operation, also after forwards whose backward never comes.
        assert all(dc["abandoned_requires_grad"]), dc["abandoned_requires_grad"]
        assert not _gathered(dc), f"rank {rank}: parameters left gathered: {_gathered(dc)}"
        if variant != "loop":
            # Module forwards scope the gathers: one layer at a time, not all of them.
            assert dc["max_gathered"] <= 2, f"rank {rank}: {dc['max_gathered']} parameters gathered at once"
        totals = dc["fallback_stats"]
        assert totals.get("total_reduced_grads", 0) > 0, totals


def test_submodule_called_outside_the_engine_forward_sees_gathered_parameters(reports):
    """generate() of a PEFT model calls its base model, not the engine: DeepCompile ZeRO-3 had removed the module hooks
    that gather for such a call, and the layer saw its partitioned weight ("'weight' must be 2-D" in generate())."""
    returncode, output, ranks = reports["modules"]
    assert sorted(ranks) == [0, 1], f"exit {returncode}, reports of ranks {sorted(ranks)}\n{output}"
    for rank, r in sorted(ranks.items()):
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        eager, dc = r["eager"]["outside_outputs"], r["deepcompile"]["outside_outputs"]
        calls = sum(1 for op, _ in r["plan"] if op == "outside")
        assert len(eager) == len(dc) == calls > 0
        for call, (want, got) in enumerate(zip(eager, dc)):
            assert got == pytest.approx(want, rel=1e-5, abs=1e-6), f"rank {rank}, call {call} outside the forward"
        after = [names for op, names in r["deepcompile"]["gathered_after"] if op.startswith("outside")]
        assert after and not any(after), f"rank {rank}: left gathered after the call: {after}"


@pytest.mark.parametrize("variant", VARIANTS)
def test_skipped_frame_gathered_storage_peak_within_one_layer_of_eager_zero3(reports, variant):
    """A skipped frame holds at most one gathered layer more than eager ZeRO-3, counting every gathered storage still
    referenced (a released weight whose storage a tensor autograd saved for the backward still holds counts)."""
    returncode, output, ranks = reports[variant]
    assert sorted(ranks) == [0, 1], f"exit {returncode}, reports of ranks {sorted(ranks)}\n{output}"
    for rank, r in sorted(ranks.items()):
        assert r["error"] is None, f"rank {rank}:\n{r['error']}"
        layer = r["layer_bytes"]
        eager, dc = r["eager"], r["deepcompile"]
        steps = sum(1 for op, _ in r["plan"] if op == "train")
        assert len(eager["gathered_bytes_peak"]) == len(dc["gathered_bytes_peak"]) == steps > 0
        # Every training step starts with no gathered storage alive, after forwards without backward too.
        assert not any(eager["gathered_bytes_at_start"]), eager["gathered_bytes_at_start"]
        assert not any(dc["gathered_bytes_at_start"]), dc["gathered_bytes_at_start"]
        # The census sees the gathers: eager ZeRO-3 holds at least one layer in every step.
        assert min(eager["gathered_bytes_peak"]) >= layer, eager["gathered_bytes_peak"]
        peaks = [(e / layer, d / layer) for e, d in zip(eager["gathered_bytes_peak"], dc["gathered_bytes_peak"])]
        over = [(step, e, d) for step, (e, d) in enumerate(peaks) if d - e > 1]
        assert not over, (f"rank {rank}: DeepCompile holds more than one gathered layer over eager ZeRO-3 "
                          f"(training step, eager layers, DeepCompile layers): {over}")
