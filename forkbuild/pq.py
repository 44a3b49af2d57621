"""Patch queue: edit a real upstream tree, keep patches/ as its exported form.

  python -m forkbuild.pq import [--force]   .pq/tree = upstream baseline (tag `upstream`) + one commit per patch
  python -m forkbuild.pq mirror             copy files changed under csrc/ op_builder/ accelerator/ to their
                                            packaged twins (pin.toml `mirrors`), and the other way round
  python -m forkbuild.pq export             rewrite patches/ and patches/series from the commits after `upstream`
  python -m forkbuild.pq export-upstream DIR
                                            the series as git-format patches for `git am` on a clone of upstream's
                                            repository at the base release (one copy of csrc/ etc., as upstream's git)
  python -m forkbuild.pq check              DEP-3 headers present, Bug citing a link or an existing docs page,
                                            X-Reach naming known users (series.REACH), and import -> export
                                            leaves patches/ unchanged
  python -m forkbuild.pq rebase VERSION --sha256 HEX [--sdist PATH]
                                            move the series onto another upstream release: patches marked
                                            `Applied-Upstream: V` with V <= VERSION are dropped, the rest are
                                            cherry-picked; pin.toml and patches/ are written only if all apply

A commit in the queue has the patch file name as its first line, a blank line, then the DEP-3 header.
"""

import argparse
import dataclasses
import filecmp
import os
import re
import shutil
import subprocess
import sys
import tempfile

from . import ForkBuildError, pin as pin_mod, series, source, stage

GIT_ID = ["-c", "user.name=forkbuild", "-c", "user.email=forkbuild@localhost", "-c", "commit.gpgsign=false"]
DIFF_OPTS = [
    "-c", "core.quotePath=true", "-c", "diff.noprefix=false", "-c", "diff.mnemonicPrefix=false", "diff", "--no-color",
    "--no-ext-diff", "--no-textconv", "--no-renames", "--full-index", "--diff-algorithm=myers", "-U3",
    "--src-prefix=a/", "--dst-prefix=b/"
]
FIXED_DATE = "2000-01-01T00:00:00+0000"


def git(tree, *args, check=True):
    env = series.git_env(tree)
    env.update(GIT_AUTHOR_DATE=FIXED_DATE, GIT_COMMITTER_DATE=FIXED_DATE)
    proc = subprocess.run(["git", "-c", "safe.directory=*"] + GIT_ID + list(args), cwd=tree, env=env,
                          capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise ForkBuildError(f"git {' '.join(args)} failed in {tree}:\n{proc.stderr.strip()}")
    return proc.stdout


def commit_all(tree, message):
    git(tree, "add", "-A")
    with tempfile.NamedTemporaryFile("w", suffix=".msg", delete=False) as f:
        f.write(message)
    try:
        git(tree, "commit", "-q", "--allow-empty", "--cleanup=verbatim", "-F", f.name)
    finally:
        os.unlink(f.name)


def new_baseline(pin, sdist, tree):
    """`tree` becomes a git repository holding the extracted sdist as its one commit, tagged `upstream`."""
    parent = os.path.dirname(os.path.abspath(tree))
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".extract-", dir=parent)
    try:
        os.replace(stage.extract(sdist, tmp, pin), tree)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    git(tree, "init", "-q", "-b", "queue")
    commit_all(tree, f"upstream {pin.name} {pin.version}\n\nsdist {pin.sdist} sha256 {pin.sha256}\n")
    git(tree, "tag", "upstream")


def import_queue(root, tree, sdist=None):
    pin = pin_mod.load(root)
    patches_dir = os.path.join(root, "patches")
    names = series.read_series(patches_dir)
    new_baseline(pin, sdist or source.obtain(pin, root), tree)
    for name in names:
        path = os.path.join(patches_dir, name)
        with open(path) as f:
            header, _ = series.split_patch(f.read())
        series.apply(path, tree, name)
        stage.mirror_patch(tree, pin, name, stage.touched_files(path))
        commit_all(tree, f"{name}\n\n{header}")
    return pin, names


@dataclasses.dataclass
class Entry:
    commit: str
    name: str
    header: str


def queue(tree):
    commits = git(tree, "rev-list", "--reverse", "upstream..HEAD").split()
    out = []
    for c in commits:
        msg = git(tree, "log", "-1", "--format=%B", c)
        name, _, header = msg.partition("\n\n")
        name = name.strip()
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._+-]*\.patch", name):
            raise ForkBuildError(f"commit {c[:12]} in {tree}: its first line must be the patch file name "
                                 f"(like fix-something.patch), got {name!r}")
        problems = series.header_problems(header)
        if problems:
            raise ForkBuildError(f"commit {c[:12]} ({name}): {'; '.join(problems)}")
        out.append(Entry(c, name, header.rstrip("\n") + "\n"))
    names = [e.name for e in out]
    dupes = sorted(set(n for n in names if names.count(n) > 1))
    if dupes:
        raise ForkBuildError(f"{tree}: several commits name the same patch: {', '.join(dupes)}")
    return out


