"""Blobs on their own: zstd, hashing, reading the source files a blob is made of, and reading a
stored blob back with its content checked against its name.

A blob is named by the sha256 of its *uncompressed* bytes, and every read here re-hashes what it
decompresses: a blob that does not hold what its name says is a CorruptLayerError, never data.
Files of a tree being published are opened without following links and read only as far as the
scan measured them (see `open_source`, `read_pack`).
"""

from __future__ import annotations

import hashlib
import io
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import IO, cast

import zstandard

from minisandbox.layers.errors import CorruptLayerError, TreeChangedError

CHUNK = 1024 * 1024
# Files at least this big are compressed by several zstd threads.
MULTITHREAD_BYTES = 8 * 1024 * 1024

_local = threading.local()


def compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    """This thread's compressor for `level` and `threads`."""
    # zstd contexts are not thread-safe and costly to create: one per thread and setting.
    cache: dict[tuple[int, int], zstandard.ZstdCompressor]
    cache = _local.__dict__.setdefault("cctx", {})
    key = (level, threads)
    if key not in cache:
        cache[key] = zstandard.ZstdCompressor(level=level, threads=threads, write_checksum=True)
    return cache[key]


def decompressor() -> zstandard.ZstdDecompressor:
    """This thread's decompressor."""
    dctx: zstandard.ZstdDecompressor | None = getattr(_local, "dctx", None)
    if dctx is None:
        dctx = _local.dctx = zstandard.ZstdDecompressor()
    return dctx


class HashingReader:
    """A file reader that hashes what passes through (for zstd's copy_stream)."""

    def __init__(self, fh: IO[bytes]) -> None:
        self._fh = fh
        self.hash = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._fh.read(n)
        self.hash.update(data)
        return data


def open_source(path: str) -> io.FileIO:
    """A file of the tree being published, for reading: the scan saw a regular file here, so a
    symlink (or a FIFO) in its place now is refused rather than followed or waited on."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise TreeChangedError(f"{path} changed while it was being published")
        return open(fd, "rb", buffering=0)
    except BaseException:
        os.close(fd)
        raise


def sha256_file(path: str) -> str:
    """The sha256 of a source file (see `open_source`)."""
    h = hashlib.sha256()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open_source(path) as fh:
        while n := fh.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


def read_at_most(fh: io.FileIO, limit: int) -> bytes:
    """Up to `limit` bytes of `fh` (fewer only at its end)."""
    buf = bytearray()
    while len(buf) < limit and (chunk := fh.read(limit - len(buf))):
        buf += chunk
    return bytes(buf)


def read_pack(sources: list[tuple[str, int]]) -> bytes:
    """The concatenated content of small source files, each exactly the size the scan saw."""
    parts = []
    for path, size in sources:
        with open_source(path) as fh:
            data = read_at_most(fh, size + 1)  # one byte more tells a file that grew
        if len(data) != size:
            raise TreeChangedError(f"{path} changed while it was being published")
        parts.append(data)
    return b"".join(parts)


def compress_file(path: str, out: IO[bytes], *, size: int, sha: str, level: int) -> None:
    """Compress source file `path` (`size` bytes, content `sha`) into `out`; TreeChangedError
    when what is read is not what was hashed."""
    threads = -1 if size >= MULTITHREAD_BYTES else 0
    with open_source(path) as src:
        reader = HashingReader(src)
        try:
            compressor(level, threads).copy_stream(cast(IO[bytes], reader), out, size=size)
        except zstandard.ZstdError as exc:
            raise TreeChangedError(f"{path} changed while it was being published") from exc
    if reader.hash.hexdigest() != sha:
        raise TreeChangedError(f"{path} changed while it was being published")


@dataclass(frozen=True)
class BlobCheck:
    """What re-hashing a stored blob found: the sha256 of its uncompressed content, or why
    there is none (`missing`, or the error that stopped the read)."""

    digest: str | None
    missing: bool = False
    error: str = ""

    def why(self) -> str:
        """Why a blob named otherwise is bad."""
        if self.missing:
            return "missing"
        return self.error if self.digest is None else "sha256 mismatch"


def check_blob(path: Path) -> BlobCheck:
    """Re-hash the stored blob at `path`."""
    try:
        h = hashlib.sha256()
        with open(path, "rb") as src:
            reader = decompressor().stream_reader(src, read_size=CHUNK)
            while chunk := reader.read(CHUNK):
                h.update(chunk)
    except FileNotFoundError:
        return BlobCheck(None, missing=True)
    except (OSError, zstandard.ZstdError) as exc:
        return BlobCheck(None, error=str(exc))
    return BlobCheck(h.hexdigest())


def read_blob(path: Path, sha: str, layer_id: str) -> bytes:
    """The content of the blob `sha` stored at `path`, verified; CorruptLayerError (naming
    `layer_id`) when it is missing, not zstd, or not what its name says."""
    try:
        data = decompressor().decompress(path.read_bytes())
    except FileNotFoundError:
        raise CorruptLayerError(layer_id, path, "blob missing") from None
    except zstandard.ZstdError as exc:
        raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
    if hashlib.sha256(data).hexdigest() != sha:
        raise CorruptLayerError(layer_id, path, "sha256 mismatch")
    return data


def stream_blob(path: Path, sha: str, layer_id: str, size: int, fd: int) -> None:
    """Decompress the blob `sha` (one file of `size` bytes) into `fd`, verifying it as it goes,
    without holding it in memory; CorruptLayerError as `read_blob`. `fd` stays open."""
    h = hashlib.sha256()
    written = 0
    try:
        with open(path, "rb") as src, open(fd, "wb", closefd=False) as out:
            reader = decompressor().stream_reader(src, read_size=CHUNK)
            while chunk := reader.read(CHUNK):
                h.update(chunk)
                out.write(chunk)
                written += len(chunk)
    except FileNotFoundError:
        raise CorruptLayerError(layer_id, path, "blob missing") from None
    except zstandard.ZstdError as exc:
        raise CorruptLayerError(layer_id, path, f"zstd: {exc}") from None
    if written != size:
        raise CorruptLayerError(layer_id, path, f"{written} bytes, expected {size}")
    if h.hexdigest() != sha:
        raise CorruptLayerError(layer_id, path, "sha256 mismatch")


def fsync_dir(path: Path) -> None:
    """fsync a directory (its new entries), where the filesystem allows it."""
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
