"""tools/zoo-table: summaries joined by ':' render as one column, the later run's cell replacing the earlier one's (a
version whose rows ran in several commands, as some of docs/model-zoo.md's columns); a path that is not a summary is a
clear error, not a traceback."""

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


def test_a_labelled_column_says_which_release_ran_its_cells(tmp_path):
    first = summary(tmp_path / "a.json", "0.19.8+fork.9", {
        "cell/llama/1/deepcompile": {"ok": True, "seconds": 50.0},
        "cell/llama/3/deepcompile": {"ok": True, "seconds": 90.0},
        "trainer/3/deepcompile": {"ok": True, "seconds": 70.0},
    })
    second = summary(tmp_path / "b.json", "0.19.8+fork.10", {"cell/llama/3/deepcompile": {"ok": True, "seconds": 80.0}})
    out = zoo_table(f"the fork, 2 ranks={first}:{second}")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("| model | stage | the fork, 2 ranks DeepCompile | resumed |"), out.stdout
    # the Trainer's cell is not a zoo cell; fork.10 replaced fork.9's ZeRO-3 cell
    assert "by the release that ran them last: 0.19.8+fork.10 1, 0.19.8+fork.9 1" in out.stdout, out.stdout


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGE = os.path.join(REPO, "docs", "model-zoo.md")


def test_the_pages_tables_are_generated_from_the_summaries_they_name():
    import re
    import shlex
    with open(PAGE) as f:
        page = f.read()
    blocks = re.findall(r"<!-- zoo-table: (.*?) -->\n(.*?)<!-- /zoo-table -->", page, re.S)
    assert len(blocks) >= 2, "docs/model-zoo.md has lost its zoo-table markers"
    for columns, table in blocks:
        out = subprocess.run([sys.executable, TOOL, *shlex.split(columns)], capture_output=True, text=True, timeout=60,
                             cwd=REPO)
        assert out.returncode == 0, out.stderr
        assert table == out.stdout, f"docs/model-zoo.md's table for {columns[:80]}... differs from tools/zoo-table's"
