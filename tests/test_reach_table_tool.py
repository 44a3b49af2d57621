"""tools/reach-table: README.md's patch list and docs/eager-zero-audit.md's table are what the tool makes of the
patch headers' X-Reach fields; a header changed without regenerating them fails the check."""

import os
import shutil
import subprocess
import sys

from forkbuild import series

import tool_module

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "reach-table")
AUDIT = os.path.join("docs", "eager-zero-audit.md")


def reach_table(*args):
    return subprocess.run([sys.executable, TOOL, *args], capture_output=True, text=True, timeout=60)


def copy_of_the_repo(tmp_path):
    root = tmp_path / "repo"
    shutil.copytree(os.path.join(REPO, "patches"), root / "patches")
    (root / "docs").mkdir()
    shutil.copy(os.path.join(REPO, "README.md"), root / "README.md")
    shutil.copy(os.path.join(REPO, AUDIT), root / AUDIT)
    return root


def set_reach(root, name, field):
    path = root / "patches" / name
    head, diff = series.split_patch(path.read_text())
    lines = head.splitlines(keepends=True)
    start = next(i for i, line in enumerate(lines) if line.startswith("X-Reach:"))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" "):
        end += 1
    path.write_text("".join(lines[:start]) + field + "".join(lines[end:]) + "---\n" + diff)


def test_the_readme_and_the_audit_page_match_the_patch_headers():
    proc = reach_table("--check")
    assert proc.returncode == 0, proc.stderr


def test_a_header_changed_without_regenerating_fails_the_check_naming_both_files(tmp_path):
    root = copy_of_the_repo(tmp_path)
    assert reach_table("--check", "--root", str(root)).returncode == 0
    name = "deepcompile-graph-ids-survive-a-restart"
    set_reach(root, f"{name}.patch", "X-Reach: eager-zero-2, deepcompile\n")
    proc = reach_table("--check", "--root", str(root))
    assert proc.returncode == 1, proc.stderr
    assert str(root / "README.md") in proc.stderr and str(root / AUDIT) in proc.stderr, proc.stderr
    assert reach_table("--root", str(root)).returncode == 0  # regenerates both
    assert reach_table("--check", "--root", str(root)).returncode == 0
    row = next(line for line in (root / AUDIT).read_text().splitlines() if line.startswith(f"| [{name}]"))
    assert "| **yes**: eager-zero-2 | eager-zero-2, deepcompile |" in row, row
    readme = (root / "README.md").read_text()
    block = readme[readme.index("<!-- reach-table"):]  # the generated list (the prose above may name the groups)
    eager = block.index("**Eager ZeRO users")
    assert eager < block.index(f"- [{name}]") < block.index("**DeepCompile users"), "not listed as an eager patch"


def test_a_patch_whose_reach_it_cannot_read_is_a_clear_error(tmp_path):
    root = copy_of_the_repo(tmp_path)
    set_reach(root, "ds-report-fork-identity.patch", "X-Reach: everyone\n")
    proc = reach_table("--root", str(root))
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.startswith("reach-table: patch ds-report-fork-identity.patch: X-Reach: unknown value 'everyone'")


def test_every_reach_value_has_a_readme_group():
    tool = tool_module.load("reach-table")
    grouped = [v for _, values in tool.GROUPS for v in values]
    assert sorted(grouped) == sorted(series.REACH), "a value in no README group drops its patches from the list"
