"""The ledger of the GPU matrices: fixed shards and each shard's result (tests/upstream/ledger.json).

A GPU host is lent for minutes at a time, so a matrix runs a few shards per loan. The ledger, committed in
this repository, fixes the shards once (cut from one upstream checkout's tests/) and records every result
that comes back, so each loan resumes where the last stopped. Layout (docs/upstream-tests.md, "The ledger"):

    {"format": 1,
     "checkout": the upstream commit whose tests/ the shards come from,
     "tests_sha256": tree_digest() of that tests/ directory (a run on other tests is refused),
     "matrices": {MATRIX: {
         "sharding": sha256 of checkout, matrix and shards (a summary of another sharding is refused),
         "made": how the shards were cut (date, deepspeed, budget, estimates),
         "stale": expected-failures entries a run reported as naming nothing,
         "unplanned": node ids a host collected that no shard holds,
         "results": {TARGET: {SHARD: RESULT}},     TARGET fork or upstream, SHARD "1".."N"
         "shards": [[node id, ...], ...]}}}        shard I is shards[I - 1]

RESULT: state (passed: every test as expected; failed: an unexpected result; incomplete: tests without a
result, e.g. cut off by the wall-clock limit; an incomplete result never replaces a complete one, and the
fork's next run of an incomplete shard takes only its node ids without a result, whose results are then
merged into it: counts summed, seconds added, the versions of both runs named), the
verdict counts, host, date, seconds, deepspeed and torch versions, xdist workers, and `failures`: one
[node id, verdict, message] per test that failed (listed or not) or passed unexpectedly; `together`: the shards
run in one pass with it (--together), whose wall time `seconds` then is; `runs`: how many runs of the same node
ids (a shard run again before the first run's summary came back) were merged into it, node id by node id.

Upstream 0.19.8 runs only where the fork fails: its shard I is the fork's shard I narrowed to the node ids
that failed there, and exists once the fork's shard I has a complete result with a failure.
"""

import datetime
import hashlib
import json
import os
import tempfile

FORMAT = 1
TARGETS = ("fork", "upstream")
DONE = ("passed", "failed")
COUNTS = ("passed", "failed", "xfailed", "skipped", "unexpected-pass")


class LedgerError(Exception):
    pass


def tree_digest(tests_dir):
    """sha256 over a tests/ tree's file paths and contents (links by target; no __pycache__ or .pyc)."""
    h = hashlib.sha256()
    for top, dirs, files in os.walk(tests_dir):
        links = [d for d in dirs if os.path.islink(os.path.join(top, d))]  # hashed as links, not walked
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and d not in links)
        for name in sorted(files + links):
            if name.endswith(".pyc"):
                continue
            path = os.path.join(top, name)
            rel = os.path.relpath(path, tests_dir).replace(os.sep, "/")
            if os.path.islink(path):
                body = b"link:" + os.readlink(path).encode()
            else:
                with open(path, "rb") as f:
                    body = f.read()
            h.update(rel.encode() + b"\0" + hashlib.sha256(body).hexdigest().encode() + b"\n")
    return h.hexdigest()


def sharding_id(checkout, matrix, shards):
    return hashlib.sha256(json.dumps([checkout, matrix, shards]).encode()).hexdigest()[:16]


def new(checkout, tests_sha256):
    return {"format": FORMAT, "checkout": checkout, "tests_sha256": tests_sha256, "matrices": {}}


def _fail(path, why):
    raise LedgerError(f"{path}: {why}; the file is left as it is (fix it, or restore it from git)")


