"""patches/series, the DEP-3 headers of each patch, and applying one patch with an error that names it."""

import os
import re
import subprocess

from . import ForkBuildError

# DEP-3 fields every patch of the fork carries; each tuple is "one of". X-Reach is the fork's own (below).
REQUIRED_FIELDS = (("Description", "Subject"), ("Origin", "Author", "From"), ("Bug", ), ("Forwarded", ),
                   ("Last-Update", ), ("X-Reach", ))

# Whom a patch reaches: the X-Reach field's first line lists the users whose runs execute the code the patch
# changes, as these values, comma-separated. A value written "VALUE (inert)" runs the changed code and gets
# upstream's result; the field's continuation lines say why. The only definition of the vocabulary: README.md's
# patch list and docs/eager-zero-audit.md are generated from it (tools/reach-table).
REACH = {
    "eager-zero-0": "ZeRO stage 0: the fp16/bf16 wrappers, plain data parallelism (DeepCompile never runs at stage 0)",
    "eager-zero-1": "ZeRO-1 without DeepCompile (eager, or engine.compile() with plain torch.compile)",
    "eager-zero-2": "ZeRO-2 without DeepCompile (eager, or engine.compile() with plain torch.compile)",
    "eager-zero-3": "ZeRO-3 without DeepCompile (eager, or engine.compile() with plain torch.compile)",
    "deepcompile": 'DeepCompile: "compile": {"deepcompile": true} once engine.compile() has run (ZeRO-1, -2, -3)',
    "checkpoint-writer": 'the checkpoint writer: "checkpoint": {"writer": ...}, fast or "decoupled": true',
    "engine-compile": "engine.compile() without DeepCompile (the module compiled with plain torch.compile)",
    "every-engine": "every DeepSpeedEngine, whatever its configuration (its config, constructor, forward, "
    "load_checkpoint)",
    "op-build": "anyone building a DeepSpeed op: at first use (JIT), or at install with DS_BUILD_OPS=1, which "
    "builds DeepCompile's op too",
    "ds-report": "anyone running ds_report",
    "cuda-accelerator": "anyone reading the CUDA accelerator's memory counters: DeepCompile's profilers, "
    "memory-breakdown logs, timers, user code",
}
INERT = "inert"
REACH_ITEM = re.compile(r"([\w.-]+)(?: \((\w+)\))?")
HUNK_RE = re.compile(r"^@@ -(\d+)(?:,\d+)? \+\d+(?:,\d+)? @@")


def read_series(patches_dir):
    """Names listed in patches/series, checked against the .patch files present."""
    path = os.path.join(patches_dir, "series")
    if not os.path.isfile(path):
        raise ForkBuildError(f"{path}: missing (it lists the patches in the order they apply)")
    names = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            name = line.split("#", 1)[0].strip()
            if not name:
                continue
            if name in names:
                raise ForkBuildError(f"{path}:{lineno}: {name} is listed twice")
            if not os.path.isfile(os.path.join(patches_dir, name)):
                raise ForkBuildError(f"{path}:{lineno}: {name} is listed but there is no file {patches_dir}/{name}")
            names.append(name)
    unlisted = sorted(set(n for n in os.listdir(patches_dir) if n.endswith(".patch")) - set(names))
    if unlisted:
        raise ForkBuildError(f"{path}: patch file(s) not listed in series: {', '.join(unlisted)}. "
                             "Add them to series or delete them.")
    return names


def split_patch(text):
    """(header, diff): the header is everything before the first diff line."""
    m = re.search(r"(?m)^(diff --git |--- )", text)
    if m is None:
        return text, ""
    head = text[:m.start()]
    head = re.sub(r"(?m)^---\n\Z", "", head)  # the "---" separator line of DEP-3/git format-patch
    return head, text[m.start():]


def dep3_fields(header):
    """DEP-3 fields of a header (continuation lines start with a space)."""
    fields, key = {}, None
    for line in header.splitlines():
        m = re.match(r"^([A-Za-z][A-Za-z0-9-]*):\s?(.*)$", line)
        if m:
            key = m.group(1)
            fields[key] = m.group(2)
        elif key and line.startswith(" "):
            fields[key] += "\n" + line.strip()
        elif not line.strip():
            key = None
    return fields


def missing_fields(header):
    fields = dep3_fields(header)
    present = set(fields) | set(k.split("-", 1)[0] for k in fields if k.startswith("Bug-"))
    return ["/".join(alts) for alts in REQUIRED_FIELDS if not present.intersection(alts)]


BUG_LINK = re.compile(r"https?://\S+|\b(?:docs/[\w./-]+|README)\.md\b")


