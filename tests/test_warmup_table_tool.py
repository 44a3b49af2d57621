"""tools/warmup-table: docs/warmup.md's table is what the tool makes of the run records the page names."""

import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(REPO, "tools", "warmup-table")
PAGE = os.path.join(REPO, "docs", "warmup.md")


def test_the_pages_table_is_generated_from_the_run_records_it_names():
    with open(PAGE) as f:
        page = f.read()
    m = re.search(r"<!-- warmup-table: (.*?) -->\n(.*?)<!-- /warmup-table -->", page, re.S)
    assert m, "docs/warmup.md has no warmup-table markers"
    files = [os.path.join(REPO, p) for p in m.group(1).split()]
    proc = subprocess.run([sys.executable, TOOL, *files], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert m.group(2) == proc.stdout, "docs/warmup.md's table differs from tools/warmup-table's: regenerate it"


def test_a_file_that_is_no_run_record_is_a_clear_error(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{}")
    proc = subprocess.run([sys.executable, TOOL, str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "not a tools/bench run record" in proc.stderr, proc.stderr
