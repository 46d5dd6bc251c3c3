"""Copying a layer into another store file by file (what a node without the shared store does):
the copy unpacks to the same tree, only layer files can be read, a damaged copy is refused."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from minisandbox.layers.errors import CorruptLayerError, LayerStoreError
from minisandbox.layers.replica import PART_BYTES, copy_layer, layer_files, read_part
from minisandbox.layers.store import LayerStore


def tree(root: Path) -> Path:
    (root / "pkg").mkdir(parents=True)
    (root / "pkg" / "small.py").write_text("print('hi')\n")
    (root / "big.bin").write_bytes(os.urandom(PART_BYTES + 100_000))  # a blob of two parts
    (root / "link").symlink_to("pkg/small.py")
    return root


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes() if p.is_file() and not p.is_symlink() else b""
        for p in sorted(root.rglob("*"))
    }


async def test_a_copied_layer_unpacks_to_the_same_tree(tmp_path: Path) -> None:
    source = LayerStore(tmp_path / "source", level=1)
    layer = source.publish(tree(tmp_path / "tree")).id
    copy = LayerStore(tmp_path / "copy")
    reads: list[tuple[str, int]] = []

    async def read(rel: str, offset: int, size: int) -> bytes:
        reads.append((rel, offset))
        return read_part(source, rel, offset, size)

    files = layer_files(source, layer)
    assert files[-1].endswith(".manifest.zst")  # last: the copy exists only once whole
    assert await copy_layer(copy, layer, files, read) > 0
    assert copy.exists(layer)
    copy.unpack(layer, tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(tmp_path / "tree")
    # Blobs it holds are not copied again.
    assert any(rel.startswith("blobs/") and offset == PART_BYTES for rel, offset in reads)
    reads.clear()
    await copy_layer(copy, layer, files, read)
    assert all(not rel.startswith("blobs/") for rel, _ in reads)


def test_only_the_files_of_layers_can_be_read(tmp_path: Path) -> None:
    source = LayerStore(tmp_path / "source")
    source.publish(tree(tmp_path / "tree"))
    (source.root / "refs" / "secret").write_text("x")
    for rel in ("../../etc/passwd", "refs/secret", "/etc/passwd", "layers/x.json", "tmp/a"):
        with pytest.raises(LayerStoreError):
            read_part(source, rel, 0, 10)


async def test_a_damaged_manifest_is_refused_and_not_kept(tmp_path: Path) -> None:
    source = LayerStore(tmp_path / "source")
    layer = source.publish(tree(tmp_path / "tree")).id
    copy = LayerStore(tmp_path / "copy")

    async def read(rel: str, offset: int, size: int) -> bytes:
        data = read_part(source, rel, offset, size)
        if rel.endswith(".manifest.zst"):  # another layer's manifest under this name
            other = source.publish(tmp_path / "tree" / "pkg").id
            data = read_part(source, f"layers/{other}.manifest.zst", offset, size)
        return data

    with pytest.raises(CorruptLayerError):
        await copy_layer(copy, layer, layer_files(source, layer), read)
    assert not copy.exists(layer)


async def test_a_damaged_blob_is_refused_and_not_kept(tmp_path: Path) -> None:
    source = LayerStore(tmp_path / "source")
    layer = source.publish(tree(tmp_path / "tree")).id
    copy = LayerStore(tmp_path / "copy")

    async def read(rel: str, offset: int, size: int) -> bytes:
        data = read_part(source, rel, offset, size)
        if rel.startswith("blobs/") and offset == 0:  # another blob's bytes under this name
            others = [f for f in layer_files(source, layer) if f.startswith("blobs/") and f != rel]
            data = read_part(source, others[0], 0, size)
        return data

    with pytest.raises(CorruptLayerError, match="copy"):
        await copy_layer(copy, layer, layer_files(source, layer), read)
    assert not copy.exists(layer)
    assert not [p for p in (copy.root / "blobs").rglob("*.zst")]


def test_a_fifo_under_a_layer_name_is_refused_at_once(tmp_path: Path) -> None:
    source = LayerStore(tmp_path / "source")
    fake = "blobs/ab/" + "ab" * 32 + ".zst"
    (source.root / "blobs" / "ab").mkdir(parents=True)
    os.mkfifo(source.root / fake)
    with pytest.raises(LayerStoreError, match="regular"):
        read_part(source, fake, 0, 10)
    with pytest.raises(LayerStoreError):
        read_part(source, fake + "\n", 0, 10)