def validate(ledger, path="<ledger>"):
    if not isinstance(ledger, dict) or ledger.get("format") != FORMAT:
        _fail(path, f"not a ledger of format {FORMAT}")
    for key in ("checkout", "tests_sha256"):
        if not isinstance(ledger.get(key), str) or not ledger[key]:
            _fail(path, f"'{key}' is missing")
    if not isinstance(ledger.get("matrices"), dict):
        _fail(path, "'matrices' is missing")
    for name, m in ledger["matrices"].items():
        where = f"matrix {name}"
        if not isinstance(m, dict):
            _fail(path, f"{where} is not an object")
        shards = m.get("shards")
        if (not isinstance(shards, list) or not shards
                or not all(isinstance(s, list) and all(isinstance(x, str) for x in s) for s in shards)):
            _fail(path, f"{where}: 'shards' must be a non-empty list of lists of node ids")
        flat = [x for s in shards for x in s]
        if len(flat) != len(set(flat)):
            _fail(path, f"{where}: a node id is in two shards")
        if m.get("sharding") != sharding_id(ledger["checkout"], name, shards):
            _fail(path, f"{where}: 'sharding' does not match its shards (were they edited by hand?)")
        results = m.get("results")
        if not isinstance(results, dict) or not set(results) <= set(TARGETS):
            _fail(path, f"{where}: 'results' must map {' or '.join(TARGETS)} to shard results")
        for target, per in results.items():
            if not isinstance(per, dict):
                _fail(path, f"{where}: results of {target} are not an object")
            for k, r in per.items():
                if not (k.isdigit() and 1 <= int(k) <= len(shards)):
                    _fail(path, f"{where}: {target} has a result for shard {k!r}, which does not exist")
                if not isinstance(r, dict) or r.get("state") not in DONE + ("incomplete", ):
                    _fail(path, f"{where}: {target} shard {k}: no valid 'state'")
                if not all(isinstance(r.get(c), int) for c in COUNTS) or not isinstance(r.get("failures"), list):
                    _fail(path, f"{where}: {target} shard {k}: counts or 'failures' missing")
        for key in ("stale", "unplanned"):
            if not isinstance(m.get(key, []), list):
                _fail(path, f"{where}: '{key}' is not a list")
    return ledger


def load(path):
    try:
        with open(path) as f:
            text = f.read()
    except OSError as e:
        raise LedgerError(f"cannot read the ledger {path}: {e.strerror}") from None
    try:
        ledger = json.loads(text)
    except ValueError as e:
        _fail(path, f"not valid JSON ({e})")
    return validate(ledger, path)


def dumps(value, indent=0, width=110):
    """JSON with one node id, one failure, one key per line; anything short stays on one line."""
    flat = json.dumps(value)
    numbers = isinstance(value, list) and all(isinstance(v, (int, float)) for v in value)
    if len(flat) + indent <= width or not isinstance(value, (dict, list)) or not value or numbers:
        return flat
    pad = " " * (indent + 1)
    if isinstance(value, dict):
        body = [f"{pad}{json.dumps(k)}: " + ("[\n" + ",\n".join(pad + " " + json.dumps(x) for x in v) + "\n" + pad + "]"
                                           if k == "failures" and v else dumps(v, indent + 1, width))
                for k, v in value.items()]
        return "{\n" + ",\n".join(body) + "\n" + " " * indent + "}"
    return "[\n" + ",\n".join(pad + dumps(v, indent + 1, width) for v in value) + "\n" + " " * indent + "]"


def save(path, ledger):
    """Write the ledger whole or not at all (a temporary file renamed over it)."""
    validate(ledger, path)
    text = dumps(ledger) + "\n"
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".ledger-")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, os.stat(path).st_mode & 0o777 if os.path.exists(path) else 0o644)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def add_matrix(ledger, matrix, shards, made):
    """Fix a matrix's shards. Refused while the matrix already has results (they belong to its shards)."""
    old = ledger["matrices"].get(matrix)
    if old and any(old["results"].values()):
        raise LedgerError(f"matrix {matrix} already has results; its shards stay as they are")
    shards = [sorted(s) for s in shards if s]
    ledger["matrices"][matrix] = {"sharding": sharding_id(ledger["checkout"], matrix, shards), "made": made,
                                  "stale": [], "unplanned": [], "results": {}, "shards": shards}
    return ledger["matrices"][matrix]


def matrix_of(ledger, matrix):
    if matrix not in ledger["matrices"]:
        known = ", ".join(sorted(ledger["matrices"])) or "none"
        raise LedgerError(f"the ledger has no matrix {matrix} (known: {known})")
    return ledger["matrices"][matrix]


NO_RESULT = ("no result", "not collected")


def failed_ids(result):
    """Node ids that failed in a result (whether an expected-failures entry lists them or not)."""
    return sorted(nid for nid, verdict, _ in result["failures"] if verdict in ("failed", "xfailed"))


