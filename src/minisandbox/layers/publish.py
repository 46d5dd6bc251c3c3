"""Publishing, the part before the manifest: reading a tree into entries and blob jobs (the scan),
and storing each job's blob (packs of small files, or one large file) unless it is there already.
A file that the tree also holds as a blob object of a git pack (a checkout beside its history) is
not stored again: its entry points at the object (`find_in_packs`, gitpack.py).

The scan never follows a symlink: it lstat()s every name (a link is stored as a link) and later
opens files with O_NOFOLLOW, refusing anything that is no longer the regular file it saw.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from minisandbox.layers.blobs import (
    check_blob,
    compress_file,
    compressor,
    open_source,
    read_at_most,
    read_pack,
    sha256_file,
)
from minisandbox.layers.errors import TreeChangedError, UnsupportedTreeError
from minisandbox.layers.gitpack import GitPackError, PackIndex, PackReader, blob_id
from minisandbox.layers.layout import StoreLayout
from minisandbox.layers.manifest import OPAQUE_XATTRS, Manifest, ManifestEntry

logger = logging.getLogger(__name__)

SMALL_FILE_BYTES = 16 * 1024
PACK_MAX_BYTES = 1024 * 1024
# One name in PACK_CUT_EVERY ends a pack run: the expected run length, in files.
PACK_CUT_EVERY = 16
# Files found in a git pack of the tree are stored as a reference to the object from this size
# (a smaller one costs less in a run than its row's sha256 and offset), up to the last (read
# whole, in memory, to compare).
MIN_IN_PACK_BYTES = 256
MAX_IN_PACK_BYTES = 64 * 1024 * 1024
MAX_INDEX_BYTES = 256 * 1024 * 1024
MAX_PACK_BYTES = 2 * 1024 * 1024 * 1024
# A git pack that files are found in is a repository's history: raw objects (githistory.py), shared
# by every later task of the repository. zstd 19 costs about 0.3 s per MB, once, when it is first
# stored, and keeps 6% less than the store's level (pytest's history); reading it is as fast.
GIT_PACK_LEVEL = 19


@dataclass
class PendingFile:
    """A regular file of the scanned tree; `blob` and `offset` are known once stored."""

    path: str
    mode: int
    size: int
    mtime: int
    blob: int = -1
    offset: int = 0
    pack: str = ""  # set when the file is a blob object of this git pack, at `offset`
    content: str = ""  # then: the sha256 of its bytes
    git_pack: bool = False  # the file is a git pack (with its index) of the tree

    def entry(self) -> ManifestEntry:
        if self.pack:
            return ManifestEntry.in_pack(
                self.path, self.mode, self.size, self.mtime, self.content, self.pack, self.offset
            )
        return ManifestEntry.file(
            self.path, self.mode, self.size, self.mtime, self.blob, self.offset
        )


@dataclass
class BlobJob:
    """One blob to store: a single large file, or a pack of small files (concatenated)."""

    sources: list[tuple[str, int]]  # (absolute path, size) in pack order
    files: list[PendingFile]
    sha: str = ""
    added: int = 0  # compressed bytes this job added to the store
    level: int = 0  # at least this zstd level (0: the store's)


@dataclass
class Scan:
    """A tree as read: its entries in manifest order (files still pending), its blob jobs."""

    entries: list[ManifestEntry | PendingFile] = field(default_factory=list)
    jobs: list[BlobJob] = field(default_factory=list)
    # Each directory's non-empty regular files, (absolute path, file), in name order.
    dir_files: list[list[tuple[str, PendingFile]]] = field(default_factory=list)
    files: int = 0
    size: int = 0

    def manifest(self) -> Manifest:
        """The manifest, once every job is stored (its `sha` known): blobs in first-use
        order, each once, and every file pointing at its own."""
        blob_shas: list[str] = []
        index: dict[str, int] = {}
        for job in self.jobs:
            i = index.setdefault(job.sha, len(blob_shas))
            if i == len(blob_shas):
                blob_shas.append(job.sha)
            for pending in job.files:
                pending.blob = i
        entries = (e.entry() if isinstance(e, PendingFile) else e for e in self.entries)
        return Manifest.build(blob_shas, entries)


def _cuts_run(name: str) -> bool:
    digest = hashlib.sha256(os.fsencode(name)).digest()
    return digest[0] % PACK_CUT_EVERY == 0


def _dir_entry(rel: str, path: str, mode: int) -> ManifestEntry:
    opaque = False
    for name in OPAQUE_XATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                opaque = True
                break
        except OSError:  # no such attribute, or no xattrs here at all
            continue
    return ManifestEntry.directory(rel, stat.S_IMODE(mode), opaque=opaque)


def _pack_job(run: list[tuple[str, PendingFile, int]]) -> BlobJob:
    offset = 0
    for _path, pending, size in run:
        pending.offset = offset
        offset += size
    return BlobJob([(p, s) for p, _f, s in run], [f for _p, f, _s in run])


def scan_tree(directory: Path, small_file_bytes: int) -> Scan:
    """Read the tree at `directory`: a stable, sorted depth-first walk that never follows a
    link; only regular files, directories, symlinks and overlay whiteouts are accepted. Files
    found in a git pack of the tree get no job (`find_in_packs`); the others are grouped."""
    scan = Scan()
    root = os.fspath(directory)
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsupportedTreeError(f"{directory} is not a directory")
    scan.entries.append(_dir_entry(".", root, st.st_mode))
    stack = [("", root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        subdirs = _scan_dir(scan, rel_dir, abs_dir)
        # Reversed so that the stack pops subdirectories in name order: a stable, sorted DFS.
        stack.extend(reversed(subdirs))
    find_in_packs(scan)
    for files in scan.dir_files:
        _group_files(scan, [(p, f) for p, f in files if not f.pack], small_file_bytes)
    return scan


def _scan_dir(scan: Scan, rel_dir: str, abs_dir: str) -> list[tuple[str, str]]:
    """Add the children of one directory to `scan`; returns its subdirectories (rel, abs)."""
    with os.scandir(abs_dir) as it:
        children = sorted(it, key=lambda e: e.name)
    files: list[tuple[str, PendingFile]] = []
    subdirs = []
    for child in children:
        rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
        cst = child.stat(follow_symlinks=False)
        mode = cst.st_mode
        if stat.S_ISDIR(mode):
            scan.entries.append(_dir_entry(rel, child.path, mode))
            subdirs.append((rel, child.path))
        elif stat.S_ISLNK(mode):
            scan.entries.append(ManifestEntry.symlink(rel, os.readlink(child.path)))
        elif stat.S_ISREG(mode):
            pending = PendingFile(rel, stat.S_IMODE(mode), cst.st_size, int(cst.st_mtime))
            scan.entries.append(pending)
            scan.files += 1
            scan.size += cst.st_size
            if cst.st_size:
                files.append((child.path, pending))
        elif stat.S_ISCHR(mode) and cst.st_rdev == 0:
            scan.entries.append(ManifestEntry.whiteout(rel))
        else:
            raise UnsupportedTreeError(
                f"{child.path}: cannot store this file type ({stat.filemode(mode)[0]!r});"
                " only regular files, directories, symlinks and overlay whiteouts"
            )
    if files:
        scan.dir_files.append(files)
    return subdirs


def _group_files(scan: Scan, files: list[tuple[str, PendingFile]], small_file_bytes: int) -> None:
    """Jobs for one directory's files: a large file alone, small ones in runs."""
    run: list[tuple[str, PendingFile, int]] = []
    run_bytes = 0
    for path, pending in files:
        if pending.size >= small_file_bytes:
            level = GIT_PACK_LEVEL if pending.git_pack else 0
            scan.jobs.append(BlobJob([(path, pending.size)], [pending], level=level))
            continue
        run.append((path, pending, pending.size))
        run_bytes += pending.size
        if _cuts_run(os.path.basename(path)) or run_bytes >= PACK_MAX_BYTES:
            scan.jobs.append(_pack_job(run))
            run, run_bytes = [], 0
    if run:
        scan.jobs.append(_pack_job(run))


