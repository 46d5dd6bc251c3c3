"""A content-addressed store of layers: directory trees built once, stored small, shared.

The store is a plain directory, local or on a shared filesystem. It never uses a database or a
long-held lock: every file appears by an atomic rename of a finished temp file, so any number of
writers, on any number of machines, may publish at once, and a writer killed midway leaves only
temp files that `gc` removes. The one lock is a layer's metadata lock (locks/<id>, an flock held
for one read-modify-write of its info file: `update_meta`).

Layout of `root`:

    blobs/ab/<sha256>.zst        file contents, zstd; the name is the sha256 of the *uncompressed*
                                 bytes. A blob holds one large file, or a pack: the concatenated
                                 small files of a run of one directory.
    layers/<id>.manifest.zst     the layer: canonical JSON of its entries, zstd (manifest.py).
                                 id = sha256 of the uncompressed JSON. Renamed in last: a layer
                                 exists iff this does.
    layers/<id>.json             what a publish measured (size, files, stored_bytes, created) and
                                 the caller's `meta`; replaced atomically when meta changes.
    refs/<name>                  a named ref: the layer id, replaced atomically by `tag`.
    failures/<name>.json         why building a ref failed (`record_failure`).
    locks/<id>                   flock target of the layer's metadata (`update_meta`).
    tmp/                         temp files of publishes in flight (or crashed ones, for `gc`).
    quarantine/                  corrupt blobs that `verify(repair=True)` moved aside.

Small files are packed by directory so that file counts stay manageable (a venv holds tens of
thousands of files) while packs stay content-addressed and so dedupe across layers: the small files
(< `small_file_bytes`, 16 KiB by default) of one directory, in name order, are cut into runs at
names whose hash ends a run (about 16 files a run, at most 1 MiB). Boundaries depend on names only,
so a file added or changed re-stores its own run, not the directory, and an identical package
directory in two venvs yields identical packs. A file of 256 bytes or more that is also a blob
object of a git pack in the same tree (a checkout beside its history) gets no blob: its entry
points at the object, proven equal when publishing and checked against its sha256 when unpacking.

Owners are not stored (`unpack` sets them); modes, symlink targets and file mtimes (whole seconds,
which keeps .pyc caches valid) are. Hard links are stored as copies (their content once). Overlay
whiteouts and opaque directories are kept, so that an overlay's upper directory is a valid layer.

`gc` removes a blob only when no layer references it *and* it is older than a grace period (one
hour by default); a publish touches every blob it reuses, and checks after its manifest landed that
no blob went missing meanwhile (restoring any from the source tree).

Where the parts are: ids.py (what a layer id and a ref name may be), manifest.py (the manifest
format), publish.py (reading a tree, storing its blobs), blobs.py (zstd, hashing, verified reads),
gitpack.py (files kept as objects of a git pack of the same tree), unpack.py (recreating a
tree), maintenance.py (check, gc, du), layout.py (paths, atomic writes, the metadata lock),
errors.py. This module is the store's API.

The API is blocking (it is file I/O); from async code run it in a thread.
"""

from __future__ import annotations

import builtins
import contextlib
import copy
import datetime as dt
import hashlib
import json
import logging
import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import zstandard
from pydantic import BaseModel, ConfigDict

from minisandbox.layers import blobs
from minisandbox.layers.errors import (
    CorruptLayerError,
    LayerIdError,
    LayerMetaError,
    LayerNotFoundError,
    LayerStoreError,
    ManifestFormatError,
    RefNameError,
    UnpackDestinationExistsError,
)
from minisandbox.layers.filepool import FilePool
from minisandbox.layers.gitpack import GitPackError, PackIndex, PackReader
from minisandbox.layers.ids import check_layer_id, is_layer_id, ref_name
from minisandbox.layers.layout import StoreLayout
from minisandbox.layers.maintenance import (
    GC_GRACE_SECONDS,
    GcReport,
    VerifyReport,
    check_store,
    collect_garbage,
    disk_usage,
)
from minisandbox.layers.manifest import FORMAT, Manifest, check_document, check_format
from minisandbox.layers.parallel import run_parallel
from minisandbox.layers.publish import SMALL_FILE_BYTES, BlobWriter, Scan, scan_tree
from minisandbox.layers.unpack import unpack_layer
from minisandbox.utils.safefs import discard_tree

__all__ = [
    "FORMAT",
    "GC_GRACE_SECONDS",
    "SMALL_FILE_BYTES",
    "CorruptLayerError",
    "GcReport",
    "LayerIdError",
    "LayerNotFoundError",
    "LayerRef",
    "LayerStore",
    "LayerStoreError",
    "RefNameError",
    "VerifyReport",
]

logger = logging.getLogger(__name__)


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


