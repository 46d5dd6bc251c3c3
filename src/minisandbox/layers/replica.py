"""Copying layers into another store file by file, for a machine that does not see the store.

A layer is its blobs, its info and its manifest, each a file of the store (store.py's layout).
`layer_files` names them, `read_part` reads a piece of one (and nothing else of the machine),
and `copy_layer` rebuilds the layer in another store from those pieces, however they travel
(a cluster sends them through Ray: cluster.store_source). As in any publish, every file lands by
an atomic rename and the manifest comes last, so the copy exists only once it is whole; each blob
is checked against its name and the manifest against the layer id before they land.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path

from minisandbox.layers.blobs import check_blob
from minisandbox.layers.errors import CorruptLayerError, LayerStoreError
from minisandbox.layers.ids import check_layer_id
from minisandbox.layers.store import LayerStore

PART_BYTES = 8 << 20
# The only store files a copy reads: blobs, and layers' manifests and infos.
_FILE = re.compile(
    r"^(blobs/[0-9a-f]{2}/[0-9a-f]{64}\.zst|layers/[0-9a-f]{64}\.(manifest\.zst|json))$"
)

Read = Callable[[str, int, int], Awaitable[bytes]]


def layer_files(store: LayerStore, layer_id: str) -> list[str]:
    """The store-relative paths of what the layer is made of: its blobs, its info (when there
    is one), its manifest last.

    Raises:
        LayerNotFoundError, CorruptLayerError: the layer is not in `store`, or is damaged.
    """
    manifest = store.read_manifest(check_layer_id(layer_id))
    paths = [store.blob_path(sha) for sha in dict.fromkeys(manifest.blobs)]
    if store.info_path(layer_id).exists():
        paths.append(store.info_path(layer_id))
    paths.append(store.manifest_path(layer_id))
    return [str(p.relative_to(store.root)) for p in paths]


def read_part(store: LayerStore, rel: str, offset: int, size: int) -> bytes:
    """Up to `size` bytes (at most PART_BYTES) of the store file `rel` from `offset`; fewer at
    its end.

    Raises:
        LayerStoreError: `rel` is not a blob, manifest or info path of a store.
        OSError: the file cannot be read.
    """
    if not _FILE.fullmatch(rel) or offset < 0 or size < 0:
        raise LayerStoreError(f"not a part of a layer: {rel!r} at {offset}")
    # Non-blocking: a FIFO planted under a layer's name cannot hang the reader.
    flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    fd = os.open(store.root / rel, flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise LayerStoreError(f"not a regular file: {rel!r}")
        return os.pread(fd, min(size, PART_BYTES), offset)
    finally:
        os.close(fd)


async def copy_layer(dest: LayerStore, layer_id: str, files: list[str], read: Read) -> int:
    """Make layer `layer_id` present in `dest` from its `files` (as `layer_files` named them in
    the source), read piece by piece with `read(rel, offset, size)`; files `dest` already holds
    are kept. Returns the bytes copied.

    Raises:
        LayerStoreError: a name is not a layer's file; CorruptLayerError: the manifest that
            arrived does not match the layer id (nothing of it is kept).
    """
    check_layer_id(layer_id)
    copied = 0
    for rel in files:
        if not _FILE.fullmatch(rel):
            raise LayerStoreError(f"not a part of a layer: {rel!r}")
        path = dest.root / rel
        if path.exists() and not rel.endswith(".json"):
            continue  # content-addressed: the same name is the same bytes
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.tmp_path(path.name)
        try:
            copied += await _receive(rel, tmp, read)
            if rel.startswith("blobs/"):  # its name is the hash of its content
                check = await asyncio.to_thread(check_blob, tmp)
                if check.digest != path.name.removesuffix(".zst"):
                    raise CorruptLayerError(layer_id, path, f"copy: {check.why()}")
            os.chmod(tmp, 0o444)
            os.replace(tmp, path)
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
    try:
        dest.manifest(layer_id)  # verified against the id
    except LayerStoreError as e:
        with contextlib.suppress(FileNotFoundError):
            dest.manifest_path(layer_id).unlink()
        raise CorruptLayerError(layer_id, dest.manifest_path(layer_id), f"copy: {e}") from None
    return copied


async def _receive(rel: str, tmp: Path, read: Read) -> int:
    """Write the source's file `rel` to `tmp`, part by part (off the event loop); its size."""
    with open(tmp, "wb") as out:
        offset = 0
        while True:
            part = await read(rel, offset, PART_BYTES)
            await asyncio.to_thread(out.write, part)
            offset += len(part)
            if len(part) < PART_BYTES:
                break
        await asyncio.to_thread(out.flush)
        await asyncio.to_thread(os.fsync, out.fileno())
    return offset