def missing_ids(result):
    """Node ids of a result that got none (cut off by the wall-clock limit, not collected)."""
    return sorted(nid for nid, _, message in result["failures"] if message.startswith(NO_RESULT))


def selection(ledger, matrix, target, k):
    """The node ids shard k runs for the target: None where the upstream shard does not exist (yet)."""
    m = matrix_of(ledger, matrix)
    if not 1 <= k <= len(m["shards"]):
        raise LedgerError(f"matrix {matrix} has shards 1 to {len(m['shards'])}, not {k}")
    if target == "fork":
        mine = m["results"].get("fork", {}).get(str(k))
        if mine and mine["state"] == "incomplete" and missing_ids(mine):
            return missing_ids(mine)  # resume: the rest of the shard has its results
        return list(m["shards"][k - 1])
    fork = m["results"].get("fork", {}).get(str(k))
    if not fork or fork["state"] not in DONE:
        return None
    return failed_ids(fork) or None


def pending(ledger, matrix, target):
    """Shard numbers, in order, that the target still has to run (no complete result, and something to run)."""
    m = matrix_of(ledger, matrix)
    mine = m["results"].get(target, {})
    return [k for k in range(1, len(m["shards"]) + 1)
            if mine.get(str(k), {}).get("state") not in DONE and selection(ledger, matrix, target, k)]


def fork_failures(ledger, matrix):
    """Every node id that failed for the fork in the matrix's shards with a complete result."""
    m = matrix_of(ledger, matrix)
    return sorted(nid for r in m["results"].get("fork", {}).values() if r["state"] in DONE for nid in failed_ids(r))


def stamp(ledger, matrix, target, k):
    """What a shard's summary carries so that recording it can check it belongs to this ledger's shard."""
    m = matrix_of(ledger, matrix)
    ids = selection(ledger, matrix, target, k)
    return {"matrix": matrix, "target": target, "shard": k, "of": len(m["shards"]), "sharding": m["sharding"],
            "checkout": ledger["checkout"],
            "selection_sha256": hashlib.sha256("\n".join(ids or []).encode()).hexdigest()}


def _state(counts, failures):
    """A result's state: incomplete while a node id has no result, else failed on an unexpected one, else passed."""
    if any(message.startswith(NO_RESULT) for _, _, message in failures):
        return "incomplete"
    return "failed" if counts["failed"] or counts["unexpected-pass"] else "passed"


def result_of(summary):
    """A ledger RESULT from a shard's summary (tools/upstream-tests --ledger writes those)."""
    rows = summary["tests"]
    counts = {c: sum(r["verdict"] == c for r in rows) for c in COUNTS}
    failures = [[r["nodeid"], r["verdict"], r["message"][:300]] for r in rows
                if r["verdict"] in ("failed", "unexpected-pass") or r["outcome"] == "failed"]
    return dict({"state": _state(counts, failures)}, **counts, host=summary.get("host", ""), date=summary.get("date", ""),
                seconds=summary.get("seconds", 0), deepspeed=summary.get("info", {}).get("deepspeed", ""),
                torch=summary.get("info", {}).get("torch", ""), workers=summary.get("workers", 0),
                failures=failures, **({"together": summary["together"]} if summary.get("together") else {}),
                **({"runs": summary["runs"]} if summary.get("runs", 1) > 1 else {}))