class LayerStore(StoreLayout):
    """Content-addressed layers under `root` (a local or shared-filesystem directory).

    `level` is the zstd level of new blobs (10: tens of MB/s per core; decompression speed does
    not depend on it); `fsync` makes a published layer survive a machine crash, not just a process
    crash; `workers` threads hash, compress and decompress blobs (zstd releases the GIL;
    default: one per CPU, at most 8)."""

    def __init__(
        self,
        root: Path,
        *,
        level: int = 10,
        small_file_bytes: int = SMALL_FILE_BYTES,
        fsync: bool = True,
        workers: int | None = None,
    ) -> None:
        super().__init__(root, fsync=fsync)
        self.level = level
        self.small_file_bytes = small_file_bytes
        # One thread per CPU this process may use (at most 8): the per-file system calls of an
        # unpack run on the CPU, and more threads than CPUs only contend for the directories'
        # locks (a third more CPU time on 2 cores with 8 threads, and no faster).
        self.workers = workers or min(8, len(os.sched_getaffinity(0)))
        for sub in ("blobs", "layers", "refs", "tmp"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)

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
        scan = scan_tree(Path(directory), self.small_file_bytes)
        writer = BlobWriter(self, level=self.level, small_file_bytes=self.small_file_bytes)
        run_parallel(lambda job: writer.store(job, verify_existing), scan.jobs, self.workers)
        manifest = scan.manifest().to_bytes()
        layer_id = hashlib.sha256(manifest).hexdigest()
        stored = sum(job.added for job in scan.jobs)
        # Under the metadata lock: an `update_meta` of this layer (published meanwhile by
        # another writer) is never overwritten by this publish's info.
        with self.meta_lock(layer_id):
            existing = self._read_info(layer_id) if self.manifest_path(layer_id).exists() else None
            if existing is not None and not self._manifest_ok(layer_id):
                existing = None  # a corrupt manifest under this id: written anew below
            if existing is not None:
                return self._republished(existing, meta, stored)
            ref = self._write_layer(layer_id, manifest, scan, stored, meta)
        # A gc that ran while we published may have removed a blob we found and reused (if the
        # publish outlasted gc's grace): put any such blob back from the source tree.
        missing = [job for job in scan.jobs if not self.blob_path(job.sha).exists()]
        if missing:
            logger.warning(
                "layer %s: %d blobs vanished during publish; restoring", layer_id, len(missing)
            )
            run_parallel(writer.store, missing, self.workers)
        logger.info(
            "published layer %s: %d files, %d bytes, stored %d",
            layer_id,
            ref.files,
            ref.size,
            ref.stored_bytes,
        )
        return ref

    def _republished(
        self, existing: LayerRef, meta: dict[str, Any] | None, stored: int
    ) -> LayerRef:
        """An identical layer is there already: its meta becomes `meta` (if given)."""
        if meta is not None:
            self._write_info(existing.model_copy(update={"meta": meta}))
        with contextlib.suppress(OSError):
            os.utime(self.manifest_path(existing.id))  # fresh for gc's grace, like reused blobs
        return existing.model_copy(update={"stored_bytes": stored, "meta": meta or existing.meta})

    def _write_layer(
        self, layer_id: str, manifest: bytes, scan: Scan, stored: int, meta: dict[str, Any] | None
    ) -> LayerRef:
        """Write a new layer's info, then its manifest: the manifest's rename is the moment the
        layer exists."""
        if self.fsync:
            for d in {self.blob_path(j.sha).parent for j in scan.jobs if j.added}:
                blobs.fsync_dir(d)
        compressed = blobs.compressor(self.level, 0).compress(manifest)
        info = {
            "id": layer_id,
            "size": scan.size,
            "files": scan.files,
            "stored_bytes": stored + len(compressed),
            "created": dt.datetime.now(dt.timezone.utc).isoformat(),
            "meta": meta,
        }
        self.write_atomic(
            self.info_path(layer_id), json.dumps(info, sort_keys=True).encode(), mode=0o644
        )
        mpath = self.manifest_path(layer_id)
        self.write_atomic(mpath, compressed)
        if self.fsync:
            blobs.fsync_dir(mpath.parent)
        return LayerRef.model_validate(info)

    def _manifest_ok(self, layer_id: str) -> bool:
        try:
            self.manifest(layer_id)
            return True
        except LayerStoreError:  # missing or corrupt
            return False

    def identity(self) -> str:
        """This store's random name (`<root>/id`, made by the first caller): whoever reads the
        same name sees the same store, whatever path it has there."""
        path = self.root / "id"
        with contextlib.suppress(FileNotFoundError):
            return path.read_text().strip()
        tmp = self.tmp_path("id")
        tmp.write_text(secrets.token_hex(16) + "\n")
        with contextlib.suppress(FileExistsError):  # another caller's came first: use it
            os.link(tmp, path)
        tmp.unlink()
        return path.read_text().strip()

    # reading layers

    def exists(self, layer_id: str) -> bool:
        return is_layer_id(layer_id) and self.manifest_path(layer_id).exists()

    def manifest(self, layer_id: str) -> dict[str, Any]:
        """The layer's manifest as stored (JSON: see manifest.py), verified against its id.
        `read_manifest` gives it with typed entries."""
        path = self.manifest_path(check_layer_id(layer_id))
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise LayerNotFoundError(f"no layer {layer_id} in {self.root}") from None
        try:
            data = blobs.decompressor().decompress(raw)
        except zstandard.ZstdError as exc:
            raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
        if hashlib.sha256(data).hexdigest() != layer_id:
            raise CorruptLayerError(layer_id, path, "sha256 mismatch")
        try:
            doc = json.loads(data)
        except ValueError:
            raise CorruptLayerError(layer_id, path, "not JSON") from None
        try:
            check_format(doc)  # a format this version does not read
        except ManifestFormatError as exc:
            raise ManifestFormatError(f"layer {layer_id}: {exc}") from None
        try:
            return check_document(doc)
        except ManifestFormatError as exc:  # the right hash, the wrong content
            raise CorruptLayerError(layer_id, path, str(exc)) from None

    def read_manifest(self, layer_id: str) -> Manifest:
        """The layer's manifest with every row read into a ManifestEntry (and checked)."""
        doc = self.manifest(layer_id)
        try:
            return Manifest.from_document(doc)
        except ManifestFormatError as exc:  # the format was checked: a row is bad
            raise CorruptLayerError(layer_id, self.manifest_path(layer_id), str(exc)) from None

    def _read_info(self, layer_id: str) -> LayerRef | None:
        try:
            return LayerRef.model_validate_json(self.info_path(layer_id).read_bytes())
        except (OSError, ValueError):
            return None

    def info(self, layer_id: str) -> LayerRef:
        ref = self._read_info(check_layer_id(layer_id))
        if ref is not None and self.exists(layer_id):
            return ref
        # No info file (lost, or hand-deleted): rebuild what the manifest tells.
        files = self.read_manifest(layer_id).files()
        mtime = self.manifest_path(layer_id).stat().st_mtime
        return LayerRef(
            id=layer_id,
            size=sum(e.size for e in files),
            stored_bytes=0,
            files=len(files),
            created=dt.datetime.fromtimestamp(mtime, dt.timezone.utc),
        )

    def meta(self, layer_id: str) -> dict[str, Any] | None:
        return self.info(layer_id).meta

    def update_meta(
        self, layer_id: str, update: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        """Read-modify-write of the layer's meta under its metadata lock (see `meta_lock`):
        `update` gets a copy of the current meta (an empty dict when there is none) and returns
        the new one, which is written atomically and returned. Concurrent updates, from threads
        or processes sharing the store, apply one after the other: none is lost. `update` must
        be quick and must not itself read-modify-write this layer's meta (the lock does not
        nest: MetaLockHeldError). LayerNotFoundError when there is no such layer."""
        with self.meta_lock(layer_id):
            ref = self.info(layer_id)
            new = update(copy.deepcopy(ref.meta) if ref.meta is not None else {})
            if not isinstance(new, dict):
                raise LayerMetaError(
                    f"the update of layer {layer_id}'s meta returned a {type(new).__name__},"
                    " not a dict"
                )
            self._write_info(ref.model_copy(update={"meta": new}))
            return new

    def _write_info(self, ref: LayerRef) -> None:
        """Replace the info file; the caller holds the layer's metadata lock."""
        data = ref.model_dump_json().encode()
        self.write_atomic(self.info_path(ref.id), data, mode=0o644)

    def list(self) -> builtins.list[LayerRef]:
        out = []
        for layer_id in self.layer_ids():
            with contextlib.suppress(LayerNotFoundError):  # removed by a concurrent gc
                out.append(self.info(layer_id))
        return sorted(out, key=lambda r: r.created)

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
            raise UnpackDestinationExistsError(dest)
        manifest = self.read_manifest(layer_id)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.unpack-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            unpack_layer(
                self, layer_id, manifest, tmp, owner=owner, pool=pool, workers=self.workers
            )
            os.rename(tmp, dest)
        except BaseException:
            discard_tree(tmp)
            raise
        return dest

    def read_file(self, layer_id: str, path: str) -> bytes:
        """The bytes of the regular file at `path` in the layer ("/"-joined, relative), read
        from its blob (verified) without unpacking the layer.

        Raises:
            FileNotFoundError: the layer has no regular file there.
            CorruptLayerError: its manifest or blob is missing or corrupt.
        """
        manifest = self.read_manifest(layer_id)
        for entry in manifest.entries:
            if entry.path == path and entry.kind == "f" and entry.pack:
                pack = self.read_file(layer_id, entry.pack)
                index = self.read_file(layer_id, entry.pack.removesuffix(".pack") + ".idx")
                try:
                    reader = PackReader(pack, PackIndex(index))
                    return reader.file(entry.offset, entry.size, entry.content)
                except GitPackError as exc:
                    raise CorruptLayerError(
                        layer_id, self.manifest_path(layer_id), f"{path!r}: {exc}"
                    ) from None
            if entry.path == path and entry.kind == "f":
                if entry.blob < 0:
                    return b""
                sha = manifest.blobs[entry.blob]
                data = blobs.read_blob(self.blob_path(sha), sha, layer_id)
                found = data[entry.offset : entry.offset + entry.size]
                if len(found) != entry.size:
                    raise CorruptLayerError(
                        layer_id, self.blob_path(sha), f"{path!r} is cut short in its blob"
                    )
                return found
        raise FileNotFoundError(f"layer {layer_id} has no file {path!r}")

    def read_blob(self, sha: str) -> bytes:
        """A blob's bytes, verified. Raises CorruptLayerError when it is missing or corrupt."""
        return blobs.read_blob(self.blob_path(check_layer_id(sha)), sha, "(any)")

    # named refs

    def tag(self, name: str, layer_id: str) -> None:
        """Point `name` at a layer (atomically replacing what it pointed at)."""
        if not self.exists(layer_id):
            raise LayerNotFoundError(f"no layer {layer_id} in {self.root}")
        self.write_atomic(self.ref_path(name), layer_id.encode(), mode=0o644)

    def untag(self, name: str) -> bool:
        try:
            os.unlink(self.ref_path(name))
            return True
        except FileNotFoundError:
            return False

    def resolve(self, name: str) -> str | None:
        """The layer id `name` points at, or None (no such ref, or its layer is gone)."""
        try:
            value = self.ref_path(name).read_text().strip()
        except FileNotFoundError:
            return None
        return value if self.exists(value) else None

    def refs(self) -> dict[str, str]:
        out = {}
        for fname in os.listdir(self.root / "refs"):
            with contextlib.suppress(OSError):
                out[ref_name(fname)] = (self.root / "refs" / fname).read_text().strip()
        return out

    # recorded build failures

    def record_failure(self, name: str, record: dict[str, Any]) -> None:
        """Record why building `name` failed (atomically replacing an earlier record), so that
        whoever asks for it next, in any process sharing the store, learns why at once."""
        (self.root / "failures").mkdir(exist_ok=True)
        data = json.dumps(record, sort_keys=True).encode()
        self.write_atomic(self.failure_path(name), data, mode=0o644)

    def failure(self, name: str) -> dict[str, Any] | None:
        """The recorded failure of `name`, or None (none, or unreadable)."""
        try:
            record = json.loads(self.failure_path(name).read_bytes())
        except (OSError, ValueError):
            return None
        return record if isinstance(record, dict) else None

    def clear_failure(self, name: str) -> bool:
        try:
            os.unlink(self.failure_path(name))
            return True
        except FileNotFoundError:
            return False

    # accounting and maintenance (maintenance.py)

    def du(self) -> dict[str, Any]:
        """Stored bytes against logical bytes: how well layers dedupe and compress."""
        return disk_usage(self)

    def verify(self, *, repair: bool = False) -> builtins.list[str]:
        """Re-hash every manifest and blob; return one line per problem (empty: all good).
        With repair, see `check`."""
        return self.check(repair=repair).problems

    def check(self, *, repair: bool = False) -> VerifyReport:
        """Re-hash every manifest and blob. With repair, corrupt blobs and manifests move to
        quarantine/ (so that a later publish stores them anew) and the refs naming a layer
        that is broken (a blob or its manifest corrupt or missing) are dropped, so that the
        next build rebuilds it instead of finding it "cached" and failing to unpack it."""
        return check_store(self, repair=repair)

    def gc(self, keep: set[str] | None = None, *, grace: float = GC_GRACE_SECONDS) -> GcReport:
        """Remove temp files older than `grace` seconds, then blobs that no layer references.

        `keep=None` keeps every layer; otherwise layers outside `keep` are removed too, except
        those a ref names and those younger than `grace` (a publisher may be about to tag them).
        A blob is removed only when unreferenced *and* untouched for `grace`: a publish touches
        every blob it reuses, so a blob a concurrent publish is about to reference is kept."""
        return collect_garbage(self, keep, grace=grace)
