"""tools/dynamo-trace: Dynamo's first trace under DeepCompile ZeRO-3 with compile_blocks_once, per interpreter and
depth.

One real run on the CPU (this interpreter, 2 and 3 layers, one round) checks that the worker traces the model it says:
one compile region a layer, each call timed, and its torch named. The table's arithmetic (median, spread, failures, the
seconds a layer) is checked on a made-up record, and bad arguments on the command line."""

import json
import os
import subprocess
import sys

import pytest
import torch

import tool_module

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "dynamo-trace")
trace = tool_module.load("dynamo-trace")


def run(*args, timeout=600):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=timeout)


@pytest.mark.parametrize("args,says", [
    (["--python", "no-label"], "expected LABEL=PYTHON"),
    (["--python", "a=/no/such/python"], "is not an executable interpreter"),
    (["--python", f"../up={sys.executable}"], "a label is letters, digits"),
    (["--python", f"a={sys.executable}", "--python", f"a={sys.executable}"], "a label of its own"),
    (["--layers", "eight"], "expected depths like 8,32"),
    (["--layers", "0"], "depths of at least 1"),
])
def test_bad_arguments_are_refused_before_any_run(tmp_path, args, says):
    out = tmp_path / "t.json"
    proc = run(*args, "--out", str(out), timeout=60)
    assert proc.returncode == 2 and says in proc.stderr, proc.stderr
    assert not out.exists()


def test_the_table_takes_medians_spreads_failures_and_the_cost_of_a_layer():
    runs = [dict(label="old", layers=8, torch="2.11", first_s=s, reuses=None) for s in (10.0, 12.0, 11.0)]
    runs += [dict(label="old", layers=32, torch="2.11", first_s=s, reuses=None) for s in (34.0, 36.0)]
    runs += [dict(label="old", layers=32, error="exit 1: boom")]
    runs += [dict(label="new", layers=8, torch="2.14", first_s=5.0, reuses=7),
             dict(label="new", layers=32, torch="2.14", first_s=14.6, reuses=31)]
    rows, slopes = trace.summarize(dict(runs=runs))
    by = {(r["label"], r["layers"]): r for r in rows}
    assert by[("old", 8)]["median_s"] == 11.0 and by[("old", 8)]["spread_s"] == [10.0, 12.0]
    assert by[("old", 32)]["median_s"] == 35.0 and (by[("old", 32)]["failed"], by[("old", 32)]["runs"]) == (1, 3)
    assert by[("new", 32)]["reuses"] == 31 and by[("old", 32)]["reuses"] is None
    assert slopes == {"old": 1.0, "new": 0.4}  # (35.0 - 11.0) / 24, (14.6 - 5.0) / 24
    table = trace.render(dict(runs=runs, rounds=3, host="h"))
    assert "| old | 2.11 | - | 32 | 35.00 (34.00-36.00) | - | 1 of 3 | 1.0 |" in table, table


def test_a_run_times_a_trace_with_one_region_a_layer(tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tmp_path / "t.json"
    proc = run("--python", f"here={sys.executable}", "--layers", "2,3", "--repeats", "1", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    assert [(r["layers"], r["region_calls"], r["torch"]) for r in record["runs"]] == [(2, 2, torch.__version__),
                                                                                      (3, 3, torch.__version__)]
    assert all(r["first_s"] > 0 for r in record["runs"])
    assert f"| here | {torch.__version__} | {transformers.__version__} | 3 |" in proc.stdout, proc.stdout


def test_the_warmup_pages_table_is_the_tools_render_of_its_record():
    import re
    page = open(os.path.join(os.path.dirname(TOOL), "..", "docs", "warmup.md")).read()
    m = re.search(r"<!-- dynamo-trace: (\S+) -->\n(.*?)<!-- /dynamo-trace -->", page, re.S)
    assert m, "docs/warmup.md has no dynamo-trace markers"
    with open(os.path.join(os.path.dirname(TOOL), "..", m.group(1))) as f:
        assert m.group(2) == trace.render(json.load(f)), "docs/warmup.md's table differs: regenerate it"
