"""tools/bench on the CPU: a real run of the tiny cell set through the whole protocol, and its refusals."""

import contextlib
import json
import os
import subprocess
import sys

import pytest

import tool_module
from cpu_worker import cpu_env
from warm_python import python_command

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "bench")
sys.path.insert(0, os.path.join(REPO, "tools"))
from bench_cells import SETS, SUBJECTS, flops_per_token, parse_sets  # noqa: E402


def bench(*args, timeout=600):
    env = dict(os.environ, DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_flops_per_token_is_six_n_plus_the_attention_term():
    assert flops_per_token(1000, layers=2, hidden=8, seq=16) == 6 * 1000 + 12 * 2 * 8 * 16


def test_every_subject_of_the_tiny_set_gives_interleaved_timed_blocks(tmp_path):
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    # A fresh host JIT-builds DeepSpeed's CPU communication op in the first engine: a deadline with room for it.
    proc = bench("--sets", "tiny", "--repeats", "2", "--steps", "3", "--warmup", "2", "--group-deadline-s", "900",
                 "--budget-s", "1000", "--profile", "ds-z1", "--out", str(tmp_path), timeout=1200)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "bench.json") as f:
        data = json.load(f)
    subjects = [s for group in SETS["tiny"][3] for s in group]
    assert [r["subject"] for r in data["rows"]] == subjects
    for row in data["rows"]:
        assert len(row["blocks"]) == 2 and all(len(b["step_s"]) == 3 for b in row["blocks"]), row
        assert row["spread"][0] <= row["step_s"] <= row["spread"][1] or len({*row["spread"]}) == 1
        assert row["tokens_per_step"] == 2 * 32 and row["step_s"] > 0
    ds = [r for r in data["rows"] if r["subject"].startswith("ds-")]
    assert all("+fork." in r["deepspeed"] for r in ds), [r.get("deepspeed") for r in ds]
    assert "| tiny | ds-z3 |" in (tmp_path / "bench.md").read_text()
    # the host beside the GPU: 0.19.8 ran 7 % faster on one host than on two others (docs/bench.md)
    assert data["host_ops_per_s"] > 1000 and data["host_cpu"].endswith(" cores"), data
    assert "k tiny ops/s (measured)" in (tmp_path / "bench.md").read_text()
    # --profile: the named subject only, a trace, and its time split by category (on a CPU: aten ops' own time)
    profiled = {r["subject"]: r["profile"] for r in data["rows"] if "profile" in r}
    assert list(profiled) == ["ds-z1"], list(profiled)
    prof = profiled["ds-z1"]
    assert prof["wall_ms"] > 0 and prof["host_aten_ops"] > 0 and prof["device_ms"].get("matmul", 0) > 0, prof
    assert sum(prof["device_ms"].values()) <= prof["wall_ms"] * 1.05, prof
    with open(tmp_path / "traces" / "tiny.ds-z1.here.json") as f:
        assert json.load(f)["traceEvents"], "empty trace"


@pytest.fixture(scope="module")
def world_sizes(tmp_path_factory):
    """One run of ds-z1 at world sizes 2 and 1 (torchrun and gloo for the two ranks), each process on GPUs of its own
    (--apart), profiled after its timed blocks: what the tests of several ranks below read. (out, bench.json)"""
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("bench-world-sizes")
    proc = bench("--sets", "tiny", "--only", "ds-z1", "--gpus", "2,1", "--apart", "5,6,7", "--repeats", "2", "--steps",
                 "2", "--warmup", "1", "--group-deadline-s", "600", "--budget-s", "700", "--profile", "ds-z1", "--out",
                 str(out), timeout=900)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(out / "bench.json") as f:
        return out, json.load(f)


def test_two_ranks_run_the_protocol_and_the_profile_together(world_sizes):
    """--gpus 2 (torchrun, gloo here): every rank takes each request, the profile included (each rank removed the
    request file, so a rank could miss it and the profiled rank wait in a collective the other never joined)."""
    out, data = world_sizes
    (row, ) = [r for r in data["rows"] if r["gpus"] == 2]
    assert "error" not in row, row.get("output_tail")
    assert row["world_size"] == 2 and row["tokens_per_step"] == 2 * 2 * 32 and len(row["blocks"]) == 2, row
    assert row["profile"]["host_aten_ops"] > 0, row["profile"]
    # A trace of each rank: rank 1's shows what rank 0's cannot, the time a collective waited for the other rank.
    traces = sorted(name for name in os.listdir(out / "traces") if ".2gpu" in name)
    assert len(traces) == 2 and traces[1] == traces[0][:-len(".json")] + ".rank1.json", traces


@pytest.mark.parametrize("model,skipped_share", [("tiny", 0), ("tiny-moe", 2 / 4)])
def test_flops_leave_out_the_embedding_and_the_experts_a_token_skips(model, skipped_share):
    import bench_step
    built, n_all, n_not_computed, _ = bench_step.build_model(model)
    experts = sum(p.numel() for name, p in built.named_parameters()
                  if name.endswith(("mlp.experts.gate_up_proj", "mlp.experts.down_proj")))
    assert (experts > 0) == (skipped_share > 0)
    assert n_not_computed == built.get_input_embeddings().weight.numel() + experts * skipped_share