def check(ledger, summary, source="<summary>"):
    """(matrix, target, shard) of a shard summary that belongs to this ledger; LedgerError otherwise."""
    s = summary.get("ledger") if isinstance(summary, dict) else None
    if not isinstance(s, dict) or not {"matrix", "target", "shard", "sharding", "checkout"} <= set(s):
        raise LedgerError(f"{source}: not a ledger shard's summary (no 'ledger' stamp)")
    if not isinstance(summary.get("tests"), list):
        raise LedgerError(f"{source}: a ledger shard's summary without its tests")
    if s["checkout"] != ledger["checkout"]:
        raise LedgerError(f"{source}: ran the tests of checkout {s['checkout']}, the ledger's shards are of "
                          f"{ledger['checkout']}")
    m = matrix_of(ledger, s["matrix"])
    if s["sharding"] != m["sharding"]:
        raise LedgerError(f"{source}: belongs to sharding {s['sharding']} of {s['matrix']}, the ledger's is "
                          f"{m['sharding']} (shards cut differently: the summary cannot be recorded)")
    if s["target"] not in TARGETS:
        raise LedgerError(f"{source}: unknown target {s['target']!r}")
    if not isinstance(s["shard"], int) or not 1 <= s["shard"] <= len(m["shards"]):
        raise LedgerError(f"{source}: shard {s['shard']!r} is not one of the ledger's {len(m['shards'])}")
    ids = selection(ledger, s["matrix"], s["target"], s["shard"])
    if ids is None:
        raise LedgerError(f"{source}: upstream shard {s['shard']} of {s['matrix']} does not exist: the fork's shard "
                          f"has no complete result with a failure")
    if stamp(ledger, s["matrix"], s["target"], s["shard"])["selection_sha256"] != s.get("selection_sha256"):
        raise LedgerError(f"{source}: {s['target']} shard {s['shard']} ran other node ids than the ledger now "
                          f"selects (for upstream: the fork's failures of that shard changed since; for the fork: "
                          f"an incomplete shard runs again only its node ids without a result)")
    if set(r["nodeid"] for r in summary["tests"]) != set(ids):
        raise LedgerError(f"{source}: its tests are not those of {s['target']} shard {s['shard']}")
    return s["matrix"], s["target"], s["shard"]


# A node id's result from several runs: any result before none, then the worst.
_WORSE = ("passed", "skipped", "xfailed", "unexpected-pass", "failed")


def _rank(row):
    return (not row["message"].startswith(NO_RESULT), _WORSE.index(row["verdict"]) if row["verdict"] in _WORSE else 0)


def merged(summaries):
    """One summary of several runs of the same selection (a shard run again before the first run's summary was
    recorded): each node id keeps the result of a run that has one, the worst where several do (naming the
    other runs' verdicts); wall seconds are added, versions and hosts named."""
    first, rows = summaries[0], {}
    for summary in summaries:
        for row in summary["tests"]:
            rows.setdefault(row["nodeid"], []).append(row)
    tests = []
    for nid in sorted(rows):
        runs = rows[nid]
        best = max(runs, key=_rank)
        others = sorted({r["verdict"] for r in runs if r is not best and not r["message"].startswith(NO_RESULT)})
        if others and others != [best["verdict"]]:
            best = dict(best, message=f"{best['message']} (another run: {', '.join(others)})".lstrip())
        tests.append(best)
    info = dict(first.get("info", {}), deepspeed=", ".join(dict.fromkeys(
        s.get("info", {}).get("deepspeed", "") for s in summaries)))
    together = sorted({k for s in summaries for k in s.get("together", [])})
    return dict(first, tests=tests, info=info, seconds=sum(s.get("seconds", 0) for s in summaries),
                host=", ".join(dict.fromkeys(s.get("host", "") for s in summaries)),
                date=max(s.get("date", "") for s in summaries),
                stale=sorted({x for s in summaries for x in s.get("stale", [])}),
                unplanned=sorted({x for s in summaries for x in s.get("unplanned", [])}),
                runs=len(summaries), **({"together": together} if together else {}))


def record(ledger, summaries):
    """Fold shard summaries [(source, summary)] into the ledger, all or none. -> [(matrix, target, shard, what)]

    Summaries of one shard that ran the same node ids (checked against the ledger as it is before any is folded)
    are merged by node id first: folded one after another, the second would count again what the first recorded.
    """
    groups = {}
    for source, summary in summaries:
        groups.setdefault(check(ledger, summary, source), []).append(summary)
    checked = [(key, runs[0] if len(runs) == 1 else merged(runs)) for key, runs in groups.items()]
    done = []
    for (matrix, target, k), summary in checked:
        m = ledger["matrices"][matrix]
        new_result = result_of(summary)
        old = m["results"].get(target, {}).get(str(k))
        if old and old["state"] == "incomplete" and {r["nodeid"] for r in summary["tests"]} != set(m["shards"][k - 1]):
            new_result = resumed(old, new_result)
        if old and old["state"] in DONE and new_result["state"] not in DONE:
            done.append((matrix, target, k, f"kept the earlier {old['state']} result ({new_result['state']} run)"))
            continue
        m["results"].setdefault(target, {})[str(k)] = new_result
        m["results"][target] = {key: m["results"][target][key] for key in sorted(m["results"][target], key=int)}
        m["stale"] = sorted(set(m["stale"]) | set(summary.get("stale", [])))
        m["unplanned"] = sorted(set(m["unplanned"]) | set(summary.get("unplanned", [])))
        done.append((matrix, target, k, new_result["state"] + (" (replaces an earlier result)" if old else "")))
    return done