def export_queue(tree, patches_dir, pin):
    """Write one file per queue commit and the series, replacing whatever patches/ held. A patch holds the canonical
    copy of a mirrored file only (the one upstream's git has); the build mirrors it into the packaged copy."""
    entries = queue(tree)
    packaged = [f":(exclude){dst}" for _, dst in pin.mirrors]
    files = {}
    for e in entries:
        diff = git(tree, *DIFF_OPTS, f"{e.commit}^", e.commit, "--", ".", *packaged)
        if not diff:
            raise ForkBuildError(f"commit {e.commit[:12]} ({e.name}) changes nothing outside the packaged copies "
                                 f"of mirrored directories ({', '.join(dst for _, dst in pin.mirrors)})")
        files[e.name] = e.header + "---\n" + diff
    files["series"] = "".join(e.name + "\n" for e in entries)
    os.makedirs(patches_dir, exist_ok=True)
    for old in os.listdir(patches_dir):
        if old.endswith(".patch") and old not in files:
            os.unlink(os.path.join(patches_dir, old))
    for name, text in files.items():
        path = os.path.join(patches_dir, name)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.replace(path + ".tmp", path)
    return [e.name for e in entries]


def export_upstream(root, out_dir):
    """Write the series as git-format patches (`git am`) for a clone of upstream's repository at the base tag.

    The patches already hold upstream's layout: paths from the repository root, the one copy of csrc/, op_builder/
    and accelerator/ that upstream's git has. Each becomes NNNN-<name>: author and subject from the DEP-3 header,
    the rest of the header as the message body."""
    pin = pin_mod.load(root)
    patches_dir = os.path.join(root, "patches")
    names = series.read_series(patches_dir)
    os.makedirs(out_dir, exist_ok=True)
    written = []
    for i, name in enumerate(names, 1):
        with open(os.path.join(patches_dir, name)) as f:
            header, diff = series.split_patch(f.read())
        for path in stage.touched_files(os.path.join(patches_dir, name)):
            if stage.canonical_copy(pin, path):
                raise ForkBuildError(f"patch {name} changes {path}, a packaged copy upstream's git does not have")
        fields = series.dep3_fields(header)
        title, _, more = (fields.get("Description") or fields.get("Subject") or name).partition("\n")
        body = [more] if more else []
        body += [f"{k}: {v}" for k, v in fields.items() if k not in ("Description", "Subject", "Author", "From")]
        author = fields.get("Author") or fields.get("From") or "deepspeed fork developers <fork@localhost>"
        if "<" not in author:
            author += " <fork@localhost>"
        text = (f"From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001\nFrom: {author}\n"
                f"Date: Sat, 1 Jan 2000 00:00:00 +0000\nSubject: [PATCH {i}/{len(names)}] {title.strip()}\n\n"
                + "\n".join(body).strip() + f"\n\nFork patch: {name} (on {pin.name} {pin.version})\n---\n{diff}")
        path = os.path.join(out_dir, f"{i:04d}-{name}")
        with open(path, "w") as f:
            f.write(text)
        written.append(path)
    return written


def mirror(root, tree):
    """Copy each changed file under a mirrored directory onto its twin (the newer edit wins)."""
    pin = pin_mod.load(root)
    changed = git(tree, "diff", "--name-only", "HEAD").split() + \
        git(tree, "ls-files", "--others", "--exclude-standard").split()
    copied = []
    for path in changed:
        for a, b in pin.mirrors:
            for src, dst in ((a, b), (b, a)):
                if path.startswith(src + "/"):
                    a_path, b_path = os.path.join(tree, path), os.path.join(tree, dst + path[len(src):])
                    if not os.path.exists(a_path) or (os.path.exists(b_path) and filecmp.cmp(a_path, b_path, False)):
                        continue
                    if os.path.exists(b_path) and os.stat(b_path).st_mtime > os.stat(a_path).st_mtime:
                        continue  # the twin is the newer edit; it is copied the other way round
                    os.makedirs(os.path.dirname(b_path), exist_ok=True)
                    shutil.copyfile(a_path, b_path)
                    copied.append(f"{path} -> {dst + path[len(src):]}")
    return copied


def check(root):
    """Problems found (empty when the queue is clean)."""
    patches_dir = os.path.join(root, "patches")
    problems = []
    names = series.read_series(patches_dir)
    for name in names:
        with open(os.path.join(patches_dir, name)) as f:
            header = series.split_patch(f.read())[0]
        found = series.header_problems(header)
        if "Bug" not in series.missing_fields(header):
            found += [why for why in [series.bug_reference_problem(header, root)] if why]
        problems += [f"{name}: {why}" for why in found]
    if problems:
        return problems  # the queue refuses such commits, so there is no round trip to compare
    with tempfile.TemporaryDirectory() as tmp:
        tree, out = os.path.join(tmp, "tree"), os.path.join(tmp, "patches")
        pin, _ = import_queue(root, tree)
        export_queue(tree, out, pin)
        for name in sorted(set(os.listdir(out)) | set(names + ["series"])):
            a, b = os.path.join(patches_dir, name), os.path.join(out, name)
            if not (os.path.exists(a) and os.path.exists(b) and filecmp.cmp(a, b, shallow=False)):
                problems.append(f"{name}: differs from its import -> export round trip "
                                "(run import, then export, and commit the result)")
    return problems


