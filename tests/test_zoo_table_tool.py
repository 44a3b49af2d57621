"""tools/zoo-table: summaries joined by ':' render as one column, the later run's cell replacing the earlier one's (a
version whose rows ran in several commands, as docs/model-zoo.md's run 6); a path that is not a summary is a clear
error, not a traceback."""

import json
import os
import subprocess
import sys

TOOL = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools", "zoo-table")


def summary(path, version, cells):
    path.write_text(json.dumps({"deepspeed": version, "wall_s": 10.0, "ranks": 2, "cells": cells}))
    return str(path)


def zoo_table(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)


def test_joined_summaries_make_one_column_the_later_cell_winning(tmp_path):
    failed = {"ok": False, "seconds": 380.0, "error": "exit code 1", "reached": ["train2", "train2"]}
    first = summary(tmp_path / "a.json", "0.19.8+fork.19", {
        "cell/llama/3/deepcompile": failed,
        "cell/mixtral/3/deepcompile": {"ok": True, "seconds": 292.0},
    })
    second = summary(tmp_path / "b.json", "0.19.8+fork.21", {"cell/llama/3/deepcompile": {"ok": True, "seconds": 123.0}})
    out = zoo_table(f"{first}:{second}")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].count("DeepCompile") == 1 and "0.19.8+fork.19 + 0.19.8+fork.21, 2 ranks" in lines[0], lines[0]
    assert "| llama | 3 | ✓ 123 s | - |" in lines and "| mixtral | 3 | ✓ 292 s | - |" in lines, out.stdout
    assert "20 s" in out.stdout  # the commands' wall times summed


def test_a_path_that_is_no_summary_is_a_clear_error(tmp_path):
    (tmp_path / "other.json").write_text("[1, 2]")
    for arg in (str(tmp_path / "missing.json"), str(tmp_path / "other.json")):
        out = zoo_table(arg)
        assert out.returncode != 0 and out.stderr.startswith("zoo-table: ") and "Traceback" not in out.stderr, out
    assert zoo_table("--help").returncode == 0 and zoo_table().returncode == 2
