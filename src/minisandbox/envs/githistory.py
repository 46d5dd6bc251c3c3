"""A task's repository that holds only its past, with that past stored once per repository.

An agent must not reach the fix. Removing later refs is not enough: a clone keeps every object of
the source, and `git cat-file --batch-all-objects` or `git fsck --lost-found` finds the fix among
the unreachable ones (SWE-bench issue #465). So a checkout here is built from packs that hold
only objects reachable from the base commit (and from the tags that are its ancestors), with no
remote, no reflog and no other ref.

Storing that past once per repository: a task's objects are a chain of packs along the base
commit's first-parent history, cut at fixed points (every `COARSE` first-parent commits from the
root: the same commits for every task whose history passes there), then one pack from the nearest
already-built task of the same stretch (an ancestor: its packs are ours too) up to the base commit.
Packs are plain files, identical across the tasks that share them, so the layer store keeps each
once, and it keeps the checkout's files as references to their objects in them (layers/gitpack.py);
they are kept, for later builds, in a pack cache beside the store.

The check that proves it for a built task is `data/check_history.sh`, run by validation inside the
task's sandbox (as an agent's git sees the repository): every object is reachable from the
allowed refs, the refs are HEAD's branch and ancestor tags only, there is no reflog, stash,
remote, FETCH_HEAD or ORIG_HEAD, and no blob the gold patch creates is present outside HEAD's
history. `object_counts` counts the first of these on the host, for checkouts the host made
itself (tests).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple

from minisandbox.errors import MiniSandboxError

COARSE = 1024  # first-parent commits per shared pack
# Every checkout's files get this mtime (2000-01-01): the same file in two tasks' checkouts is
# then the same file to the layer store and the node's pool (which key on content, mode and
# mtime), so a node holds it once. The index is refreshed to match.
CHECKOUT_MTIME = 946684800
_FORMAT = 3  # 2: cut chains apart from task chains, task chains record their tags; 3: raw
_SHA = re.compile(r"^[0-9a-f]{40}$")
_MISSING_OBJECT = re.compile(r"unable to read ([0-9a-f]{40})")
# No user or system git configuration may change what we write (hooks, templates, gc).
GIT_ENV = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_TERMINAL_PROMPT": "0",
    "LC_ALL": "C",
}


class HistoryError(MiniSandboxError):
    """The repository's history cannot be cut at the base commit (missing commit, shallow source,
    a tag on a later commit...); the message names the repository, the commit and what is
    missing."""


def _git(
    repo: str | Path,
    *args: str,
    stdin: str | None = None,
    check: bool = True,
    ok: tuple[int, ...] = (0,),
) -> str:
    env = {**os.environ, **GIT_ENV}
    r = subprocess.run(
        ["git", "-C", str(repo), *args],
        input=stdin,
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    if check and r.returncode not in ok:
        raise HistoryError(f"git {' '.join(args[:3])} in {repo} failed: {r.stderr.strip()[-500:]}")
    return r.stdout


class PackCache:
    """Packs of one repository's history, shared by its tasks' checkouts.

    Layout of `root`: `<name>.pack` / `<name>.idx` (git's pack and index, `name` its content
    hash) and `chains/<tip>.json` (the packs that hold exactly what `tip` reaches, in order, and
    the coarse cut it extends). Files appear by rename; a lock file serialises builders."""

    def __init__(self, root: Path, coarse: int = COARSE) -> None:
        # Absolute: git runs in the mirror, where a relative path names another place.
        self.root = Path(root).absolute()
        self.coarse = coarse
        (self.root / "chains").mkdir(parents=True, exist_ok=True)
        # Packs being written by a build that was killed: an hour is far longer than any.
        for name in os.listdir(self.root):
            path = self.root / name
            with contextlib.suppress(OSError):
                if name.startswith(".new-") and time.time() - path.stat().st_mtime > 3600:
                    shutil.rmtree(path)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def chain(self, name: str) -> dict | None:
        """The chain saved as `name`: a task's (its base commit's id) or a cut's (`cut-<id>`)."""
        try:
            doc = json.loads((self.root / "chains" / f"{name}.json").read_text())
        except (FileNotFoundError, ValueError):
            return None
        if doc.get("format") != _FORMAT or doc.get("coarse") != self.coarse:
            return None
        if not all(self.has(p) for p in doc["packs"]):
            return None
        return doc

    def chains(self) -> dict[str, dict]:
        """The tasks' chains by base commit (not the cuts': those hold no tags)."""
        out = {}
        for name in os.listdir(self.root / "chains"):
            tip = name.removesuffix(".json")
            if _SHA.match(tip) and (doc := self.chain(tip)) is not None:
                out[tip] = doc
        return out

    def save_chain(
        self,
        name: str,
        packs: list[str],
        cut: str | None,
        depth: int,
        tags: dict[str, str] | None = None,
    ) -> None:
        """Record a chain: `tags` (name -> object) are the ancestor tags a task's chain holds;
        None for a cut's, which holds commits, trees and blobs only."""
        doc = {
            "format": _FORMAT,
            "coarse": self.coarse,
            "packs": packs,
            "cut": cut,
            "depth": depth,
            "tags": tags,
        }
        tmp = self.root / "chains" / f".{name}.{os.getpid()}.tmp"
        tmp.write_text(json.dumps(doc))
        os.replace(tmp, self.root / "chains" / f"{name}.json")

    def has(self, name: str) -> bool:
        return (self.root / f"{name}.pack").is_file() and (self.root / f"{name}.idx").is_file()

    def make_pack(self, source: str | Path, revs: list[str]) -> str:
        """A pack of the objects `git rev-list --objects <revs>` lists in `source`; its name."""
        with tempfile.TemporaryDirectory(dir=self.root, prefix=".new-") as tmp:
            try:
                out = _git(
                    source,
                    # Objects stored raw: the layer store's zstd, over the whole pack, makes
                    # it a third of zlib's object by object (pytest's history: 10.6 MB vs
                    # 19.1 MB stored; 36 MB on a node).
                    "-c",
                    "pack.compression=0",
                    # git's defaults, whatever the source repository's own config says.
                    "-c",
                    "pack.window=10",
                    "-c",
                    "pack.depth=50",
                    "-c",
                    "core.bigFileThreshold=512m",
                    "pack-objects",
                    "--revs",
                    # Deltas and objects made here, not copied from the source's own packs:
                    # with one thread, the same bytes for the same objects whatever the source's
                    # packing (its deltas are also often poor: 30 MB against 19 MB).
                    "--no-reuse-object",
                    "--threads=1",
                    "-q",
                    f"{tmp}/p",
                    stdin="\n".join(revs) + "\n",
                ).strip()
            except HistoryError as e:
                missing = _MISSING_OBJECT.search(str(e))
                if missing is None:
                    raise
                raise HistoryError(
                    f"{source} lacks object {missing.group(1)}, which the history up to the "
                    "base commit needs (a partial, filtered or damaged clone?): use a complete "
                    "clone as the mirror, or none (the builder then clones the repository)"
                ) from None
            if not _SHA.match(out):
                raise HistoryError(f"git pack-objects in {source} printed {out!r}")
            for ext in ("idx", "pack"):  # the pack last: `has` needs both
                os.chmod(f"{tmp}/p-{out}.{ext}", 0o444)
                os.replace(f"{tmp}/p-{out}.{ext}", self.root / f"{out}.{ext}")
        return out