CAUSAL_PROBE = """
import sys, torch, transformers
sys.path.insert(0, sys.argv[1])
import bench_step
cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=64)
torch.manual_seed(0)
model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
ids = torch.randint(0, 64, (1, 16))
calls = []

def backend(gm, example_inputs):
    for n in gm.graph.nodes:
        if "scaled_dot_product_attention" in str(n.target):
            calls.append((n.kwargs.get("attn_mask") is not None, n.kwargs.get("is_causal")))
    return gm.forward

def sdpa_calls():
    torch._dynamo.reset()
    calls.clear()
    logits = torch.compile(model, backend=backend)(input_ids=ids).logits
    return sorted(set(calls)), logits

print("before", *sdpa_calls()[0])
eager = model(input_ids=ids).logits
bench_step.skip_causal_mask_under_compile()
after, logits = sdpa_calls()
print("after", *after)
print("equal", torch.allclose(logits, eager, atol=1e-6))
"""


def test_causal_subjects_compile_sdpa_without_a_mask_and_the_same_logits():
    """Whole-model compiles on transformers <= 5.17 (any torch) or torch < 2.14 pass SDPA a materialized causal mask,
    which its flash kernel does not take; a `-causal` subject gets no mask and is_causal=True, as in eager, and the
    same logits."""
    pytest.importorskip("transformers")
    proc = subprocess.run([*python_command(), "-c", CAUSAL_PROBE, os.path.join(REPO, "tools")], capture_output=True,
                          text=True, timeout=300, env=cpu_env())
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = dict(line.split(" ", 1) for line in proc.stdout.splitlines())
    assert lines["after"] == "(False, True)" and lines["equal"] == "True", proc.stdout
    import torch
    if tuple(int(x) for x in torch.__version__.split(".")[:2]) < (2, 14):
        assert lines["before"] == "(True, False)", proc.stdout  # the defect the subjects work around


def test_only_keeps_the_named_subjects_of_each_group():
    (name, model, seq, batch, groups), = parse_sets("default", "dc-z1,compile")
    assert (name, model) == ("default", SETS["default"][0])
    assert groups == [["dc-z1"], ["compile"]]
    assert parse_sets("default") == [("default", *SETS["default"])]


@pytest.mark.parametrize("subject,bucket", [("dc-z3", None), ("dc-z3-pad", None), ("dc-z3-rb1e8", 10**8),
                                            ("dc-z3-rbauto", 2048 * 2048)])
def test_a_reduce_bucket_subject_sets_the_bucket_it_names(subject, bucket):
    from bench_step import ds_config, reduce_bucket_size
    assert subject in SUBJECTS
    size = reduce_bucket_size(subject, 2048)
    assert size == bucket
    zero = ds_config(3, True, False, 1, reduce_bucket=size)["zero_optimization"]
    assert zero.get("reduce_bucket_size") == bucket