def bug_reference_problem(header, root):
    """Why the Bug field sends no reader anywhere (None when it does): it must hold a link (the upstream issue or
    pull request) or a docs page of the fork, one that exists, showing the defect."""
    bug = dep3_fields(header).get("Bug", "")
    refs = BUG_LINK.findall(bug)
    if not refs:
        return f"Bug field cites no link and no docs page: {bug.splitlines()[0] if bug else '(empty)'!r}"
    missing = [r for r in refs if r.endswith(".md") and not r.startswith("http")
               and not os.path.exists(os.path.join(root, r))]
    if missing:
        return f"Bug field cites docs pages that do not exist: {', '.join(missing)}"
    return None


def reach(header):
    """([(value, inert)], note) of the X-Reach field: its first line's values, and the lines below it."""
    text = dep3_fields(header).get("X-Reach", "")
    first, _, note = text.partition("\n")
    items = []
    for item in (i.strip() for i in first.split(",")):
        m = REACH_ITEM.fullmatch(item)
        items.append((m.group(1), m.group(2) == INERT) if m and m.group(2) in (None, INERT) else (item, None))
    return [i for i in items if i[0]], " ".join(note.split())


def reach_problem(header):
    """Why the X-Reach field does not say whom the patch reaches (None when it does)."""
    if "X-Reach" not in dep3_fields(header):
        return "DEP-3 header lacks X-Reach"
    items, note = reach(header)
    if not items:
        return f"X-Reach names no one: write one or more of {', '.join(REACH)}"
    for value, inert in items:
        if inert is None:
            return f"X-Reach: cannot read {value!r}: write VALUE or VALUE (inert)"
        if value not in REACH:
            return f"X-Reach: unknown value {value!r} (known: {', '.join(REACH)}; forkbuild/series.py REACH)"
    values = [v for v, _ in items]
    twice = sorted(set(v for v in values if values.count(v) > 1))
    if twice:
        return f"X-Reach: {', '.join(twice)} listed twice"
    if all(inert for _, inert in items):
        return "X-Reach: every value is inert: name whom the patch changes"
    if any(inert for _, inert in items) and not note:
        return "X-Reach: an inert value needs lines below the values saying why the changed code is inert"
    return None


def header_problems(header):
    """What the build refuses in a patch's header: missing DEP-3 fields, an X-Reach field it cannot read."""
    missing = missing_fields(header)
    problems = [f"DEP-3 header lacks {', '.join(missing)}"] if missing else []
    why = None if "X-Reach" in missing else reach_problem(header)
    return problems + ([why] if why else [])


def subject(header):
    fields = dep3_fields(header)
    text = fields.get("Description") or fields.get("Subject") or ""
    return text.split("\n", 1)[0].strip()


def hunks(diff):
    """[(file, old_start, hunk_number_in_file, header_line)] of a unified diff."""
    out, current, n = [], None, 0
    for line in diff.splitlines():
        if line.startswith("--- "):
            old = line[4:].split("\t")[0]
            current, n = (old[2:] if old.startswith("a/") else old), 0
        elif line.startswith("+++ ") and current == "/dev/null":
            new = line[4:].split("\t")[0]
            current = new[2:] if new.startswith("b/") else new
        m = HUNK_RE.match(line)
        if m and current is not None:
            n += 1
            out.append((current, int(m.group(1)), n, line))
    return out


def git_env(tree):
    """An environment in which git never finds a repository above `tree` (git apply would silently skip
    files outside the enclosing repository's current directory)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env["GIT_CEILING_DIRECTORIES"] = os.path.dirname(os.path.abspath(tree))
    return env


def explain_failure(name, diff, stderr):
    lines = [f"patch {name} does not apply:"]
    found = False
    for m in re.finditer(r"patch failed: (.+):(\d+)", stderr):
        path, line = m.group(1), int(m.group(2))
        for f, start, k, head in hunks(diff):
            if f == path and start == line:
                lines.append(f"  file {path}, hunk #{k} ({head})")
                found = True
    for m in re.finditer(r"error: (.+?): (No such file or directory|does not exist in index|already exists.*)$",
                         stderr, re.M):
        lines.append(f"  file {m.group(1)}: {m.group(2)}")
        found = True
    if not found:
        lines.append("  (git apply gave no file or hunk)")
    lines.append("  git apply said: " + stderr.strip().replace("\n", "\n    "))
    return "\n".join(lines)


def apply(patch_path, tree, name=None):
    """Apply one patch to `tree`; all of its hunks or none of them (git apply checks before it writes)."""
    name = name or os.path.basename(patch_path)
    with open(patch_path) as f:
        _, diff = split_patch(f.read())
    if not diff.strip():
        raise ForkBuildError(f"patch {name} contains no diff")
    proc = subprocess.run(["git", "apply", "--whitespace=nowarn", "-p1", os.path.abspath(patch_path)],
                          cwd=tree, env=git_env(tree), capture_output=True, text=True)
    if proc.returncode != 0:
        raise ForkBuildError(explain_failure(name, diff, proc.stderr))