def _first_parents(source: str | Path, base: str) -> list[str]:
    return _git(source, "rev-list", "--first-parent", "--reverse", base).split()


def _is_ancestor(source: str | Path, a: str, b: str) -> bool:
    env = {**os.environ, **GIT_ENV}
    r = subprocess.run(
        ["git", "-C", str(source), "merge-base", "--is-ancestor", a, b],
        capture_output=True,
        env=env,
        check=False,
    )
    return r.returncode == 0


def ancestor_tags(source: str | Path, base: str) -> dict[str, str]:
    """Tag name -> object id of the tags whose commit is an ancestor of `base`."""
    out = _git(
        source,
        "for-each-ref",
        "--merged",
        base,
        "--format=%(refname:strip=2) %(objectname)",
        "refs/tags",
    )
    return dict(line.split(" ", 1) for line in out.splitlines() if " " in line)


def resolve_commit(source: str | Path, rev: str) -> str:
    """The full id of commit `rev` in `source`. Raises HistoryError when it is not there."""
    if rev.startswith("-") or not rev.strip():
        raise HistoryError(f"{source}: {rev!r} is not a commit")
    full = _git(source, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}", check=False)
    if not _SHA.match(full.strip()):
        raise HistoryError(f"commit {rev} is not in {source}")
    return full.strip()