@pytest.mark.parametrize("args,message", [
    (["--sets", "nope"], "unknown cell set 'nope'"),
    (["--site", "x=/nonexistent"], "--site x=/nonexistent: want LABEL=DIR"),
    (["--repeats", "0"], "must be at least 1"),
    (["--profile", "ds-z9"], "--profile ds-z9: not a subject"),
    (["--sets", "default", "--only", "dc-z1,ds-z2"], "--only ds-z2: not a subject of the sets default"),
    (["--sets", "multi-gpu", "--only", "dc-z3", "--gpus", "2,4", "--apart", "0,1,2,3"],
     "--apart 0,1,2,3: the group dc-z3 of the set multi-gpu needs 6 GPUs"),
])
def test_bad_arguments_are_refused_before_anything_runs(tmp_path, args, message):
    proc = bench(*args, "--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_each_process_keeps_a_compile_cache_of_its_own_under_cache_dir(tmp_path):
    # Every process of a command used to share --cache-dir: FSDP2's 32-layer row warmed up in 7 s in the cache its
    # 8-layer row had filled (17.6 s cold).
    cli, keep = _cli(), str(tmp_path / "keep")
    caches = [cli.compile_cache("out", keep, pid) for pid in ("blocks-1.5b-8l.fsdp2", "blocks-1.5b-32l.fsdp2")]
    assert caches[0] != caches[1] and all(os.path.dirname(c) == keep for c in caches), caches
    assert cli.compile_cache("out", keep, "blocks-1.5b-8l.fsdp2") == caches[0]  # the next run: a restart
    cold = cli.compile_cache("out", None, "blocks-1.5b-8l.fsdp2")
    assert cold == os.path.join("out", "caches", "blocks-1.5b-8l.fsdp2"), cold


@pytest.mark.parametrize("sites,gpus,held", [(3, [4], 3), (2, [2, 4], 4), (2, [4], 2), (1, [2, 4], 2), (3, [1], 3)])
def test_a_gpu_holds_one_rank_of_every_process_of_its_group(sites, gpus, held):
    cli = _cli()
    sets = parse_sets("multi-gpu-1.5b-4096", "dc-z3")
    assert cli.processes_a_gpu_holds(sets, [("x", None)] * sites, gpus) == (held, "multi-gpu-1.5b-4096", "dc-z3")


@pytest.mark.parametrize("sites,gpus,held", [(3, "4", 3), (2, "2,4", 4)])
def test_a_multi_rank_group_that_crowds_a_gpu_is_refused(tmp_path, sites, gpus, held):
    """Three versions of the 4-rank 1.5B/4096 step on 4 GPUs, and a 2- and a 4-rank process of two
    versions, never finished warming up and cost a 10-minute command each: refused before anything
    runs, unless --crowd. Two processes of several ranks a GPU warm up."""
    args = ["--sets", "multi-gpu-1.5b-4096", "--only", "dc-z3", "--gpus", gpus]
    for label in "abc"[:sites]:
        (tmp_path / label / "deepspeed").mkdir(parents=True)
        args += ["--site", f"{label}={tmp_path / label}"]
    assert held > _cli().MAX_RANKED_PROCESSES_A_GPU
    proc = bench(*args, "--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2 and f"puts {held} processes on a GPU" in proc.stderr, proc.stderr
    assert "--crowd" in proc.stderr and not (tmp_path / "out").exists()


def test_a_site_that_does_not_hold_the_deepspeed_imported_fails_its_row(tmp_path):
    """--site must test what it names: a site whose deepspeed is shadowed reports an error, not another's times."""
    pytest.importorskip("deepspeed")
    site = tmp_path / "site"
    (site / "deepspeed").mkdir(parents=True)  # a deepspeed that fails to import
    (site / "deepspeed" / "__init__.py").write_text("raise ImportError('a broken site')\n")
    proc = bench("--sets", "tiny", "--site", f"broken={site}", "--repeats", "1", "--steps", "1", "--warmup", "1",
                 "--out", str(tmp_path / "out"))
    assert proc.returncode == 1
    with open(tmp_path / "out" / "bench.json") as f:
        rows = {r["subject"]: r for r in json.load(f)["rows"]}
    assert "step_s" in rows["torch"] and "a broken site" in rows["ds-z1"]["error"], rows["ds-z1"].get("error")


def test_a_subject_cut_short_is_marked_as_such_in_the_table(tmp_path):
    """A process that died after its first block (the H100 run's overlap_comm cell, cut by its deadline) showed as a
    plain result with a spread of one block; the table now says how many blocks ran and why it stopped."""
    row = {"set": "s", "subject": "ds-z2", "site": "fork", "deepspeed": "x", "blocks": [{"step_s": [0.5, 0.7]}],
           "flops_per_step": 1e12, "tokens_per_step": 10, "first_step_s": 1.0, "error": "exited with 1 before res.1"}
    data = {"device": "d", "gpus": 1, "torch": "t", "transformers": "tf", "peak_tflops": 100.0, "repeats": 3,
            "steps": 2, "warmup": 1, "rows": [row]}
    cli = _cli()
    data["rows"] = [cli.summarize(row, data["peak_tflops"])]
    (tmp_path / "bench.json").write_text(json.dumps(data))
    cli.render(str(tmp_path))
    assert "0.6000 (0.6000-0.6000; 1 of 3 blocks, then: exited with 1 before res.1)" in (tmp_path / "bench.md").read_text()


def _cli():
    return tool_module.load("bench")


def test_the_warm_up_keeps_what_selective_gather_decided_and_restores_the_log_level():
    """Runs on three 4-GPU hosts (docs/bench.md) gave 0.19.8 0.1206 s and 0.129-0.130 s a step at 4 GPUs, and nothing
    in the logs told them apart: DeepSpeed logs at WARNING, and selective_gather, which chooses from the device's free
    memory what stays gathered, reports at INFO. A DeepCompile ZeRO-3 row now keeps those records of its warm-up."""
    pytest.importorskip("deepspeed")
    from deepspeed.utils import log_dist, logger
    from bench_step import SelectiveGatherLog
    level, handlers = logger.level, list(logger.handlers)
    plan = SelectiveGatherLog()
    log_dist("selective_gather graph_id=7 fwd_peak_resident=10 fwd_transient_peak=20", ranks=[0])
    log_dist("Set persistent: 3 size: 4096 persistent_mem: 4096 shape: (2048,)", ranks=[0])
    log_dist("selective_gather selected_count=1 selected_bytes=4096", ranks=[0])
    logger.warning("something else")
    kept = plan.finish()
    assert [line.split("selective_gather ")[-1] for line in kept] == [
        "graph_id=7 fwd_peak_resident=10 fwd_transient_peak=20", "selected_count=1 selected_bytes=4096"]
    assert logger.level == level and logger.handlers == handlers


def _rendered(tmp_path, **fields):
    """bench.md of one timed DeepCompile ZeRO-3 row of a one-GPU run, with `fields` added to the row."""
    row = {"set": "s", "subject": "dc-z3", "site": "fork", "deepspeed": "x", "blocks": [{"step_s": [0.5]}],
           "flops_per_step": 1e12, "tokens_per_step": 10, "first_step_s": 1.0, **fields}
    cli = _cli()
    data = {"device": "d", "gpus": 1, "torch": "t", "transformers": "tf", "peak_tflops": 100.0, "repeats": 1,
            "steps": 1, "warmup": 1, "rows": [cli.summarize(row, 100.0)]}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    cli.render(str(tmp_path))
    return (tmp_path / "bench.md").read_text()


@pytest.mark.parametrize("last, kept", [
    ("selective_gather selected_count=190 selected_bytes=2471628800", "190 (2.30 GiB)"),
    ("selective_gather no effective headroom for new persistent params",
     "none: no effective headroom for new persistent params"),
])
def test_the_table_says_what_selective_gather_kept(tmp_path, last, kept):
    table = _rendered(tmp_path, selective_gather=[
        "[Rank 0] selective_gather target_graph_id=1 profiled_mem_lists=4 effective_available_mem=55940702208 "
        "persistent_count=0 persistent_bytes=0 candidate_count=190 candidate_bytes=2471628800", "[Rank 0] " + last])
    assert f"| s | dc-z3 | x | {kept} | 190 (2.30 GiB) | 52.10 |" in table


def test_two_sites_of_one_version_are_told_apart_in_the_table(tmp_path):
    """A run measured fork.34 beside fork.34 with one header changed: both rows of bench.md said 0.19.8+fork.34, and
    only the JSON told which was which. Where sites share a version, the table names the site."""
    cli = _cli()
    rows = [{"set": "s", "subject": "dc-z3", "site": site, "deepspeed": ver, "blocks": [{"step_s": [step]}],
             "flops_per_step": 1e12, "tokens_per_step": 10, "first_step_s": 1.0,
             "selective_gather": ["[Rank 0] selective_gather selected_count=1 selected_bytes=1024"]}
            for site, ver, step in (("base", "1.0+f.1", 0.5), ("changed", "1.0+f.1", 0.4), ("old", "1.0", 0.6))]
    data = {"device": "d", "gpus": 1, "torch": "t", "transformers": "tf", "peak_tflops": 100.0, "repeats": 1,
            "steps": 1, "warmup": 1, "rows": [cli.summarize(r, 100.0) for r in rows]}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    cli.render(str(tmp_path))
    table = (tmp_path / "bench.md").read_text()
    assert "| s | dc-z3 | 1.0+f.1 (base) | 0.5000 " in table and "| s | dc-z3 | 1.0+f.1 (changed) | 0.4000 " in table
    assert "| s | dc-z3 | 1.0 | 0.6000 " in table
    assert "| s | dc-z3 | 1.0+f.1 (changed) | 1 " in table  # the selective_gather table too


def test_a_profile_counts_each_collective_a_step_issues(tmp_path):
    """A profile gave 0.19.8 39.7 ms more of communication kernels a step than fork.33, and the traces were
    not kept: which collectives, how many, was not known. A profile now counts them."""
    from bench_step import communication_kernels
    kernels = [("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 1000.0)] * 6 + [
        ("ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", 3000.0)] * 2 + [
        ("ampere_bf16_s16816gemm_bf16_128x64_ldg8_f2f_tn", 9000.0)] * 4
    comm = communication_kernels(kernels, 2)
    assert comm == {"ncclDevKernel_AllGather_RING_LL": {"per_step": 3.0, "ms": 3.0},
                    "ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL": {"per_step": 1.0, "ms": 3.0}}
    profile = {"steps": 2, "wall_ms": 20.0, "host_aten_ops": 10, "communication_kernels": comm,
               "device_ms": {"communication": 6.0, "matmul": 18.0}}
    table = _rendered(tmp_path, profile=profile)
    assert "| s | dc-z3 | x | `ncclDevKernel_AllGather_RING_LL` | 3 | 3.0 |" in table
    assert "| s | dc-z3 | x | `ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL` | 1 | 3.0 |" in table


@pytest.mark.parametrize("name,cat", [("Memcpy DtoD (Device -> Device)", "copies and casts"),
                                      ("Memset (Device)", "copies and casts"),
                                      ("ncclDevKernel_AllGather_RING_LL", "communication"),
                                      ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm>", "matmul"),
                                      ("FusedAdamMathFunctor", "optimizer"), ("triton_poi_fused_add_0", "other")])
def test_kernel_categories_ignore_case(name, cat):
    """The profiler names the device's copies `Memcpy ...` and `Memset ...`: matched case-sensitively they were
    `other`, not copies."""
    import bench_step
    assert bench_step.category(name) == cat


def _event(name, start, end, device=True, annotation=False):
    from types import SimpleNamespace

    from torch.autograd import DeviceType
    span = SimpleNamespace(start=start, end=end, elapsed_us=lambda: end - start)
    return SimpleNamespace(name=name, device_type=DeviceType.CUDA if device else DeviceType.CPU, time_range=span,
                           is_user_annotation=annotation, self_cpu_time_total=end - start)


def test_a_profile_counts_no_record_function_range_as_device_time():
    """A collectives table listed `nccl:all_reduce` beside the all-reduce kernels it launched, with their
    time: the c10d collectives' record_function ranges come back as device events too, and were summed with the
    kernels (0.19.8's communication 60.1 ms a step, 49.5 ms of it kernels). A range covers the gaps between its
    kernels as well: an optimizer step's range made those gaps busy and hid the communication in them."""
    import bench_step
    events = [_event("nvjet_gemm", 0, 4000), _event("ncclDevKernel_AllReduce_Sum_f64_RING_LL(x)", 4000, 6000),
              _event("nccl:all_reduce", 4000, 6000, annotation=True),
              _event("multi_tensor_apply_kernel", 6000, 7000), _event("ncclDevKernel_AllGather_RING_LL(x)", 7000, 8000),
              _event("multi_tensor_apply_kernel", 8000, 9000),
              _event("Optimizer.step#FusedAdam.step", 6000, 9000, annotation=True),
              _event("aten::mm", 0, 100, device=False), _event("aten::add_", 0, 50, device=False)]
    summary = bench_step.summarize_profile(events, 1, 0.010, on_device=True)
    assert summary["device_ms"] == pytest.approx({"matmul": 4.0, "communication": 3.0, "optimizer": 2.0})
    assert summary["communication_kernels"] == {
        "ncclDevKernel_AllReduce_Sum_f64_RING_LL": {"per_step": 1.0, "ms": 2.0},
        "ncclDevKernel_AllGather_RING_LL": {"per_step": 1.0, "ms": 1.0}}
    assert summary["device_busy_ms"] == pytest.approx(9.0) and summary["device_idle_ms"] == pytest.approx(1.0)
    # the all-gather between the two optimizer kernels ran with nothing beside it, as did the all-reduce
    assert summary["exposed_communication_ms"] == pytest.approx(3.0)
    assert summary["host_aten_ops"] == 2
    on_cpu = bench_step.summarize_profile(events, 1, 0.010, on_device=False)
    assert on_cpu["device_ms"] == pytest.approx({"matmul": 0.1, "other": 0.05}) and on_cpu["host_aten_ops"] == 2


def test_a_row_failed_in_a_group_the_budget_cut_names_the_budget():
    """A one-GPU run gave 0.19.8's 1.5B DeepCompile ZeRO-3 group 149 s of --group-deadline-s 250, because
    --budget-s (counted from before the op builds) had 149 s left; the row said only "no ready within 149 s"."""
    cut = _cli().note_budget_cut
    failed = cut({"error": "no ready within 144 s"}, 149.0, 250.0)["error"]
    assert failed == ("no ready within 144 s (--budget-s left this group 149 s of --group-deadline-s 250; "
                      "raise --budget-s)")
    assert cut({"error": "no ready within 245 s"}, 250.0, 250.0)["error"] == "no ready within 245 s"
    assert "error" not in cut({"step_s": 0.1}, 149.0, 250.0)


def test_the_pinned_upstream_release_is_measured_as_a_site(tmp_path, pinned_upstream_site):
    """--site LABEL=pinned takes the release the fork is pinned to (built by tools/pinned_upstream.site, as for
    tools/zero-diff) and its DeepSpeed subjects run from there: the table puts 0.19.8 next to the rest. The build is
    the test environment's one (conftest's pinned_upstream_site, the same function), found where the tool looks for
    it, with the ops JIT-built for it."""
    pytest.importorskip("deepspeed")
    os.symlink(pinned_upstream_site, tmp_path / "site-up")
    proc = bench("--sets", "tiny", "--site", "up=pinned", "--repeats", "1", "--steps", "1", "--warmup", "1",
                 "--group-deadline-s", "900", "--budget-s", "1000", "--out", str(tmp_path), timeout=1500)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with open(tmp_path / "bench.json") as f:
        rows = json.load(f)["rows"]
    ds = [r for r in rows if r["subject"].startswith("ds-")]
    assert ds and all(r["deepspeed"] == "0.19.8" and r["site"] == "up" for r in ds), [
        (r["subject"], r.get("deepspeed"), r.get("error")) for r in ds]
    assert os.path.isdir(tmp_path / "site-up" / "deepspeed")


@pytest.mark.parametrize("value, plain", [("9.0a", "9.0"), ("9.0a;10.0f+PTX", "9.0;10.0+PTX"), ("8.0 9.0a", "8.0 9.0"),
                                          ("9.0", None), ("", None), (None, None)])
def test_upstream_sites_build_their_ops_for_plain_architectures(value, plain):
    """0.19.8's op builder stops at an architecture suffix (`invalid literal for int() with base 10: '0a'`: every
    DeepCompile subject of 0.19.8 failed so on an H100 host whose image sets 9.0a). tools/bench gives a pinned
    upstream site the list without suffixes, and leaves every other site's environment as it is."""
    import pinned_upstream
    assert pinned_upstream.plain_arch_list(value) == plain
    tool = _cli()
    upstream, fork = "/sites/site-0.19.8", "/sites/fork"
    tool.UPSTREAM_SITES.add(upstream)
    saved = os.environ.get("TORCH_CUDA_ARCH_LIST")
    try:
        if value is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = value
        assert tool.site_env(upstream).get("TORCH_CUDA_ARCH_LIST") == (plain or value)
        assert tool.site_env(fork).get("TORCH_CUDA_ARCH_LIST") == value
        assert tool.site_env(upstream)["TORCH_EXTENSIONS_DIR"] != tool.site_env(fork)["TORCH_EXTENSIONS_DIR"]
    finally:
        if saved is None:
            os.environ.pop("TORCH_CUDA_ARCH_LIST", None)
        else:
            os.environ["TORCH_CUDA_ARCH_LIST"] = saved


def test_a_site_reached_through_a_link_shares_the_ops_built_for_its_folder(tmp_path, monkeypatch):
    """The suite's differential tests reach its one install of 0.19.8 through links (tools/zero-diff's
    OUT/site-0.19.8): the import path and the JIT build folder are those of the folder linked to, so its ops' sources
    keep their paths and ninja finds them built, where a build folder of the link's own built them again (a minute
    of CPU a site). Another folder still gets a build folder of its own."""
    import pinned_upstream
    site, other, link = tmp_path / "site", tmp_path / "other", tmp_path / "out" / "site-0.19.8"
    site.mkdir(), other.mkdir(), link.parent.mkdir()
    link.symlink_to(site)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    monkeypatch.delenv("PYTHONPATH", raising=False)
    through_link, direct = pinned_upstream.site_env(str(link), True), pinned_upstream.site_env(str(site), True)
    assert through_link == direct and through_link["PYTHONPATH"] == str(site)
    assert pinned_upstream.site_env(str(other), True)["TORCH_EXTENSIONS_DIR"] != direct["TORCH_EXTENSIONS_DIR"]


@pytest.mark.parametrize("version, upstream", [("0.19.8", True), ("0.19.8+fork.32", False), (None, False)])
def test_a_site_installed_from_upstreams_wheel_gets_plain_architectures(tmp_path, monkeypatch, version, upstream):
    """`--site v0198=DIR`, DIR a `pip install --target` of 0.19.8's wheel, failed its JIT build on a 9.0a
    host (only `--site LABEL=pinned` had the plain list), and cost a 4-GPU run. The release is read from DIR's
    dist-info."""
    tool = _cli()
    (tmp_path / "deepspeed").mkdir()
    if version:
        (tmp_path / f"deepspeed-{version}.dist-info").mkdir()
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0a")
    label, path = tool.parse_site(f"v={tmp_path}", str(tmp_path / "out"))
    assert (label, path) == ("v", str(tmp_path))
    assert tool.site_env(path)["TORCH_CUDA_ARCH_LIST"] == ("9.0" if upstream else "9.0a")
    with pytest.raises(ValueError, match="want LABEL=DIR"):
        tool.parse_site(f"v={tmp_path / 'missing'}", str(tmp_path / "out"))


@pytest.mark.parametrize("versions, named", [(["0.19.8+fork.34"], "0.19.8+fork.34"), ([], None),
                                             (["0.19.8", "0.19.8+fork.35"], None)])
def test_a_run_record_names_what_each_site_held(tmp_path, versions, named):
    """An 8B warm-up cut by its deadline never reported its deepspeed version, and its record could not say which
    release it measured; the driver reads it from the site's dist-info, without importing it."""
    import pinned_upstream
    for v in versions:
        (tmp_path / f"deepspeed-{v}.dist-info").mkdir()
    assert pinned_upstream.installed_version(str(tmp_path)) == named


def test_exposed_communication_is_the_time_no_computation_hides():
    import bench_step
    kernels = [(0, 10, "matmul"), (20, 30, "attention"), (5, 25, "communication"), (40, 45, "communication"),
               (2, 8, "other")]
    split = bench_step.device_time_split(kernels)
    # busy: [0, 30] and [40, 45]; computing: [0, 10] and [20, 30]; exposed: (10, 20) and (40, 45)
    assert split == {"device_busy": 35, "exposed_communication": 15}
    assert bench_step.device_time_split([(0, 4, "communication")])["exposed_communication"] == 4


def test_split_trace_reads_the_kernels_of_a_profiled_trace(tmp_path):
    trace = tmp_path / "t.json"
    events = [{"cat": "kernel", "name": "nvjet_gemm", "ts": 0, "dur": 3000},
              {"cat": "kernel", "name": "ncclDevKernel_AllGather_RING_LL", "ts": 1000, "dur": 6000},
              {"cat": "gpu_user_annotation", "name": "nccl:all_gather", "ts": 1000, "dur": 6000},
              {"cat": "gpu_user_annotation", "name": "Optimizer.step#FusedAdam.step", "ts": 7000, "dur": 2000},
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD (Device -> Device)", "ts": 8000, "dur": 1000},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9000}]
    trace.write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, TOOL, "--split-trace", str(trace)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    split = json.loads(proc.stdout)  # 3 steps: ms per step
    assert split["device_busy_ms"] == pytest.approx(8 / 3)
    assert split["exposed_communication_ms"] == pytest.approx(4 / 3)
    assert split["device_ms"] == pytest.approx({"matmul": 1.0, "communication": 2.0, "copies and casts": 1 / 3})
    trace.write_text(json.dumps({"traceEvents": events[2:3] + events[5:]}))
    proc = subprocess.run([sys.executable, TOOL, "--split-trace", str(trace)], capture_output=True, text=True)
    assert proc.returncode == 2 and "no device kernels" in proc.stderr, proc.stderr


def test_split_trace_says_which_phase_left_which_collective_exposed(tmp_path):
    """57 ms of an 8B step's communication ran exposed, and the trace's totals could not say whether the forward's
    all-gathers or the backward's reduce-scatters were waited for: each kernel goes to the phase whose host range
    launched it (by its launch's correlation id)."""
    trace = tmp_path / "t.json"

    def launch(ts, corr):
        return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "args": {"correlation": corr}}

    def kernel(name, ts, dur, corr):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}

    events = [{"cat": "user_annotation", "name": "bench:forward", "ts": 0, "dur": 100},
              {"cat": "user_annotation", "name": "bench:backward", "ts": 100, "dur": 100},
              {"cat": "user_annotation", "name": "bench:optimizer", "ts": 200, "dur": 50},
              launch(1, 1), kernel("ncclDevKernel_AllGather_RING_LL(int)", 10, 3000, 1),   # 1000 hidden by the gemm
              launch(2, 2), kernel("nvjet_gemm", 2010, 4000, 2),
              launch(110, 3), kernel("nvjet_gemm", 6000, 3000, 3),
              launch(120, 4), kernel("ncclDevKernel_ReduceScatter_Sum(int)", 8000, 4000, 4),  # 3000 exposed
              launch(130, 7), kernel("nvjet_gemm", 12500, 200, 7),                          # 500 idle before it
              {"cat": "cuda_driver", "name": "cuLaunchKernelEx", "ts": 210, "dur": 1, "args": {"correlation": 5}},
              kernel("multi_tensor_apply_kernel", 13000, 1000, 5),                          # 1 ms after the backward
              kernel("ncclDevKernel_AllReduce_Sum(int)", 14500, 300, 6)]                    # no launch recorded
    trace.write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, TOOL, "--split-trace", str(trace)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    phases = json.loads(proc.stdout)["phases"]  # 3 steps: ms per step
    assert set(phases) == {"forward", "backward", "optimizer", "unattributed"}
    assert phases["forward"]["exposed_communication_ms"] == pytest.approx(2 / 3)
    assert phases["forward"]["exposed_by_collective"] == {"ncclDevKernel_AllGather_RING_LL": pytest.approx(
        {"per_step": 1 / 3, "ms": 1.0, "exposed_ms": 2 / 3})}
    assert phases["backward"]["exposed_communication_ms"] == pytest.approx(1.0)
    assert phases["backward"]["device_ms"] == pytest.approx({"matmul": 3.2 / 3, "communication": 4 / 3})
    assert phases["optimizer"]["exposed_communication_ms"] == 0
    assert phases["unattributed"]["exposed_communication_ms"] == pytest.approx(0.1)
    # the longest waits, each where it came in its phase: the all-gather first thing in the forward
    assert phases["backward"]["longest_waits"] == [{"exposed_ms": 3.0, "collective_ms": 4.0, "at_ms": 2.0,
                                                    "collective": "ncclDevKernel_ReduceScatter_Sum"}]
    assert phases["forward"]["longest_waits"][0]["at_ms"] == 0.0
    assert phases["forward"]["longest_waits"][0]["exposed_ms"] == pytest.approx(2.0)
    # idle: none within the forward; the backward's first kernel starts while the forward's last runs, and its last
    # waits 0.5 ms after the reduce-scatter; the optimizer's starts 0.3 ms after the backward's last kernel
    assert phases["forward"]["idle_within_ms"] == 0 and "idle_before_ms" not in phases["forward"]
    assert phases["backward"]["idle_before_ms"] == 0
    assert phases["backward"]["idle_within_ms"] == pytest.approx(0.5 / 3)
    assert phases["optimizer"]["idle_before_ms"] == pytest.approx(0.3 / 3)
    assert phases["optimizer"]["idle_within_ms"] == 0


def test_split_trace_names_each_phases_longest_kernels_and_its_host_ops(tmp_path):
    """A step the host bounds shows as device idle time, which does not say where the host spent it, nor which
    kernels made a phase long: each phase lists its longest-running kernels and counts the aten ops the host ran in
    its range (nested ones too, as the profile's total does)."""
    import bench_step
    trace = tmp_path / "t.json"

    def launched(name, ts, dur, corr, at):
        return [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": at, "dur": 1, "args": {"correlation": corr}},
                {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}]

    long_name = "void at::native::elementwise_kernel<128, 2, " + "x" * 200
    events = [{"cat": "user_annotation", "name": "bench:forward", "ts": 0, "dur": 100},
              {"cat": "user_annotation", "name": "bench:backward", "ts": 100, "dur": 100},
              *launched("nvjet_gemm", 1000, 600, 1, 10), *launched("nvjet_gemm", 2000, 600, 2, 20),
              *launched(long_name, 3000, 900, 3, 30), *launched("Memcpy DtoD (Device -> Device)", 4000, 300, 4, 110),
              *[{"cat": "cpu_op", "name": op, "ts": ts, "dur": 1}
                for op, ts in (("aten::mm", 10), ("aten::to", 15), ("aten::_to_copy", 16), ("aten::copy_", 110))],
              {"cat": "cpu_op", "name": "dc::reduce_grad", "ts": 111, "dur": 1},  # not an aten op
              {"cat": "cpu_op", "name": "aten::add_", "ts": 250, "dur": 1}]  # after the phases
    trace.write_text(json.dumps({"traceEvents": events}))
    proc = subprocess.run([sys.executable, TOOL, "--split-trace", str(trace)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    phases = json.loads(proc.stdout)["phases"]  # 3 steps: per step
    assert phases["forward"]["top_kernels"] == [
        {"name": "nvjet_gemm", "per_step": pytest.approx(2 / 3), "ms": pytest.approx(1.2 / 3)},
        {"name": long_name[:bench_step.KERNEL_NAME_CHARS], "per_step": pytest.approx(1 / 3), "ms": pytest.approx(0.3)}]
    assert [k["name"] for k in phases["backward"]["top_kernels"]] == ["Memcpy DtoD (Device -> Device)"]
    assert phases["forward"]["host_aten_ops"] == pytest.approx(3 / 3)
    assert phases["backward"]["host_aten_ops"] == pytest.approx(1 / 3)


def test_a_profiled_step_records_its_phases_for_the_trace_split(tmp_path):
    """The phase split reads `bench:` ranges; every kind of subject's step has to record them while profiled, and
    only then."""
    import torch
    import bench_step
    model = torch.nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        with bench_step.phase("forward"):
            loss = model(torch.ones(2, 4)).sum()
        with bench_step.phase("backward"):
            loss.backward()
        with bench_step.phase("optimizer"):
            opt.step()

    trace = tmp_path / "t.json"
    bench_step.profile_steps(step, torch.device("cpu"), 2, str(trace))
    names = [e["name"] for e in json.loads(trace.read_text())["traceEvents"]
             if e.get("cat") == "user_annotation" and e["name"].startswith("bench:")]
    assert sorted(names) == sorted(["bench:forward", "bench:backward", "bench:optimizer"] * 2)
    assert isinstance(bench_step.phase("forward"), contextlib.nullcontext)
    source = open(bench_step.__file__).read()
    for body in source.split("def step(x=ids):")[1:]:
        assert all(f'phase("{p}")' in body.split("return step")[0] for p in bench_step.PHASES), body[:200]


def test_weak_scaling_is_tokens_per_gpu_against_the_smallest_world_size(tmp_path):
    def row(subject, site, gpus, step_s):
        # 2048 tokens a GPU a step
        return {"set": "s", "subject": subject, "site": site, "deepspeed": site, "gpus": gpus, "first_step_s": 1.0,
                "blocks": [{"step_s": [step_s] * 3}], "flops_per_step": 1e12, "tokens_per_step": 2048 * gpus}
    cli = _cli()
    rows = [cli.summarize(r, 100.0) for r in (row("dc-z3", "fork", 2, 0.1), row("dc-z3", "fork", 4, 0.125),
                                                 row("fsdp2", "-", 2, 0.2), row("dc-z3", "up", 4, 0.1))]
    (w, ) = cli.weak_scaling(rows)  # "up" ran at one world size only: nothing to compare
    assert (w["subject"], w["site"]) == ("dc-z3", "fork") and w["efficiency"] == {2: 1.0, 4: 0.8}, w
    assert w["per_gpu_tokens_s"] == {2: 20480.0, 4: 16384.0}, w
    data = {"device": "d", "gpus": [2, 4], "torch": "t", "transformers": "tf", "peak_tflops": 100.0, "repeats": 1,
            "steps": 3, "warmup": 1, "rows": rows}
    (tmp_path / "bench.json").write_text(json.dumps(data))
    cli.render(str(tmp_path))
    md = (tmp_path / "bench.md").read_text()
    assert "| s | dc-z3, 4 GPUs | fork | 0.1250" in md
    assert "| s | dc-z3 | fork | 20480 (100.0 %) | 16384 (80.0 %) |" in md


def test_several_world_sizes_run_side_by_side_in_one_group(world_sizes, tmp_path):
    """--gpus 1,2: one process a world size, timed in turns; the weak-scaling table compares them (gloo here)."""
    out, data = world_sizes
    assert data["gpus"] == [1, 2]
    assert [(r["gpus"], r["world_size"], len(r["blocks"])) for r in data["rows"]] == [(1, 1, 2), (2, 2, 2)], data
    assert "| tiny | ds-z1 | here |" in (out / "bench.md").read_text()
    assert bench("--gpus", "2,x", "--out", str(tmp_path / "bad")).returncode == 2


def test_apart_gives_each_process_gpus_of_its_own(world_sizes):
    """--apart: the processes of a group take the listed GPUs one after another (a 1-rank and a 2-rank process of
    one subject here), so that none shares a device with another's compiles and memory (gloo on CPU: the visible
    devices each process saw are what is checked)."""
    _, data = world_sizes
    assert [(r["gpus"], r["devices"], r["cuda_visible_devices"]) for r in data["rows"]] == [(1, "5", "5"),
                                                                                            (2, "6,7", "6,7")]


def test_a_site_holds_what_lies_in_its_folder_reached_through_links(tmp_path):
    within = _cli().within
    (tmp_path / "site-up" / "deepspeed").mkdir(parents=True)
    (tmp_path / "site-up2" / "deepspeed").mkdir(parents=True)
    os.symlink(tmp_path / "site-up", tmp_path / "link")
    module = str(tmp_path / "site-up" / "deepspeed" / "__init__.py")
    assert within(module, str(tmp_path / "link")) and within(module, str(tmp_path / "site-up"))
    assert within(str(tmp_path / "link" / "deepspeed" / "__init__.py"), str(tmp_path / "site-up"))
    assert not within(str(tmp_path / "site-up2" / "deepspeed" / "__init__.py"), str(tmp_path / "site-up"))
