"""The zoo's knobs for a run split over two commands (tests/gpu/test_model_zoo.py): ZOO_CELLS picks the cells of
the second, ZOO_REPLAY merges both runs' summaries for the checks. Checked on CPU, where the zoo itself skips."""

import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu"))
import test_model_zoo as zoo  # noqa: E402


def test_zoo_cells_runs_only_the_matching_cells(monkeypatch):
    monkeypatch.setenv("ZOO_CELLS", r"/1/compile$|^cell/llama_ckpt/3/deepcompile$")
    monkeypatch.delenv("ZOO_MODELS", raising=False)
    cells = zoo._cells()
    assert ("cell", "llama_ckpt", 3, "deepcompile") in cells
    assert {c[3] for c in cells} == {"compile", "deepcompile"} and len(cells) == len(zoo.ZOO) + 1, cells
    assert not any(c[0] == "trainer" for c in cells)


def test_zoo_cells_matching_nothing_is_an_error(monkeypatch):
    monkeypatch.setenv("ZOO_CELLS", "no-such-cell")
    with pytest.raises(AssertionError, match="matches no cell"):
        zoo._cells()


def test_replay_merges_runs_the_later_cell_winning(tmp_path):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    first.write_text(json.dumps({"cells": {"cell/llama/3/deepcompile": {"ok": False}, "cell/llama/1/eager": {"ok": True}}}))
    second.write_text(json.dumps({"cells": {"cell/llama/3/deepcompile": {"ok": True}}}))
    cells = zoo._replayed(f"{first}:{second}")
    assert cells == {("cell", "llama", 3, "deepcompile"): {"ok": True}, ("cell", "llama", 1, "eager"): {"ok": True}}