def _read_regular(path: str, limit: int) -> bytes | None:
    """The bytes of the regular file at `path` (`open_source`: never through a link), or None
    when it is not one, is unreadable or is larger than `limit`."""
    try:
        with open_source(path) as fh:
            if os.fstat(fh.fileno()).st_size > limit:
                return None
            data = read_at_most(fh, limit + 1)
    except (OSError, TreeChangedError):
        return None
    return data if len(data) <= limit else None


def _open_pack(path: str, idx_path: str) -> PackReader | None:
    # Read, not mapped: the tree is a sandbox's, and a file mapped here and truncated by a
    # process still writing it would kill this one (SIGBUS).
    index = _read_regular(idx_path, MAX_INDEX_BYTES)
    pack = _read_regular(path, MAX_PACK_BYTES) if index is not None else None
    if index is None or pack is None:
        return None
    try:
        return PackReader(pack, PackIndex(index))
    except GitPackError:
        return None


def find_in_packs(scan: Scan) -> None:
    """Mark the files of `scan` that are blob objects of a git pack the tree holds (a
    `pack/*.pack` with its `.idx`, readable by anyone: unpacking reads it back), each proven by
    reading the object and comparing; those files get no blob of their own."""
    by_rel = {f.path: (p, f) for files in scan.dir_files for p, f in files}
    packs = []
    for rel, (path, f) in by_rel.items():
        idx = rel.removesuffix(".pack") + ".idx"
        if (
            rel.endswith(".pack")
            and rel.rpartition("/")[0].endswith("pack")
            and idx in by_rel
            and f.mode & 0o444 == 0o444
            and by_rel[idx][1].mode & 0o444 == 0o444
        ):
            reader = _open_pack(path, by_rel[idx][0])
            if reader is not None:
                packs.append((rel, reader))
                f.git_pack = True
    if not packs:
        return
    in_packs = {p for rel, _ in packs for p in (rel, rel.removesuffix(".pack") + ".idx")}
    for rel, (path, f) in by_rel.items():
        if f.size < MIN_IN_PACK_BYTES or f.size > MAX_IN_PACK_BYTES or rel in in_packs:
            continue
        data = _read_regular(path, MAX_IN_PACK_BYTES)
        if data is None or len(data) != f.size:
            continue
        oid = blob_id(data)
        for pack_rel, reader in packs:
            offset = reader.index.offset(oid) if reader.index is not None else None
            if offset is None:
                continue
            try:
                same = reader.blob(offset) == data
            except GitPackError as e:
                logger.debug("%s: object %s unreadable (%s)", pack_rel, oid.hex(), e)
                continue
            if same:
                f.pack, f.offset = pack_rel, offset
                f.content = hashlib.sha256(data).hexdigest()
                break


