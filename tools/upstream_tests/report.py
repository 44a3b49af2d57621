"""Expected-failures files, verdicts, summaries and JUnit XML for tools/upstream-tests.

An expected-failures file (tests/upstream/expected-failures.txt, one for all matrices) has one entry per
line; blank lines and lines starting with `#` are ignored:

    [TAG,...] NODE_ID | reason

NODE_ID is a pytest node id relative to upstream's tests/ directory, or a prefix of one that ends at a `/`,
`::` or `[` boundary (a directory, a file, a class, every parametrization of a test). The tags are optional;
an entry applies only while all of its tags are active. Active are the target, `fork` or `upstream` (which
deepspeed is under test), and the names passed with --condition: e.g. `offline` (no internet), or the
checkout the tests come from when they are not the pinned tag's. The longest applicable entry wins.

Verdicts: a test with an applicable entry must fail (or error, or fail to collect); a pass is an
unexpected pass. Without an entry a failure is unexpected. Skips are fine either way. A tag of STATE_TAGS marks
a failure that depends on the state of the test's worker process (a pass under such an entry is a pass).
"""

import json
import re
import xml.etree.ElementTree as ET
from dataclasses import dataclass

VERDICTS = ("passed", "failed", "xfailed", "skipped", "unexpected-pass")
BAD = ("failed", "unexpected-pass")
# gpu-forked: the test fails only where its xdist worker had initialized CUDA (in what it collected or ran before)
# when pytest-forked forked the test's process (4xH100: 0.19.8 failed one such test in one run, passed it in another)
STATE_TAGS = frozenset(["gpu-forked"])
_LINE = re.compile(r"^(?:\[([\w,-]+)\]\s+)?([^\s\[|]+(?:\[.*?\])?)\s+\|\s+(\S.*)$")


@dataclass(frozen=True)
class Entry:
    nodeid: str
    reason: str
    tags: frozenset
    line: int


def parse(text, source="<expected failures>"):
    entries, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            raise ValueError(f"{source}:{number}: expected '[TAGS] NODE_ID | reason', got {raw!r}")
        tags = frozenset(t for t in (m.group(1) or "").split(",") if t)
        if (m.group(2), tags) in seen:
            raise ValueError(f"{source}:{number}: {m.group(2)} is listed twice with the same tags")
        seen.add((m.group(2), tags))
        entries.append(Entry(m.group(2), m.group(3), tags, number))
    return entries


def load(path):
    with open(path) as f:
        return parse(f.read(), path)


def covers(entry_id, nodeid):
    """Whether an entry's node id (or node id prefix) names nodeid."""
    if not nodeid.startswith(entry_id):
        return False
    return len(nodeid) == len(entry_id) or entry_id[-1] in "/:" or nodeid[len(entry_id)] in "/:["


def lookup(entries, nodeid, active):
    hits = [e for e in entries if e.tags <= active and covers(e.nodeid, nodeid)]
    return max(hits, key=lambda e: len(e.nodeid), default=None)


def verdict(outcome, entry):
    """outcome: passed | failed | skipped | xfailed (upstream's own xfail mark)."""
    if outcome == "failed":
        return "xfailed" if entry else "failed"
    if outcome == "passed":
        return "unexpected-pass" if entry and not entry.tags & STATE_TAGS else "passed"
    return outcome


def in_scope(entry_id, paths):
    """Whether an entry lies inside one of a matrix's test directories (relative to tests/)."""
    return any(entry_id == p or entry_id.startswith(p.rstrip("/") + "/") for p in paths)


def summarize(results, entries, active, collected, scope=None):
    """results: {nodeid: (outcome, message, seconds)} for every selected node id; collected: the whole matrix.

    Active entries inside the matrix's paths (scope; None: all entries) that name nothing the matrix
    collects are stale (a typo, or a test upstream renamed) and fail the run like an unexpected result.
    """
    rows, counts = [], dict.fromkeys(VERDICTS, 0)
    for nodeid, (outcome, message, seconds) in sorted(results.items()):
        entry = lookup(entries, nodeid, active)
        v = verdict(outcome, entry)
        counts[v] += 1
        rows.append({"nodeid": nodeid, "outcome": outcome, "verdict": v, "message": message,
                     "reason": entry.reason if entry else "", "seconds": round(seconds, 2)})
    stale = [f"line {e.line}: {e.nodeid}" for e in entries
             if e.tags <= active and (scope is None or in_scope(e.nodeid, scope))
             and not any(covers(e.nodeid, n) for n in collected)]
    ok = not stale and not any(counts[b] for b in BAD)
    return {"counts": counts, "stale": stale, "ok": ok, "tests": rows}


def merge(summaries):
    """One summary from several (the shards of a matrix); a node id reported twice keeps its last row."""
    rows = {}
    for s in summaries:
        rows.update((r["nodeid"], r) for r in s["tests"])
    counts = dict.fromkeys(VERDICTS, 0)
    for r in rows.values():
        counts[r["verdict"]] += 1
    stale = sorted(set(x for s in summaries for x in s["stale"]))
    ok = not stale and not any(counts[b] for b in BAD)
    return {"counts": counts, "stale": stale, "ok": ok, "tests": [rows[k] for k in sorted(rows)]}


def format_summary(title, summary):
    c = summary["counts"]
    out = [f"=== {title}", "    " + ", ".join(f"{c[v]} {v}" for v in VERDICTS)]
    for r in summary["tests"]:
        if r["verdict"] in BAD:
            why = r["message"] if r["verdict"] == "failed" else "listed as expected to fail: " + r["reason"]
            out.append(f"    {r['verdict'].upper()} {r['nodeid']}\n        {why}")
    out += [f"    STALE ENTRY {s} (matches nothing this matrix collects)" for s in summary["stale"]]
    out.append("    result: " + ("OK" if summary["ok"] else "FAILED"))
    return "\n".join(out)


def write_json(path, summary, **extra):
    with open(path, "w") as f:
        json.dump(dict(extra, **summary), f, indent=1)


def write_junit(path, suite_name, summary):
    c = summary["counts"]
    suite = ET.Element("testsuite", name=suite_name, tests=str(len(summary["tests"])), errors="0",
                       failures=str(c["failed"] + c["unexpected-pass"]), skipped=str(c["skipped"] + c["xfailed"]),
                       time="%.2f" % sum(r["seconds"] for r in summary["tests"]))
    for r in summary["tests"]:
        path_part, _, rest = r["nodeid"].partition("::")
        classname = ".".join([path_part.removesuffix(".py").replace("/", ".")] + rest.split("::")[:-1])
        case = ET.SubElement(suite, "testcase", classname=classname, name=rest.split("::")[-1] or path_part,
                             file=path_part, time="%.2f" % r["seconds"])
        v = r["verdict"]
        if v == "failed":
            ET.SubElement(case, "failure", message=r["message"][:1000])
        elif v == "unexpected-pass":
            ET.SubElement(case, "failure", message="passed, but listed as expected to fail: " + r["reason"])
        elif v == "xfailed":
            ET.SubElement(case, "skipped", type="xfail", message=r["reason"] or r["message"][:1000])
        elif v == "skipped":
            ET.SubElement(case, "skipped", message=r["message"][:1000])
    root = ET.Element("testsuites")
    root.append(suite)
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)
