"""A content-addressed store of layers: directory trees built once, stored small, shared.

The store is a plain directory, local or on a shared filesystem. It never uses a database or a
long-held lock: every file appears by an atomic rename of a finished temp file, so any number of
writers, on any number of machines, may publish at once, and a writer killed midway leaves only
temp files that `gc` removes.

Layout of `root`:

    blobs/ab/<sha256>.zst        file contents, zstd; the name is the sha256 of the *uncompressed*
                                 bytes. A blob holds one large file, or a pack: the concatenated
                                 small files of a run of one directory.
    layers/<id>.manifest.zst     the layer: canonical JSON of its entries, zstd. id = sha256 of the
                                 uncompressed JSON. Renamed in last: a layer exists iff this does.
    layers/<id>.json             what a publish measured (size, files, stored_bytes, created) and
                                 the caller's `meta`; replaced atomically when meta changes.
    refs/<name>                  a named ref: the layer id, replaced atomically by `tag`.
    tmp/                         temp files of publishes in flight (or crashed ones, for `gc`).
    quarantine/                  corrupt blobs that `verify(repair=True)` moved aside.

Small files are packed by directory so that file counts stay manageable (a venv holds tens of
thousands of files) while packs stay content-addressed and so dedupe across layers: the small files
(< `small_file_bytes`, 16 KiB by default) of one directory, in name order, are cut into runs at
names whose hash ends a run (about 16 files a run, at most 1 MiB). Boundaries depend on names only,
so a file added or changed re-stores its own run, not the directory, and an identical package
directory in two venvs yields identical packs.

Owners are not stored (`unpack` sets them); modes, symlink targets and file mtimes (whole seconds,
which keeps .pyc caches valid) are. Hard links are stored as copies (their content once). Overlay
whiteouts and opaque directories are kept, so that an overlay's upper directory is a valid layer.

`gc` removes a blob only when no layer references it *and* it is older than a grace period (one
hour by default); a publish touches every blob it reuses, and checks after its manifest landed that
no blob went missing meanwhile (restoring any from the source tree).

The API is blocking (it is file I/O); from async code run it in a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import datetime as dt
import errno
import functools
import hashlib
import json
import logging
import os
import secrets
import shutil
import socket
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, cast
from urllib.parse import quote, unquote

import zstandard
from pydantic import BaseModel, ConfigDict

from minisandbox.errors import MiniSandboxError
from minisandbox.layers.pool import FilePool, pool_name
from minisandbox.sandbox.cleanup import remove_tree

logger = logging.getLogger(__name__)

FORMAT = 1
SMALL_FILE_BYTES = 16 * 1024
PACK_MAX_BYTES = 1024 * 1024
# One name in PACK_CUT_EVERY ends a pack run: the expected run length, in files.
PACK_CUT_EVERY = 16
# Files at least this big are compressed by several zstd threads.
MULTITHREAD_BYTES = 8 * 1024 * 1024
GC_GRACE_SECONDS = 3600.0
_CHUNK = 1024 * 1024
_HEX = frozenset("0123456789abcdef")


class LayerStoreError(MiniSandboxError):
    """A layer store operation failed (bad tree, bad name, unsupported file type, ...)."""


class LayerNotFoundError(LayerStoreError, KeyError):
    """No layer with this id is in the store."""

    def __str__(self) -> str:  # KeyError would print the repr of the message
        return str(self.args[0]) if self.args else ""


class CorruptLayerError(LayerStoreError):
    """A blob or manifest does not hash to its name, is truncated, or is missing."""

    def __init__(self, layer_id: str, path: Path, reason: str) -> None:
        super().__init__(f"layer {layer_id}: {path} is corrupt ({reason})")
        self.layer_id = layer_id
        self.path = path
        self.reason = reason


class LayerRef(BaseModel):
    """A published layer. `stored_bytes` is what publishing it added to the store (0 when an
    identical layer was already there); `size` is the bytes of its files once unpacked."""

    model_config = ConfigDict(frozen=True)

    id: str
    size: int
    stored_bytes: int
    files: int
    created: dt.datetime
    meta: dict[str, Any] | None = None


class VerifyReport(BaseModel):
    """What `verify` found: one line per problem, and with repair what it did about it."""

    problems: list[str] = []
    broken_layers: list[str] = []  # layers with a corrupt manifest or a corrupt/missing blob
    dropped_refs: list[str] = []  # refs of those layers that repair removed


class GcReport(BaseModel):
    removed_layers: list[str] = []
    removed_blobs: int = 0
    removed_temps: int = 0
    freed_bytes: int = 0
    problems: list[str] = []


# -- the manifest ---------------------------------------------------------------------------
# entries: ["d", path, mode] | ["d", path, mode, "opaque"] | ["l", path, target] | ["w", path]
#        | ["f", path, mode, size, mtime, blob, offset]
# "w" is an overlayfs whiteout and "opaque" an overlayfs opaque directory: a layer may be the upper
# directory of an overlay (a task's changes on top of its environment), deletions included.
# `blob` indexes the manifest's "blobs" list (-1 for an empty file). Paths are relative, "/"-joined,
# "." for the root, surrogate-escaped where a name is not UTF-8 (JSON keeps them as \udcXX).


@dataclass
class _FileEntry:
    path: str
    mode: int
    size: int
    mtime: int
    blob: int = -1
    offset: int = 0


@dataclass
class _BlobJob:
    """One blob to store: a single large file, or a pack of small files (concatenated)."""

    sources: list[tuple[str, int]]  # (absolute path, size) in pack order
    entries: list[_FileEntry]
    sha: str = ""
    added: int = 0  # compressed bytes this job added to the store


@dataclass
class _Scan:
    entries: list[list[Any]] = field(default_factory=list)
    jobs: list[_BlobJob] = field(default_factory=list)
    files: int = 0
    size: int = 0


def _cuts_run(name: str) -> bool:
    digest = hashlib.sha256(os.fsencode(name)).digest()
    return digest[0] % PACK_CUT_EVERY == 0


def _scan(directory: Path, small_file_bytes: int) -> _Scan:
    scan = _Scan()
    root = os.fspath(directory)
    st = os.stat(root)
    if not stat.S_ISDIR(st.st_mode):
        raise LayerStoreError(f"{directory} is not a directory")
    scan.entries.append(_dir_entry(".", root, st.st_mode))
    stack = [("", root)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        with os.scandir(abs_dir) as it:
            children = sorted(it, key=lambda e: e.name)
        run: list[tuple[str, _FileEntry, int]] = []
        run_bytes = 0
        subdirs = []
        for child in children:
            rel = f"{rel_dir}/{child.name}" if rel_dir else child.name
            cst = child.stat(follow_symlinks=False)
            mode = cst.st_mode
            if stat.S_ISDIR(mode):
                scan.entries.append(_dir_entry(rel, child.path, mode))
                subdirs.append((rel, child.path))
            elif stat.S_ISLNK(mode):
                scan.entries.append(["l", rel, os.readlink(child.path)])
            elif stat.S_ISREG(mode):
                entry = _FileEntry(rel, stat.S_IMODE(mode), cst.st_size, int(cst.st_mtime))
                scan.entries.append(["f", entry])
                scan.files += 1
                scan.size += cst.st_size
                if cst.st_size == 0:
                    continue
                if cst.st_size >= small_file_bytes:
                    scan.jobs.append(_BlobJob([(child.path, cst.st_size)], [entry]))
                    continue
                run.append((child.path, entry, cst.st_size))
                run_bytes += cst.st_size
                if _cuts_run(child.name) or run_bytes >= PACK_MAX_BYTES:
                    scan.jobs.append(_pack_job(run))
                    run, run_bytes = [], 0
            elif stat.S_ISCHR(mode) and cst.st_rdev == 0:
                scan.entries.append(["w", rel])
            else:
                raise LayerStoreError(
                    f"{child.path}: cannot store this file type ({stat.filemode(mode)[0]!r});"
                    " only regular files, directories, symlinks and overlay whiteouts"
                )
        if run:
            scan.jobs.append(_pack_job(run))
        # Reversed so that the stack pops subdirectories in name order: a stable, sorted DFS.
        stack.extend(reversed(subdirs))
    return scan


_OPAQUE_XATTRS = ("user.overlay.opaque", "trusted.overlay.opaque")


def _dir_entry(rel: str, path: str, mode: int) -> list[Any]:
    entry: list[Any] = ["d", rel, stat.S_IMODE(mode)]
    for name in _OPAQUE_XATTRS:
        try:
            if os.getxattr(path, name, follow_symlinks=False) == b"y":
                entry.append("opaque")
                break
        except OSError:  # no such attribute, or no xattrs here at all
            continue
    return entry


def _mark_opaque(path: str) -> None:
    # The user.* name serves overlays mounted in a user namespace (bwrap's); trusted.* those
    # mounted by the real root, and only root may set it.
    os.setxattr(path, _OPAQUE_XATTRS[0], b"y", follow_symlinks=False)
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.setxattr(path, _OPAQUE_XATTRS[1], b"y", follow_symlinks=False)


def _pack_job(run: list[tuple[str, _FileEntry, int]]) -> _BlobJob:
    offset = 0
    for _path, entry, size in run:
        entry.offset = offset
        offset += size
    return _BlobJob([(p, s) for p, _e, s in run], [e for _p, e, _s in run])


def _canonical(scan: _Scan, blob_shas: list[str]) -> bytes:
    entries: list[list[Any]] = []
    for e in scan.entries:
        if e[0] == "f":
            f: _FileEntry = e[1]
            entries.append(["f", f.path, f.mode, f.size, f.mtime, f.blob, f.offset])
        else:
            entries.append(e)
    doc = {"format": FORMAT, "blobs": blob_shas, "entries": entries}
    # ensure_ascii keeps non-UTF-8 names (lone surrogates) encodable, and the bytes canonical.
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


# -- helpers --------------------------------------------------------------------------------

_local = threading.local()


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    # zstd contexts are not thread-safe and costly to create: one per thread and setting.
    cache = _local.__dict__.setdefault("cctx", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
    return cache[key]


def _decompressor() -> zstandard.ZstdDecompressor:
    if not hasattr(_local, "dctx"):
        _local.dctx = zstandard.ZstdDecompressor()
    return _local.dctx


class _HashingReader:
    """A file reader that hashes what passes through (for zstd's copy_stream)."""

    def __init__(self, fh: Any) -> None:
        self._fh = fh
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self.hash.update(data)
        return data


def _open_source(path: str) -> IO[bytes]:
    """A file of the tree being published, for reading: the scan saw a regular file here, so a
    symlink (or a FIFO) in its place now is refused rather than followed or waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LayerStoreError(f"{path} changed while it was being published")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with _open_source(path) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def _read_pack(sources: list[tuple[str, int]]) -> bytes:
    parts = []
    for path, size in sources:
        with _open_source(path) as fh:
            data = fh.readall()
        if len(data) != size:
            raise LayerStoreError(f"{path} changed while it was being published")
        parts.append(data)
    return b"".join(parts)


def _blob_hash(path: Path) -> tuple[str | None, str]:
    """(sha256 of the blob's uncompressed content, "") or (None, why it cannot be read)."""
    try:
        h = hashlib.sha256()
        with open(path, "rb") as src:
            reader = _decompressor().stream_reader(src, read_size=_CHUNK)
            while chunk := reader.read(_CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return None, "missing"
    except (OSError, zstandard.ZstdError) as exc:
        return None, str(exc)
    return h.hexdigest(), "sha256 mismatch"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some shared filesystems refuse fsync on directories
    finally:
        os.close(fd)


def _is_id(value: str) -> bool:
    return len(value) == 64 and set(value) <= _HEX


def _ref_filename(name: str) -> str:
    if not name or name in (".", ".."):
        raise LayerStoreError(f"bad ref name {name!r}")
    encoded = quote(name, safe="-_.:@+=,")
    if len(encoded) > 240:
        raise LayerStoreError(f"ref name too long ({len(encoded)} bytes encoded): {name[:60]}...")
    return encoded


def _create(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def _finish_file(fd: int, entry: builtins.list[Any], owner: tuple[int, int] | None) -> None:
    """Owner, mode and mtime of an unpacked file, by descriptor; then close it. Set-id bits are
    never restored: a layer may come from what a sandbox wrote, and the node cache is readable
    by other users of the host."""
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, entry[2] & ~(stat.S_ISUID | stat.S_ISGID))
        os.utime(fd, (entry[4], entry[4]))
    finally:
        os.close(fd)


def _run_parallel(fn: Callable[[Any], None], items: Iterable[Any], workers: int) -> None:
    """Run fn over items on a thread pool; the first error cancels what has not started."""
    items = builtins.list(items)
    if workers <= 1 or len(items) <= 1:
        for item in items:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: list[Future[None]] = [pool.submit(fn, item) for item in items]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        for fut in futures:
            if fut.done() and not fut.cancelled() and fut.exception() is not None:
                raise fut.exception()  # type: ignore[misc]


# -- the store ------------------------------------------------------------------------------


class LayerStore:
    """Content-addressed layers under `root` (a local or shared-filesystem directory).

    `level` is the zstd level of new blobs (10: tens of MB/s per core; decompression speed does
    not depend on it); `fsync` makes a published layer survive a machine crash, not just a process
    crash; `workers` threads hash, compress and decompress blobs (zstd releases the GIL)."""

    def __init__(
        self,
        root: Path,
        *,
        level: int = 10,
        small_file_bytes: int = SMALL_FILE_BYTES,
        fsync: bool = True,
        workers: int | None = None,
    ) -> None:
        self.root = Path(root)
        self.level = level
        self.small_file_bytes = small_file_bytes
        self.fsync = fsync
        # Unpacking many small files waits on the filesystem more than on the CPU.
        self.workers = workers or 8
        for sub in ("blobs", "layers", "refs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

    # paths

    def blob_path(self, sha: str) -> Path:
        return self.root / "blobs" / sha[:2] / f"{sha}.zst"

    def manifest_path(self, layer_id: str) -> Path:
        return self.root / "layers" / f"{layer_id}.manifest.zst"

    def _info_path(self, layer_id: str) -> Path:
        return self.root / "layers" / f"{layer_id}.json"

    def _tmp(self, kind: str) -> Path:
        host = socket.gethostname().replace(".", "_")[:40] or "host"
        return self.root / "tmp" / f"{host}.{os.getpid()}.{secrets.token_hex(8)}.{kind}"

    def _write_atomic(self, path: Path, data: bytes, *, mode: int = 0o444) -> None:
        tmp = self._tmp(path.name)
        try:
            with open(tmp, "wb") as fh:
                fh.write(data)
                if self.fsync:
                    fh.flush()
                    os.fsync(fh.fileno())
            os.chmod(tmp, mode)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    # publish

    def publish(
        self, directory: Path, *, meta: dict[str, Any] | None = None, verify_existing: bool = False
    ) -> LayerRef:
        """Store the tree at `directory` and return its layer. Safe to run concurrently with other
        publishes and `gc`, from any machine; a crash leaves no visible layer.

        The tree is read as it is: symlinks are stored as links (never entered or followed),
        and only regular files, directories and overlay whiteouts are accepted.
        `verify_existing` re-hashes every blob it would reuse and rewrites the corrupt ones
        (a forced rebuild repairs the store instead of pointing at the same bad blob again)."""
        scan = _scan(Path(directory), self.small_file_bytes)
        _run_parallel(lambda job: self._store_job(job, verify_existing), scan.jobs, self.workers)

        blob_shas: list[str] = []
        index: dict[str, int] = {}
        for job in scan.jobs:
            i = index.setdefault(job.sha, len(blob_shas))
            if i == len(blob_shas):
                blob_shas.append(job.sha)
            for entry in job.entries:
                entry.blob = i
        manifest = _canonical(scan, blob_shas)
        layer_id = hashlib.sha256(manifest).hexdigest()
        stored = sum(job.added for job in scan.jobs)
        now = dt.datetime.now(dt.timezone.utc)

        mpath = self.manifest_path(layer_id)
        existing = self._read_info(layer_id) if mpath.exists() else None
        if existing is not None and not self._manifest_ok(layer_id):
            existing = None  # a corrupt manifest under this id: written anew below
        if existing is not None:
            if meta is not None:
                self.set_meta(layer_id, meta)
            with contextlib.suppress(OSError):
                os.utime(mpath)  # fresh for gc's grace, like reused blobs
            update = {"stored_bytes": stored, "meta": meta or existing.meta}
            return existing.model_copy(update=update)

        if self.fsync:
            for d in {self.blob_path(j.sha).parent for j in scan.jobs if j.added}:
                _fsync_dir(d)
        compressed = _compressor(self.level, 0).compress(manifest)
        info = {
            "id": layer_id,
            "size": scan.size,
            "files": scan.files,
            "stored_bytes": stored + len(compressed),
            "created": now.isoformat(),
            "meta": meta,
        }
        info_bytes = json.dumps(info, sort_keys=True).encode()
        # Info first, manifest last: the manifest's rename is the moment the layer exists.
        self._write_atomic(self._info_path(layer_id), info_bytes, mode=0o644)
        self._write_atomic(mpath, compressed)
        if self.fsync:
            _fsync_dir(mpath.parent)
        # A gc that ran while we published may have removed a blob we found and reused (if the
        # publish outlasted gc's grace): put any such blob back from the source tree.
        missing = [job for job in scan.jobs if not self.blob_path(job.sha).exists()]
        if missing:
            logger.warning(
                "layer %s: %d blobs vanished during publish; restoring", layer_id, len(missing)
            )
            _run_parallel(self._store_job, missing, self.workers)
        logger.info(
            "published layer %s: %d files, %d bytes, stored %d",
            layer_id,
            scan.files,
            scan.size,
            info["stored_bytes"],
        )
        return LayerRef.model_validate(info)

    def _manifest_ok(self, layer_id: str) -> bool:
        try:
            self.manifest(layer_id)
            return True
        except LayerStoreError:  # missing or corrupt
            return False

    def _store_job(self, job: _BlobJob, verify: bool = False) -> None:
        if len(job.sources) == 1 and job.sources[0][1] >= self.small_file_bytes:
            self._store_file(job, verify)
        else:
            self._store_pack(job, verify)

    def _store_pack(self, job: _BlobJob, verify: bool = False) -> None:
        data = _read_pack(job.sources)
        job.sha = hashlib.sha256(data).hexdigest()
        if self._reuse(job.sha, verify):
            return
        job.added = self._put(
            job.sha, lambda fh: fh.write(_compressor(self.level, 0).compress(data))
        )

    def _store_file(self, job: _BlobJob, verify: bool = False) -> None:
        path, size = job.sources[0]
        job.sha = _sha256_file(path)
        if self._reuse(job.sha, verify):
            return
        threads = -1 if size >= MULTITHREAD_BYTES else 0

        def write(out: Any) -> None:
            with _open_source(path) as src:
                reader = _HashingReader(src)
                try:
                    _compressor(self.level, threads).copy_stream(
                        cast(IO[bytes], reader), out, size=size
                    )
                except zstandard.ZstdError as exc:
                    raise LayerStoreError(f"{path} changed while it was being published") from exc
            if reader.hash.hexdigest() != job.sha:
                raise LayerStoreError(f"{path} changed while it was being published")

        job.added = self._put(job.sha, write)

    def _reuse(self, sha: str, verify: bool = False) -> bool:
        """True if the blob is already stored (and, with `verify`, holds what its name says);
        then mark it fresh so gc's grace covers it. False: the caller (re)writes it."""
        path = self.blob_path(sha)
        try:
            os.utime(path)
        except FileNotFoundError:
            return False
        except PermissionError:
            if not path.exists():
                return False  # another user's blob: still good to reference
        if verify and _blob_hash(path)[0] != sha:
            logger.warning("blob %s is corrupt; storing it anew", path)
            return False
        return True

    def _put(self, sha: str, write: Callable[[Any], Any]) -> int:
        final = self.blob_path(sha)
        final.parent.mkdir(exist_ok=True)
        tmp = self._tmp("blob")
        try:
            with open(tmp, "wb") as fh:
                write(fh)
                fh.flush()
                if self.fsync:
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

    # reading layers

    def exists(self, layer_id: str) -> bool:
        return _is_id(layer_id) and self.manifest_path(layer_id).exists()

    def manifest(self, layer_id: str) -> dict[str, Any]:
        """The layer's manifest, verified against its id."""
        if not _is_id(layer_id):
            raise LayerNotFoundError(f"{layer_id!r} is not a layer id")
        path = self.manifest_path(layer_id)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise LayerNotFoundError(f"no layer {layer_id} in {self.root}") from None
        try:
            data = _decompressor().decompress(raw)
        except zstandard.ZstdError as exc:
            raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
        if hashlib.sha256(data).hexdigest() != layer_id:
            raise CorruptLayerError(layer_id, path, "sha256 mismatch")
        doc: dict[str, Any] = json.loads(data)
        if doc.get("format") != FORMAT:
            raise LayerStoreError(f"layer {layer_id}: unknown manifest format {doc.get('format')}")
        return doc

    def _read_info(self, layer_id: str) -> LayerRef | None:
        try:
            return LayerRef.model_validate_json(self._info_path(layer_id).read_bytes())
        except (OSError, ValueError):
            return None

    def info(self, layer_id: str) -> LayerRef:
        ref = self._read_info(layer_id)
        if ref is not None and self.exists(layer_id):
            return ref
        # No info file (lost, or hand-deleted): rebuild what the manifest tells.
        doc = self.manifest(layer_id)
        files = [e for e in doc["entries"] if e[0] == "f"]
        mtime = self.manifest_path(layer_id).stat().st_mtime
        return LayerRef(
            id=layer_id,
            size=sum(e[3] for e in files),
            stored_bytes=0,
            files=len(files),
            created=dt.datetime.fromtimestamp(mtime, dt.timezone.utc),
        )

    def meta(self, layer_id: str) -> dict[str, Any] | None:
        return self.info(layer_id).meta

    def set_meta(self, layer_id: str, meta: dict[str, Any] | None) -> None:
        """Replace the layer's meta (atomically; concurrent setters: the last one wins)."""
        ref = self.info(layer_id)
        data = ref.model_copy(update={"meta": meta}).model_dump_json().encode()
        self._write_atomic(self._info_path(layer_id), data, mode=0o644)

    def list(self) -> builtins.list[LayerRef]:
        out = []
        for layer_id in self._layer_ids():
            with contextlib.suppress(LayerNotFoundError):  # removed by a concurrent gc
                out.append(self.info(layer_id))
        return sorted(out, key=lambda r: r.created)

    def _layer_ids(self) -> builtins.list[str]:
        suffix = ".manifest.zst"
        return [
            name[: -len(suffix)]
            for name in os.listdir(self.root / "layers")
            if name.endswith(suffix) and _is_id(name[: -len(suffix)])
        ]

    # unpack

    def unpack(
        self,
        layer_id: str,
        dest: Path,
        *,
        owner: tuple[int, int] | None = None,
        pool: FilePool | None = None,
    ) -> Path:
        """Recreate the layer's tree at `dest`, which must not exist. Every blob is verified; on
        any error `dest` stays absent. `owner` (uid, gid) is given to every entry. With a
        `pool` (on dest's filesystem), files are hard links to the pool's copies, written there
        only when the pool lacks them (see pool.py)."""
        dest = Path(dest)
        if os.path.lexists(dest):
            raise FileExistsError(errno.EEXIST, "unpack destination exists", str(dest))
        doc = self.manifest(layer_id)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.unpack-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            self._unpack_into(layer_id, doc, tmp, owner, pool)
            os.rename(tmp, dest)
        except BaseException:
            remove_tree(str(tmp))
            raise
        return dest

    def _unpack_into(
        self,
        layer_id: str,
        doc: dict[str, Any],
        tmp: Path,
        owner: tuple[int, int] | None,
        pool: FilePool | None = None,
    ) -> None:
        shas: list[str] = doc["blobs"]
        base = os.fspath(tmp)
        dirs: list[tuple[str, int]] = []
        by_blob: dict[int, list[list[Any]]] = {}
        files: list[list[Any]] = []
        links: list[list[Any]] = []
        whiteouts: list[str] = []
        for e in doc["entries"]:
            kind, rel = e[0], e[1]
            if rel != "." and (rel.startswith("/") or ".." in rel.split("/")):
                raise CorruptLayerError(layer_id, self.manifest_path(layer_id), f"bad path {rel}")
            path = base if rel == "." else os.path.join(base, rel)
            if kind == "d":
                os.mkdir(path, 0o700)
                if len(e) > 3 and e[3] == "opaque":
                    _mark_opaque(path)
                dirs.append((path, e[2]))
            elif kind == "l":
                links.append(e)
            elif kind == "w":
                # Unprivileged users may create whiteouts too (Linux >= 5.8).
                os.mknod(path, stat.S_IFCHR, os.makedev(0, 0))
                whiteouts.append(path)
            else:
                files.append(e)
                by_blob.setdefault(e[5], []).append(e)

        def write_blob(item: tuple[int, list[list[Any]]]) -> None:
            i, entries = item
            if i < 0:  # empty files
                for e in entries:
                    _finish_file(_create(os.path.join(base, e[1])), e, owner)
                return
            self._write_blob(layer_id, shas[i], entries, base, owner, pool)

        # Each file is created, filled and given its owner, mode and mtime by one worker, by
        # descriptor: per-file system calls dominate unpacking, so none are left for later.
        _run_parallel(write_blob, by_blob.items(), self.workers)
        for e in links:
            os.symlink(e[2], os.path.join(base, e[1]))
        if owner is not None:
            for e in links:
                os.lchown(os.path.join(base, e[1]), *owner)
            for path in whiteouts:
                os.lchown(path, *owner)
        # Directories last, deepest first: a read-only directory must be filled before its mode.
        for path, mode in reversed(dirs):
            if owner is not None:
                os.chown(path, *owner)
            os.chmod(path, mode)

    def _write_blob(
        self,
        layer_id: str,
        sha: str,
        entries: builtins.list[builtins.list[Any]],
        base: str,
        owner: tuple[int, int] | None,
        pool: FilePool | None = None,
    ) -> None:
        path = self.blob_path(sha)
        if all(e[6] == 0 and e[3] == entries[0][3] for e in entries):
            # The blob is one file's content (a layer may hold that file several times): stream
            # it, verifying as it goes, rather than holding a large file in memory.
            first = entries[0]

            def make(fd: int, e: builtins.list[Any] = first) -> None:
                self._stream_blob(layer_id, sha, e, fd, owner)

            if pool is not None:
                for e in entries:
                    name = pool_name(sha, e[2], e[4], owner)
                    pool.link_into(name, os.path.join(base, e[1]), functools.partial(make, e=e))
                return
            make(_create(os.path.join(base, first[1])))
            for other in entries[1:]:
                shutil.copyfile(os.path.join(base, first[1]), os.path.join(base, other[1]))
                _finish_file(os.open(os.path.join(base, other[1]), os.O_RDONLY), other, owner)
            return
        loaded: builtins.list[bytes] = []  # the pack, read only if the pool lacks a file of it

        def fill(fd: int, e: builtins.list[Any]) -> None:
            try:
                if not loaded:
                    loaded.append(self._read_blob(layer_id, sha))
                chunk = loaded[0][e[6] : e[6] + e[3]]
                if len(chunk) != e[3]:
                    raise CorruptLayerError(layer_id, path, f"pack too short for {e[1]}")
                view = memoryview(chunk)
                while view:
                    view = view[os.write(fd, view) :]
            except BaseException:
                os.close(fd)
                raise
            _finish_file(fd, e, owner)

        for e in entries:
            dest = os.path.join(base, e[1])
            if pool is None:
                fill(_create(dest), e)
            else:
                name = pool_name(f"{sha}.{e[6]}.{e[3]}", e[2], e[4], owner)
                pool.link_into(name, dest, functools.partial(fill, e=e))

    def _stream_blob(
        self,
        layer_id: str,
        sha: str,
        e: builtins.list[Any],
        fd: int,
        owner: tuple[int, int] | None,
    ) -> None:
        """Decompress the one-file blob `sha` into `fd`, verifying it, then finish the file
        (owner, mode, mtime) and close `fd`."""
        path = self.blob_path(sha)
        h = hashlib.sha256()
        written = 0
        try:
            with open(path, "rb") as src, open(fd, "wb", closefd=False) as out:
                reader = _decompressor().stream_reader(src, read_size=_CHUNK)
                while chunk := reader.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
                    written += len(chunk)
        except FileNotFoundError:
            os.close(fd)
            raise CorruptLayerError(layer_id, path, "blob missing") from None
        except zstandard.ZstdError as exc:
            os.close(fd)
            raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
        except BaseException:
            os.close(fd)
            raise
        if written != e[3]:
            os.close(fd)
            raise CorruptLayerError(layer_id, path, f"{written} bytes, expected {e[3]}")
        if h.hexdigest() != sha:
            os.close(fd)
            raise CorruptLayerError(layer_id, path, "sha256 mismatch")
        _finish_file(fd, e, owner)

    def read_blob(self, sha: str) -> bytes:
        """A blob's bytes, verified. Raises CorruptLayerError when it is missing or corrupt."""
        return self._read_blob("(any)", sha)

    def _read_blob(self, layer_id: str, sha: str) -> bytes:
        path = self.blob_path(sha)
        try:
            raw = path.read_bytes()
            data = _decompressor().decompress(raw)
        except FileNotFoundError:
            raise CorruptLayerError(layer_id, path, "blob missing") from None
        except zstandard.ZstdError as exc:
            raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
        if hashlib.sha256(data).hexdigest() != sha:
            raise CorruptLayerError(layer_id, path, "sha256 mismatch")
        return data

    # named refs

    def tag(self, name: str, layer_id: str) -> None:
        """Point `name` at a layer (atomically replacing what it pointed at)."""
        if not self.exists(layer_id):
            raise LayerNotFoundError(f"no layer {layer_id} in {self.root}")
        self._write_atomic(self.root / "refs" / _ref_filename(name), layer_id.encode(), mode=0o644)

    def untag(self, name: str) -> bool:
        try:
            os.unlink(self.root / "refs" / _ref_filename(name))
            return True
        except FileNotFoundError:
            return False

    def resolve(self, name: str) -> str | None:
        """The layer id `name` points at, or None (no such ref, or its layer is gone)."""
        try:
            value = (self.root / "refs" / _ref_filename(name)).read_text().strip()
        except FileNotFoundError:
            return None
        return value if self.exists(value) else None

    def refs(self) -> dict[str, str]:
        out = {}
        for fname in os.listdir(self.root / "refs"):
            with contextlib.suppress(OSError):
                out[unquote(fname)] = (self.root / "refs" / fname).read_text().strip()
        return out

    # recorded build failures

    def _failure_path(self, name: str) -> Path:
        return self.root / "failures" / f"{_ref_filename(name)}.json"

    def record_failure(self, name: str, record: dict[str, Any]) -> None:
        """Record why building `name` failed (atomically replacing an earlier record), so that
        whoever asks for it next, in any process sharing the store, learns why at once."""
        (self.root / "failures").mkdir(exist_ok=True)
        data = json.dumps(record, sort_keys=True).encode()
        self._write_atomic(self._failure_path(name), data, mode=0o644)

    def failure(self, name: str) -> dict[str, Any] | None:
        """The recorded failure of `name`, or None (none, or unreadable)."""
        try:
            record = json.loads(self._failure_path(name).read_bytes())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def clear_failure(self, name: str) -> bool:
        try:
            os.unlink(self._failure_path(name))
            return True
        except FileNotFoundError:
            return False

    # accounting and maintenance

    def _blob_files(self) -> Iterator[tuple[str, Path]]:
        blobs = self.root / "blobs"
        for sub in sorted(os.listdir(blobs)):
            subdir = blobs / sub
            if not subdir.is_dir():
                continue
            for name in os.listdir(subdir):
                if name.endswith(".zst") and _is_id(name[:-4]):
                    yield name[:-4], subdir / name

    def du(self) -> dict[str, Any]:
        """Stored bytes against logical bytes: how well layers dedupe and compress."""
        blob_bytes = blobs = 0
        for _sha, path in self._blob_files():
            with contextlib.suppress(FileNotFoundError):
                blob_bytes += path.stat().st_size
                blobs += 1
        layer_bytes = 0
        for name in os.listdir(self.root / "layers"):
            with contextlib.suppress(FileNotFoundError):
                layer_bytes += (self.root / "layers" / name).stat().st_size
        layers = self.list()
        logical = sum(r.size for r in layers)
        stored = blob_bytes + layer_bytes
        return {
            "layers": len(layers),
            "unique_blobs": blobs,
            "blob_bytes": blob_bytes,
            "manifest_bytes": layer_bytes,
            "stored_bytes": stored,
            "logical_bytes": logical,
            "ratio": round(logical / stored, 3) if stored else None,
        }

    def verify(self, *, repair: bool = False) -> builtins.list[str]:
        """Re-hash every manifest and blob; return one line per problem (empty: all good).
        With repair, see `check`."""
        return self.check(repair=repair).problems

    def check(self, *, repair: bool = False) -> VerifyReport:
        """Re-hash every manifest and blob. With repair, corrupt blobs and manifests move to
        quarantine/ (so that a later publish stores them anew) and the refs naming a layer
        that is broken (a blob or its manifest corrupt or missing) are dropped, so that the
        next build rebuilds it instead of finding it "cached" and failing to unpack it."""
        report = VerifyReport()
        problems = report.problems
        broken: set[str] = set()
        referenced: dict[str, builtins.list[str]] = {}
        for layer_id in sorted(self._layer_ids()):
            try:
                doc = self.manifest(layer_id)
            except LayerNotFoundError:
                continue
            except LayerStoreError as exc:
                line = str(exc)
                broken.add(layer_id)
                if repair:
                    line += self._quarantine(self.manifest_path(layer_id))
                problems.append(line)
                continue
            for sha in doc["blobs"]:
                referenced.setdefault(sha, []).append(layer_id)
        present = dict(self._blob_files())
        for sha in sorted(set(referenced) - set(present)):
            broken.update(referenced[sha])
            problems.append(
                f"{self.blob_path(sha)}: missing (used by layers {', '.join(referenced[sha])})"
            )
        lock = threading.Lock()

        def check(item: tuple[str, Path]) -> None:
            sha, path = item
            got, why = _blob_hash(path)
            if got is None and why == "missing":
                return  # removed by a concurrent gc
            if got == sha:
                return
            users = referenced.get(sha, [])
            line = f"{path}: corrupt ({why}); used by layers {', '.join(users) or '(none)'}"
            if repair:
                line += self._quarantine(path)
            with lock:
                broken.update(users)
                problems.append(line)

        _run_parallel(check, sorted(present.items()), self.workers)
        report.broken_layers = sorted(broken)
        if repair and broken:
            for name, layer_id in sorted(self.refs().items()):
                if layer_id in broken and self._untag_if(name, layer_id):
                    report.dropped_refs.append(name)
                    problems.append(f"ref {name}: dropped (layer {layer_id} is broken)")
        return report

    def _quarantine(self, path: Path) -> str:
        qdir = self.root / "quarantine"
        qdir.mkdir(exist_ok=True)
        target = qdir / f"{path.name}.{int(time.time())}.{secrets.token_hex(2)}"
        try:
            os.rename(path, target)
        except FileNotFoundError:
            return ""
        return f"; moved to {target}"

    def _untag_if(self, name: str, layer_id: str) -> bool:
        """Remove ref `name` if it still names `layer_id` (a build may have just re-pointed it
        at a good layer: that one stays)."""
        path = self.root / "refs" / _ref_filename(name)
        try:
            if path.read_text().strip() != layer_id:
                return False
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False

    def gc(self, keep: set[str] | None = None, *, grace: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove temp files older than `grace` seconds, then blobs that no layer references.

        `keep=None` keeps every layer; otherwise layers outside `keep` are removed too, except
        those a ref names and those younger than `grace` (a publisher may be about to tag them).
        A blob is removed only when unreferenced *and* untouched for `grace`: a publish touches
        every blob it reuses, so a blob a concurrent publish is about to reference is kept."""
        report = GcReport()
        cutoff = time.time() - grace

        def remove_if_old(path: Path) -> int:
            try:
                st = path.lstat()
                if st.st_mtime >= cutoff:
                    return -1
                if stat.S_ISDIR(st.st_mode):
                    remove_tree(str(path))
                else:
                    path.unlink()
                return st.st_size
            except FileNotFoundError:
                return -1

        for path in (self.root / "tmp").iterdir():
            freed = remove_if_old(path)
            if freed >= 0:
                report.removed_temps += 1
                report.freed_bytes += freed

        ids = self._layer_ids()
        if keep is not None:
            protected = set(keep) | set(self.refs().values())
            for layer_id in ids:
                if layer_id in protected:
                    continue
                freed = remove_if_old(self.manifest_path(layer_id))
                if freed >= 0:
                    report.removed_layers.append(layer_id)
                    report.freed_bytes += freed
                    with contextlib.suppress(FileNotFoundError):
                        report.freed_bytes += self._info_path(layer_id).stat().st_size
                        self._info_path(layer_id).unlink()
        # Orphan info files (a publish crashed between info and manifest).
        for name in os.listdir(self.root / "layers"):
            if name.endswith(".json") and not self.manifest_path(name[:-5]).exists():
                freed = remove_if_old(self.root / "layers" / name)
                if freed >= 0:
                    report.removed_temps += 1
                    report.freed_bytes += freed

        referenced: set[str] = set()
        for layer_id in self._layer_ids():
            try:
                referenced.update(self.manifest(layer_id)["blobs"])
            except LayerNotFoundError:
                continue
            except LayerStoreError as exc:
                # Cannot tell what this layer needs: deleting blobs now could destroy its data.
                report.problems.append(f"{exc}; blobs were not collected")
                return report
        for sha, path in builtins.list(self._blob_files()):
            if sha in referenced:
                continue
            freed = remove_if_old(path)  # stat right before unlink: the window is tiny
            if freed >= 0:
                report.removed_blobs += 1
                report.freed_bytes += freed
        return report
