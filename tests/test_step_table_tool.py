"""tools/step-table: docs/bench.md's summary table is what the tool makes of the run records the page names, and a
file that is no run record is a clear error."""

import json
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "step-table")
PAGE = os.path.join(REPO, "docs", "bench.md")


def step_table(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60, cwd=REPO)


def test_the_pages_table_is_generated_from_the_run_records_it_names():
    with open(PAGE) as f:
        page = f.read()
    m = re.search(r"<!-- step-table: (.*?) -->\n(.*?)<!-- /step-table -->", page, re.S)
    assert m, "docs/bench.md has no step-table markers"
    proc = step_table(*m.group(1).split())
    assert proc.returncode == 0, proc.stderr
    assert m.group(2) == proc.stdout, "docs/bench.md's table differs from tools/step-table's: regenerate it"


def test_the_pages_profile_table_is_generated_from_the_run_records_it_names():
    with open(PAGE) as f:
        page = f.read()
    m = re.search(r"<!-- profile-table: (.*?) -->\n(.*?)<!-- /profile-table -->", page, re.S)
    assert m, "docs/bench.md has no profile-table markers"
    proc = step_table("--profiles", *m.group(1).split())
    assert proc.returncode == 0, proc.stderr
    assert m.group(2) == proc.stdout, "docs/bench.md's profile table differs from tools/step-table's: regenerate it"


def test_the_profile_table_has_a_row_for_each_profiled_row_only(tmp_path):
    profile = {"wall_ms": 700.0, "device_busy_ms": 500.0, "device_idle_ms": 200.0, "exposed_communication_ms": 57.0,
               "device_ms": {"matmul": 262.0, "attention": 115.0, "communication": 105.5}, "host_aten_ops": 9128.0}
    run = {"device": "NVIDIA H200", "rows": [
        {"model": "llama-8b", "seq": 4096, "subject": "dc-z3", "deepspeed": "0.19.8+fork.39", "gpus": 4,
         "profile": profile},
        {"model": "llama-8b", "seq": 4096, "subject": "fsdp2", "gpus": 4, "step_s": 0.5},
        {"model": "llama-8b", "seq": 4096, "subject": "dc-z3-causal", "deepspeed": "0.19.8+fork.40", "gpus": 4,
         "profile": dict(profile, phases={"forward": {"exposed_communication_ms": 8.94},
                                          "backward": {"exposed_communication_ms": 4.1}})}]}
    path = tmp_path / "bench-p.json"
    path.write_text(json.dumps(run))
    out = step_table("--profiles", str(path))
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("| p |")]
    assert rows == ["| p | 4x H200 | llama-8b, 4096 | dc-z3 | fork.39 | 700.0 | 500.0 | 200.0 | 57.0 | - | 262.0 | "
                    "115.0 | 105.5 | 0.0 | 0.0 | 0.0 | 9,128 |",
                    # where the trace's split says which phase left communication exposed
                    "| p | 4x H200 | llama-8b, 4096 | dc-z3-causal | fork.40 | 700.0 | 500.0 | 200.0 | 57.0 | "
                    "8.9 / 4.1 / - | 262.0 | 115.0 | 105.5 | 0.0 | 0.0 | 0.0 | 9,128 |"], out.stdout


def test_rows_per_gpu_versions_and_rows_never_timed(tmp_path):
    run = {"device": "NVIDIA H100 80GB HBM3", "rows": [
        {"model": "llama-1.5b", "seq": 4096, "subject": "dc-z3", "deepspeed": "0.19.8+fork.33", "gpus": 4,
         "step_s": 0.125, "spread": [0.12, 0.13], "tokens_s": 131072.0, "mfu": 0.375,
         "peak_allocated": 2 * 2**30, "peak_reserved": 3 * 2**30},
        {"model": "llama-1.5b", "seq": 4096, "subject": "fsdp2", "deepspeed": "0.19.8+fork.33", "gpus": 4,
         "step_s": 0.25, "spread": [0.2, 0.3], "tokens_s": 65536.0},
        {"model": "qwen2-moe", "seq": 2048, "subject": "dc-z3", "site": "old", "gpus": 2,
         "error": "RuntimeError: 'weight' must be 2-D\nmore"},
    ]}
    path = tmp_path / "bench-x.json"
    path.write_text(json.dumps(run))
    out = step_table(str(path))
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert "| x | 4x H100 | llama-1.5b, 4096 | dc-z3 | fork.33 | 0.1250 (0.1200-0.1300) | 32,768 | 37.5 % | " \
           "2.00 / 3.00 |" in lines, out.stdout
    assert "| x | 4x H100 | llama-1.5b, 4096 | fsdp2 | - | 0.2500 (0.2000-0.3000) | 16,384 | - | - |" in lines
    assert "| x | 2x H100 | qwen2-moe, 2048 | dc-z3 | site old | not timed: RuntimeError: 'weight' must be 2-D " \
           "| - | - | - |" in lines, out.stdout


def test_a_file_that_is_no_run_record_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = step_table(str(bad))
    assert proc.returncode != 0 and "not a tools/bench run record" in proc.stderr, proc.stderr