class BlobWriter:
    """Stores the blobs of blob jobs in a store (`layout`), at zstd `level`. A blob already
    there is reused (and touched, so that gc's grace covers it); with `verify`, only when it
    re-hashes to its name."""

    def __init__(self, layout: StoreLayout, *, level: int, small_file_bytes: int) -> None:
        self.layout = layout
        self.level = level
        self.small_file_bytes = small_file_bytes

    def store(self, job: BlobJob, verify: bool = False) -> None:
        """Store the job's blob; sets `job.sha` and `job.added`."""
        if len(job.sources) == 1 and job.sources[0][1] >= self.small_file_bytes:
            self._store_file(job, verify)
        else:
            self._store_pack(job, verify)

    def _store_pack(self, job: BlobJob, verify: bool) -> None:
        data = read_pack(job.sources)
        job.sha = hashlib.sha256(data).hexdigest()
        if self._reuse(job.sha, verify):
            return
        level = self.level
        job.added = self._put(job.sha, lambda fh: fh.write(compressor(level, 0).compress(data)))

    def _store_file(self, job: BlobJob, verify: bool) -> None:
        path, size = job.sources[0]
        sha = job.sha = sha256_file(path)
        if self._reuse(sha, verify):
            return
        level = max(self.level, job.level)
        job.added = self._put(
            sha, lambda out: compress_file(path, out, size=size, sha=sha, level=level)
        )

    def _reuse(self, sha: str, verify: bool) -> bool:
        """True if the blob is already stored (and, with `verify`, holds what its name says);
        then mark it fresh so gc's grace covers it. False: the caller (re)writes it."""
        path = self.layout.blob_path(sha)
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        except PermissionError:
            if not path.exists():
                return False  # another user's blob: still good to reference
        if verify and check_blob(path).digest != sha:
            logger.warning("blob %s is corrupt; storing it anew", path)
            return False
        return True

    def _put(self, sha: str, write: Callable[[IO[bytes]], object]) -> int:
        final = self.layout.blob_path(sha)
        final.parent.mkdir(exist_ok=True)
        tmp = self.layout.tmp_path("blob")
        try:
            with open(tmp, "wb") as fh:
                write(fh)
                fh.flush()
                if self.layout.fsync:
                    os.fsync(fh.fileno())
                size = fh.tell()
            os.chmod(tmp, 0o444)
            # Two writers may race for the same blob: identical bytes, so either rename wins.
            added = 0 if final.exists() else size
            os.replace(tmp, final)
            return added
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