def resumed(old, new):
    """An incomplete result with the results of its node ids that had none (`new`, a run of just those)."""
    redone = set(missing_ids(old))
    kept = [f for f in old["failures"] if f[0] not in redone]
    counts = {c: old[c] - sum(f[1] == c for f in old["failures"] if f[0] in redone) + new[c] for c in COUNTS}
    failures = sorted(kept + new["failures"])
    state = _state(counts, failures)
    versions = ", ".join(dict.fromkeys(v for r in (old, new) for v in r["deepspeed"].split(", ")))
    return dict(new, state=state, **counts, failures=failures, seconds=old["seconds"] + new["seconds"],
                deepspeed=versions, resumed=old.get("resumed", 0) + 1)


def rejudge(ledger, target, judge):
    """Judge the target's recorded results again by judge(node id, outcome) -> verdict, the expected-failures file
    as it is now: a failure recorded before its entry was written becomes a listed one, a listed failure or an
    unexpected pass whose entry is gone becomes unexpected or a pass. -> [(matrix, shard, node id, old, new)]"""
    changed = []
    for name, m in sorted(ledger["matrices"].items()):
        for k, r in sorted(m["results"].get(target, {}).items(), key=lambda kv: int(kv[0])):
            rows = []
            for nid, verdict, message in r["failures"]:
                new = verdict
                if verdict in ("failed", "xfailed") and not message.startswith(NO_RESULT):
                    new = judge(nid, "failed")
                elif verdict == "unexpected-pass":
                    new = judge(nid, "passed")
                if new != verdict:
                    r[verdict] -= 1
                    r[new] += 1
                    changed.append((name, int(k), nid, verdict, new))
                if new != "passed":
                    rows.append([nid, new, message])
            r["failures"] = rows
            r["state"] = _state(r, rows)
    return changed


def void(ledger, target, nodeids, why):
    """Turn recorded failures of these node ids into no result (`no result: WHY`), all or none, so that the
    target's next run of their shards takes them again: for a failure that was no verdict on the test, such as a
    run cut off while the test ran (which the tool once recorded as `no call report`), or that an older fork
    version gave and a later patch addressed.
    -> [(matrix, shard, node id, the verdict voided)]"""
    if not why.strip():
        raise LedgerError("voiding a recorded result needs the reason why it is void")
    found = []
    for nid in nodeids:
        where = [(name, k) for name, m in sorted(ledger["matrices"].items())
                 for k, ids in enumerate(m["shards"], 1) if nid in ids]
        if not where:
            raise LedgerError(f"no shard of the ledger holds {nid}")
        name, k = where[0]
        r = ledger["matrices"][name]["results"].get(target, {}).get(str(k))
        if not r:
            raise LedgerError(f"{name} shard {k} has no {target} result: nothing to void for {nid}")
        rows = {f[0]: f for f in r["failures"]}
        if nid not in rows:  # a pass or a skip is not kept by node id: only a recorded failure can be voided
            raise LedgerError(f"{nid} did not fail in {name} shard {k}'s {target} result: nothing to void")
        verdict = rows[nid][1]
        if rows[nid][2].startswith(NO_RESULT):
            raise LedgerError(f"{nid} has no result in {name} shard {k} already")
        found.append((name, k, nid, verdict))
    for name, k, nid, verdict in found:  # all checked: nothing changes unless every node id can be voided
        r = ledger["matrices"][name]["results"][target][str(k)]
        r[verdict] -= 1
        r["failed"] += 1
        r["failures"] = sorted([f for f in r["failures"] if f[0] != nid] + [[nid, "failed", f"no result: {why}"]])
        r["state"] = _state(r, r["failures"])
    return found