def plan_packs(source: str | Path, base: str, cache: PackCache) -> tuple[list[str], dict[str, str]]:
    """The packs (made where missing) that together hold exactly what `base` and its ancestor
    tags reach, and those tags (name -> object), as read once under the cache's lock. Raises
    HistoryError when `source` lacks the commit or is shallow."""
    base = resolve_commit(source, base)
    if _git(source, "rev-parse", "--is-shallow-repository").strip() == "true":
        raise HistoryError(f"{source} is a shallow clone: the history of {base} is incomplete")
    with cache.locked():
        tags = ancestor_tags(source, base)
        done = cache.chain(base)
        # Reused only while the repository's tags are what they were: a tag moved or deleted
        # since would leave its old object in the packs, unreachable.
        if done is not None and done.get("tags") == tags:
            return list(done["packs"]), tags
        firsts = _first_parents(source, base)
        packs: list[str] = []
        cut: str | None = None
        # Shared cuts: the same first-parent commits for every task whose history holds them.
        for depth in range(cache.coarse, len(firsts), cache.coarse):
            tip = firsts[depth - 1]
            known = cache.chain(f"cut-{tip}")
            if known is None:
                packs = [*packs, cache.make_pack(source, [tip, *([f"^{cut}"] if cut else [])])]
                cache.save_chain(f"cut-{tip}", packs, cut, depth)
            else:
                packs = list(known["packs"])
            cut = tip
        # Then from the nearest task already built on this stretch, or from the cut.
        start, start_packs, best = cut, packs, -1
        for tip, doc in cache.chains().items():
            held = doc.get("tags") or {}
            if (
                doc.get("cut") == cut
                and best < doc["depth"] < len(firsts)
                and all(tags.get(name) == oid for name, oid in held.items())
                and _is_ancestor(source, tip, base)
            ):
                start, start_packs, best = tip, list(doc["packs"]), doc["depth"]
        tag_refs = [f"refs/tags/{t}" for t in tags]
        revs = [base, *tag_refs, *([f"^{start}"] if start else [])]
        packs = [*start_packs, cache.make_pack(source, revs)]
        cache.save_chain(base, packs, cut, len(firsts), tags)
        return packs, tags


def checkout_past(
    source: str | Path, base: str, dest: Path, cache: PackCache, branch: str = "main"
) -> None:
    """A new repository at `dest` on `branch` at `base`, its work tree checked out, holding
    only the past of `base` (see the module docstring). `source` is a local repository."""
    base = resolve_commit(source, base)
    # The tags written as refs are the ones the packs hold (read once: one may move meanwhile).
    packs, tags = plan_packs(source, base, cache)
    _git(dest.parent, "init", "-q", "--template=", f"--initial-branch={branch}", str(dest))
    _git(dest, "config", "core.logAllRefUpdates", "false")
    pack_dir = dest / ".git" / "objects" / "pack"
    pack_dir.mkdir(parents=True, exist_ok=True)
    for name in packs:
        for ext in ("pack", "idx"):
            # Copies, not links: the checkout becomes sandbox-writable; the cache must not.
            shutil.copyfile(cache.root / f"{name}.{ext}", pack_dir / f"pack-{name}.{ext}")
            os.chmod(pack_dir / f"pack-{name}.{ext}", 0o444)
    _git(dest, "update-ref", f"refs/heads/{branch}", base)
    for tag, oid in tags.items():
        _git(dest, "update-ref", f"refs/tags/{tag}", oid)
    _git(dest, "reset", "-q", "--hard", base)
    _settle_mtimes(dest)
    _git(dest, "update-index", "-q", "--refresh")
    for leftover in ("ORIG_HEAD", "FETCH_HEAD", "logs"):
        path = dest / ".git" / leftover
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()


def python_imports_at(source: str | Path, commit: str) -> str:
    """The import lines of the Python files of `source` at `commit` (git grep; none is "")."""
    # grep exits 1 when nothing matches: a repository that imports nothing.
    pattern = r"^\s*(import|from)\s"
    return _git(source, "grep", "-h", "-I", "-E", pattern, commit, "--", "*.py", ok=(0, 1))


def commit_date(source: str | Path, commit: str) -> str:
    """The committer date of `commit` (ISO 8601)."""
    return _git(source, "log", "-1", "--format=%cI", commit).strip()


def blobs_at(source: str | Path, commit: str) -> dict[str, int]:
    """The regular files of `source`'s tree at `commit` and their sizes (links and submodules
    left out: a path read from here is never followed anywhere)."""
    out = _git(source, "ls-tree", "-r", "-l", "-z", commit)
    blobs = {}
    for entry in out.split("\0"):
        meta, _, path = entry.partition("\t")
        fields = meta.split()
        if len(fields) == 4 and fields[0] in ("100644", "100755") and fields[3].isdigit():
            blobs[path] = int(fields[3])
    return blobs


