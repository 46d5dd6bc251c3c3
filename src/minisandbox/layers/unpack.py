"""Unpacking: recreating a layer's tree from its manifest and blobs, every blob verified.

The tree is built in a fresh directory that only this code writes to, in an order that keeps
every write inside it: directories first (mode 0700 until the end), then the files, each
created, filled and given its owner, mode and mtime through one descriptor (O_EXCL: never an
existing name; a file that is an object of a git pack of the layer after the pack, read back
from it and checked against the sha256 its row gives), then symlinks, last, so that no write
can pass through one; directory modes are set deepest first at the very end. Paths come from a
checked manifest (relative, no ".."). Set-id bits are never restored, nor write permission for
group or others: a layer's modes come from what a build sandbox made, and no other user of the
host may write to a layer's files (they are hard links of the node's pool: `unpacked_mode`).
"""

from __future__ import annotations

import contextlib
import functools
import mmap
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path

from minisandbox.layers.blobs import read_blob, stream_blob
from minisandbox.layers.errors import CorruptLayerError
from minisandbox.layers.filepool import FilePool, pool_name
from minisandbox.layers.gitpack import GitPackError, PackIndex, PackReader
from minisandbox.layers.layout import StoreLayout
from minisandbox.layers.manifest import (
    DIRECTORY,
    OPAQUE_XATTRS,
    SYMLINK,
    WHITEOUT,
    Manifest,
    ManifestEntry,
)
from minisandbox.layers.parallel import run_parallel


def create_file(path: str) -> int:
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def unpacked_mode(mode: int) -> int:
    """The mode a layer's file or directory is given: the layer's, without set-id bits and
    without write permission for group and others. A hostile install step may chmod 0666 or
    0777 what it made; on the host, the unpacked file is what every later sandbox of the node
    sees (and the pool links the same inode)."""
    return mode & ~(stat.S_ISUID | stat.S_ISGID | stat.S_IWGRP | stat.S_IWOTH)


def finish_file(fd: int, entry: ManifestEntry, owner: tuple[int, int] | None) -> None:
    """Owner, mode (`unpacked_mode`) and mtime of an unpacked file, by descriptor; then close
    it."""
    try:
        if owner is not None:
            os.fchown(fd, *owner)
        os.fchmod(fd, unpacked_mode(entry.mode))
        os.utime(fd, (entry.mtime, entry.mtime))
    finally:
        os.close(fd)


def _mark_opaque(path: str) -> None:
    os.setxattr(path, OPAQUE_XATTRS[0], b"y", follow_symlinks=False)
    if os.geteuid() == 0:
        with contextlib.suppress(OSError):
            os.setxattr(path, OPAQUE_XATTRS[1], b"y", follow_symlinks=False)


@dataclass
class _Skeleton:
    """What creating the directories and whiteouts left for later."""

    dirs: list[tuple[str, int]] = field(default_factory=list)  # (path, mode), parents first
    by_blob: dict[int, list[ManifestEntry]] = field(default_factory=dict)
    links: list[ManifestEntry] = field(default_factory=list)
    whiteouts: list[str] = field(default_factory=list)
    in_pack: dict[str, list[ManifestEntry]] = field(default_factory=dict)  # by pack path