def status(ledger):
    """Markdown: per matrix and target, shards done and the verdict counts over them; then every shard."""
    out = summary(ledger).splitlines()
    out += ["", "| matrix | shard | node ids | fork | upstream |", "| --- | --- | --- | --- | --- |"]
    for name, m in sorted(ledger["matrices"].items()):
        for k, ids in enumerate(m["shards"], 1):
            out.append(shard_row(ledger, name, m, k, ids))
    return "\n".join(out)


def summary(ledger):
    """Markdown: per matrix and target, shards done and the verdict counts over them, and the node ids with a result
    (docs/upstream-tests.md holds it between `upstream-tests-summary` markers; a test checks it against the ledger)."""
    out = [f"Shards of upstream's tests at `{ledger['checkout'][:7]}` "
           f"(tests/ sha256 `{ledger['tests_sha256'][:12]}…`).", "",
           "| matrix | target | shards done | incomplete | not run | passed | failed (listed) | failed (unexpected) "
           "| passed but listed | skipped | failing node ids |",
           "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, m in sorted(ledger["matrices"].items()):
        for target in TARGETS:
            rs = m["results"].get(target, {})
            done = [r for r in rs.values() if r["state"] in DONE]
            wanted = len(m["shards"]) if target == "fork" else len(
                [k for k in range(1, len(m["shards"]) + 1) if selection(ledger, name, target, k)])
            if target == "upstream" and not rs and not wanted:
                continue
            total = {c: sum(r[c] for r in done) for c in COUNTS}
            failing = sum(len(failed_ids(r)) for r in done)
            out.append(f"| `{name}` | {target} | {len(done)} of {wanted} | "
                       f"{sum(r['state'] == 'incomplete' for r in rs.values())} | {wanted - len(rs)} | "
                       f"{total['passed']} | {total['xfailed']} | {total['failed']} | {total['unexpected-pass']} | "
                       f"{total['skipped']} | {failing} |")
    out += [""] + [node_counts(ledger, name) for name in sorted(ledger["matrices"])]
    return "\n".join(out)


def shard_row(ledger, name, m, k, ids):
    """One shard's row of status(): its result on the fork and on upstream."""
    cells = []
    for target in TARGETS:
        r = m["results"].get(target, {}).get(str(k))
        fork_done = m["results"].get("fork", {}).get(str(k), {}).get("state") in DONE
        if r:
            cells.append(f"{r['state']}: {r['passed']} passed, {r['xfailed']} listed, {r['failed']} "
                         f"unexpected, {r['skipped']} skipped; {r['host']}, {r['date']}, {r['seconds']} s, "
                         f"{r['deepspeed']}, {r['workers']} workers"
                         + (f" (one run of shards {', '.join(map(str, r['together']))})"
                            if r.get("together") else "")
                         + (f", resumed {r['resumed']}x (seconds summed)" if r.get("resumed") else "")
                         + (f", {r['runs']} runs of the same node ids merged" if r.get("runs") else ""))
        elif target == "fork" or selection(ledger, name, target, k):
            cells.append("not run")
        else:
            cells.append("not needed" if fork_done else "after the fork")
    return f"| `{name}` | {k}/{len(m['shards'])} | {len(ids)} | {cells[0]} | {cells[1]} |"


def node_counts(ledger, matrix):
    """One line: the fork's node ids of the matrix with a result, incomplete shards included, and their verdicts."""
    m = matrix_of(ledger, matrix)
    total = sum(len(s) for s in m["shards"])
    got = dict.fromkeys(COUNTS, 0)
    for r in m["results"].get("fork", {}).values():
        cut = [f for f in r["failures"] if f[2].startswith(NO_RESULT)]
        for c in COUNTS:
            got[c] += r[c] - sum(f[1] == c for f in cut)
    n = sum(got.values())
    return (f"`{matrix}`, fork: {n} of {total} node ids have a result, incomplete shards included ({got['passed']} "
            f"passed, {got['xfailed']} failed as listed, {got['failed']} failed unexpectedly, "
            f"{got['unexpected-pass']} passed but listed, {got['skipped']} skipped); {total - n} have none.")


def today():
    return datetime.date.today().isoformat()