def read_at(source: str | Path, commit: str, path: str) -> str:
    """The text of the file `path` at `commit` (undecodable bytes replaced)."""
    env = {**os.environ, **GIT_ENV}
    r = subprocess.run(
        ["git", "-C", str(source), "cat-file", "blob", f"{commit}:{path}"],
        capture_output=True,
        env=env,
        check=False,
    )
    if r.returncode != 0:
        raise HistoryError(f"git cat-file {commit}:{path} in {source} failed: {r.stderr!r}")
    return r.stdout.decode("utf-8", errors="replace")


class Submodule(NamedTuple):
    """A git submodule of a checkout: its name and path in .gitmodules, its URL, and the commit
    the superproject's tree records for it."""

    name: str
    path: str
    url: str
    commit: str


def submodules(dest: Path) -> list[Submodule]:
    """The submodules of the checkout at `dest` (a repository this module just made: its
    .gitmodules and tree are the base commit's)."""
    if not _git(dest, "ls-tree", "HEAD", "--", ".gitmodules").strip():
        return []
    links = {}
    for line in _git(dest, "ls-tree", "-r", "-z", "HEAD").split("\0"):
        meta, _, path = line.partition("\t")
        if meta.startswith("160000 commit "):
            links[path] = meta.split()[2]
    # From the commit, not the work tree: what git recorded, whatever the tree holds.
    config = _git(
        dest, "config", "--blob", "HEAD:.gitmodules", "-z", "--get-regexp",
        r"^submodule\..*\.(path|url)$",
    )  # fmt: skip
    fields: dict[str, dict[str, str]] = {}
    for entry in filter(None, config.split("\0")):
        key, _, value = entry.partition("\n")
        name, _, field = key.removeprefix("submodule.").rpartition(".")
        fields.setdefault(name, {})[field] = value
    out = []
    for name, f in fields.items():
        sub_path, url = f.get("path"), f.get("url")
        if sub_path is not None and sub_path in links and url:
            out.append(Submodule(name, sub_path, url, links[sub_path]))
    return out


def add_submodule(dest: Path, sub: Submodule, source: str | Path, cache: PackCache) -> None:
    """Check the submodule out at its recorded commit inside `dest`, holding only its past
    like any checkout here, and register it (initialised, as `git submodule update --init`
    leaves it): build scripts that look at `git submodule status` find it in place and do not
    fetch (astropy's ah_bootstrap.py would, and evaluation has no network)."""
    parts = Path(sub.path).parts
    if not parts or Path(sub.path).is_absolute() or {"..", ".git", "."} & set(parts):
        raise HistoryError(f"submodule {sub.name}: path {sub.path!r} is not inside the checkout")
    where = dest / sub.path
    for i in range(1, len(parts) + 1):  # no link on the way: it could lead out of `dest`
        if (dest.joinpath(*parts[:i])).is_symlink():
            raise HistoryError(f"submodule {sub.name}: {'/'.join(parts[:i])} is a symlink")
    if where.exists() and (not where.is_dir() or any(where.iterdir())):
        raise HistoryError(f"submodule {sub.name}: {sub.path} is not an empty directory")
    where.parent.mkdir(parents=True, exist_ok=True)
    if where.exists():
        where.rmdir()
    checkout_past(source, sub.commit, where, cache, branch="main")
    _git(dest, "config", f"submodule.{sub.name}.url", sub.url)
    _git(dest, "config", f"submodule.{sub.name}.active", "true")


def _settle_mtimes(dest: Path) -> None:
    """CHECKOUT_MTIME on the work tree's files and the packs (not on .git's other files)."""
    for dirpath, _dirnames, filenames in os.walk(dest):
        rel = os.path.relpath(dirpath, dest)
        in_git = rel == ".git" or rel.startswith(".git/")
        if in_git and rel != os.path.join(".git", "objects", "pack"):
            continue
        for name in filenames:
            os.utime(
                os.path.join(dirpath, name), (CHECKOUT_MTIME, CHECKOUT_MTIME), follow_symlinks=False
            )


def object_counts(testbed: Path) -> tuple[int, int]:
    """(objects in the repository, objects not reachable from its refs)."""
    every = set(
        _git(testbed, "cat-file", "--batch-all-objects", "--batch-check=%(objectname)").split()
    )
    reachable = {
        line.split(" ", 1)[0]
        for line in _git(testbed, "rev-list", "--objects", "--all").splitlines()
    }
    return len(every), len(every - reachable)