@dataclass
class Unpacker:
    """Unpacks one layer (`layer_id`, `manifest`) of the store `layout` into `base`, a new
    directory; with `owner` (uid, gid) every entry is given it; with a `pool` (on base's
    filesystem) files are hard links to the pool's copies (see pool.py)."""

    layout: StoreLayout
    layer_id: str
    manifest: Manifest
    base: str
    owner: tuple[int, int] | None = None
    pool: FilePool | None = None
    workers: int = 1

    def run(self) -> None:
        skeleton = self._make_skeleton()
        # Each file is created, filled and given its owner, mode and mtime by one worker, by
        # descriptor: per-file system calls dominate unpacking, so none are left for later.
        run_parallel(self._write_group, skeleton.by_blob.items(), self.workers)
        # Then the files that are objects of a git pack, read from the pack just written.
        run_parallel(self._write_from_pack, skeleton.in_pack.items(), self.workers)
        self._finish(skeleton)

    def _dest(self, entry: ManifestEntry) -> str:
        return self.base if entry.path == "." else self._dest_path(entry.path)

    def _make_skeleton(self) -> _Skeleton:
        out = _Skeleton()
        for e in self.manifest.entries:
            path = self._dest(e)
            if e.kind == DIRECTORY:
                os.mkdir(path, 0o700)
                if e.opaque:
                    _mark_opaque(path)
                out.dirs.append((path, e.mode))
            elif e.kind == SYMLINK:
                out.links.append(e)
            elif e.pack:
                out.in_pack.setdefault(e.pack, []).append(e)
            elif e.kind == WHITEOUT:
                # Unprivileged users may create whiteouts too (Linux >= 5.8).
                os.mknod(path, stat.S_IFCHR, os.makedev(0, 0))
                out.whiteouts.append(path)
            else:
                out.by_blob.setdefault(e.blob, []).append(e)
        return out

    def _finish(self, skeleton: _Skeleton) -> None:
        for e in skeleton.links:
            os.symlink(e.target, self._dest(e))
        if self.owner is not None:
            for e in skeleton.links:
                os.lchown(self._dest(e), *self.owner)
            for path in skeleton.whiteouts:
                os.lchown(path, *self.owner)
        # Directories last, deepest first: a read-only directory must be filled before its mode.
        for path, mode in reversed(skeleton.dirs):
            if self.owner is not None:
                os.chown(path, *self.owner)
            os.chmod(path, unpacked_mode(mode))

    def _open_pack(self, pack: str) -> tuple[PackReader, mmap.mmap]:
        """The pack (and its index) this unpacking wrote at `pack` (manifest.py made sure
        both are stored files of the layer)."""
        fd = os.open(self._dest_path(pack), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            mapped = mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
        finally:
            os.close(fd)
        try:
            idx = self._dest_path(pack.removesuffix(".pack") + ".idx")
            with open(idx, "rb", opener=_no_follow) as fh:
                index = PackIndex(fh.read())
            return PackReader(mapped, index), mapped
        except BaseException:
            mapped.close()
            raise

    def _dest_path(self, rel: str) -> str:
        return os.path.join(self.base, rel)

    def _write_from_pack(self, item: tuple[str, list[ManifestEntry]]) -> None:
        pack, files = item
        path = Path(self._dest_path(pack))
        opened: list[tuple[PackReader, mmap.mmap]] = []

        def make(fd: int, e: ManifestEntry) -> None:
            try:
                if not opened:
                    opened.append(self._open_pack(pack))
                write_all(fd, opened[0][0].file(e.offset, e.size, e.content))
            except GitPackError as exc:
                os.close(fd)
                raise CorruptLayerError(self.layer_id, path, f"{e.path}: {exc}") from None
            except BaseException:
                os.close(fd)
                raise
            finish_file(fd, e, self.owner)

        try:
            for e in files:
                if self.pool is None:
                    make(create_file(self._dest(e)), e)
                else:
                    name = pool_name(e.content, unpacked_mode(e.mode), e.mtime, self.owner)
                    self.pool.link_into(name, self._dest(e), functools.partial(make, e=e))
        finally:
            for _reader, mapped in opened:
                mapped.close()

    def _write_group(self, item: tuple[int, list[ManifestEntry]]) -> None:
        """Write the files whose content is in blob `i` (-1: the empty files)."""
        i, files = item
        if i < 0:
            for e in files:
                finish_file(create_file(self._dest(e)), e, self.owner)
        elif all(e.offset == 0 and e.size == files[0].size for e in files):
            # The blob is one file's content (a layer may hold that file several times).
            self._write_whole(self.manifest.blobs[i], files)
        else:
            self._write_runs(self.manifest.blobs[i], files)

    def _write_whole(self, sha: str, files: list[ManifestEntry]) -> None:
        """Stream the blob, verifying as it goes, rather than hold a large file in memory."""
        path = self.layout.blob_path(sha)

        def make(fd: int, e: ManifestEntry) -> None:
            try:
                stream_blob(path, sha, self.layer_id, e.size, fd)
            except BaseException:
                os.close(fd)
                raise
            finish_file(fd, e, self.owner)

        if self.pool is not None:
            for e in files:
                name = pool_name(sha, unpacked_mode(e.mode), e.mtime, self.owner)
                self.pool.link_into(name, self._dest(e), functools.partial(make, e=e))
            return
        first = files[0]
        make(create_file(self._dest(first)), first)
        for other in files[1:]:
            shutil.copyfile(self._dest(first), self._dest(other))
            finish_file(os.open(self._dest(other), os.O_RDONLY), other, self.owner)

    def _write_runs(self, sha: str, files: list[ManifestEntry]) -> None:
        """Files that are runs of a pack blob: the pack is read (and verified) once, and only
        if the pool lacks one of them."""
        path = self.layout.blob_path(sha)
        loaded: list[bytes] = []

        def fill(fd: int, e: ManifestEntry) -> None:
            try:
                if not loaded:
                    loaded.append(read_blob(path, sha, self.layer_id))
                chunk = loaded[0][e.offset : e.offset + e.size]
                if len(chunk) != e.size:
                    raise CorruptLayerError(self.layer_id, path, f"pack too short for {e.path}")
                write_all(fd, chunk)
            except BaseException:
                os.close(fd)
                raise
            finish_file(fd, e, self.owner)

        for e in files:
            if self.pool is None:
                fill(create_file(self._dest(e)), e)
            else:
                name = pool_name(
                    f"{sha}.{e.offset}.{e.size}", unpacked_mode(e.mode), e.mtime, self.owner
                )
                self.pool.link_into(name, self._dest(e), functools.partial(fill, e=e))


def unpack_layer(
    layout: StoreLayout,
    layer_id: str,
    manifest: Manifest,
    tmp: Path,
    *,
    owner: tuple[int, int] | None = None,
    pool: FilePool | None = None,
    workers: int = 1,
) -> None:
    """Create the layer's tree at `tmp`, which must not exist (see `Unpacker`)."""
    Unpacker(layout, layer_id, manifest, os.fspath(tmp), owner, pool, workers).run()