def version_key(text):
    try:
        from packaging.version import Version
        return Version(text)
    except ImportError:
        return tuple(int(x) for x in re.findall(r"\d+", text))


def applied_upstream(header):
    """The upstream version named by an Applied-Upstream field, or None."""
    value = series.dep3_fields(header).get("Applied-Upstream")
    m = re.search(r"v?(\d+(?:\.\d+)+)", value or "")
    return m.group(1) if m else None


def rebase(root, version, sha256, sdist=None, keep=None):
    """Move the series onto upstream `version`. Returns (kept, dropped) patch names."""
    old = pin_mod.load(root)
    new = dataclasses.replace(old, version=version, sdist=old.sdist.replace(old.version, version),
                              url=old.url.replace(old.version, version), sha256=sha256.lower(), release=1)
    with tempfile.TemporaryDirectory() as tmp:
        old_tree, new_tree = os.path.join(tmp, "old"), keep or os.path.join(tmp, "new")
        import_queue(root, old_tree)
        if sdist:
            new_sdist = source.verify(new, sdist, "--sdist")
        else:
            saved = os.environ.pop("DS_FORK_SDIST", None)
            try:
                new_sdist = source.obtain(new, os.path.join(tmp, "nowhere"))
            finally:
                if saved is not None:
                    os.environ["DS_FORK_SDIST"] = saved
        new_baseline(new, new_sdist, new_tree)
        git(new_tree, "fetch", "-q", old_tree, "queue:refs/old-queue")
        kept, dropped = [], []
        for e in queue(old_tree):
            up = applied_upstream(e.header)
            if up and version_key(up) <= version_key(version):
                dropped.append(e.name)
                continue
            proc = subprocess.run(["git", "-c", "safe.directory=*"] + GIT_ID +
                                  ["cherry-pick", "--allow-empty", "--cleanup=verbatim", e.commit],
                                  cwd=new_tree, env=series.git_env(new_tree), capture_output=True, text=True)
            if proc.returncode != 0:
                conflicts = git(new_tree, "diff", "--name-only", "--diff-filter=U", check=False).split()
                where = f"; the tree is left at {new_tree}" if keep else " (rerun with --keep DIR to resolve)"
                raise ForkBuildError(f"patch {e.name} does not apply to {old.name} {version}: conflicts in "
                                     f"{', '.join(conflicts) or '(none listed)'}{where}.\n{proc.stdout.strip()}\n"
                                     "Nothing was written to pin.toml or patches/.")
            kept.append(e.name)
        export_queue(new_tree, os.path.join(root, "patches"), new)
        pin_mod.write(root, new)
    return kept, dropped


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m forkbuild.pq", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--root", default=".", help="the fork's checkout (default: .)")
    ap.add_argument("--tree", default=None, help="the queue's working tree (default: ROOT/.pq/tree)")
    sub = ap.add_subparsers(dest="cmd", required=True)
    imp = sub.add_parser("import")
    imp.add_argument("--force", action="store_true", help="replace an existing tree")
    sub.add_parser("export")
    sub.add_parser("mirror")
    up = sub.add_parser("export-upstream")
    up.add_argument("dir", help="where to write the git-format patches")
    sub.add_parser("check")
    rb = sub.add_parser("rebase")
    rb.add_argument("version")
    rb.add_argument("--sha256", required=True)
    rb.add_argument("--sdist", help="a local copy of the new upstream sdist")
    rb.add_argument("--keep", help="build the new queue in this directory and leave it there")
    args = ap.parse_args(argv)
    root = os.path.abspath(args.root)
    tree = os.path.abspath(args.tree or os.path.join(root, ".pq", "tree"))
    try:
        if args.cmd == "import":
            if os.path.exists(tree):
                if not args.force:
                    raise ForkBuildError(f"{tree} exists; export what you need from it, then use --force")
                shutil.rmtree(tree)
            _, names = import_queue(root, tree)
            print(f"{tree}: upstream + {len(names)} patch(es); edit, `git commit`, then export")
        elif args.cmd == "export":
            names = export_queue(tree, os.path.join(root, "patches"), pin_mod.load(root))
            print(f"patches/: {len(names)} patch(es) exported")
        elif args.cmd == "export-upstream":
            written = export_upstream(root, os.path.abspath(args.dir))
            print(f"{len(written)} patch(es) for `git am` on {pin_mod.load(root).name} {pin_mod.load(root).version} "
                  f"in {os.path.abspath(args.dir)}")
        elif args.cmd == "mirror":
            print("\n".join(mirror(root, tree)) or "nothing to mirror")
        elif args.cmd == "check":
            problems = check(root)
            print("\n".join(problems) or "patch queue OK")
            return 1 if problems else 0
        elif args.cmd == "rebase":
            kept, dropped = rebase(root, args.version, args.sha256, args.sdist, args.keep and os.path.abspath(args.keep))
            print(f"rebased onto {args.version}: kept {kept}, dropped (applied upstream) {dropped}")
    except ForkBuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
