"""Files stored once when the layer holds them in a git pack: real git repositories and packs,
published, unpacked and read back; packs and manifests that lie are refused."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import zstandard

from minisandbox.layers.errors import ManifestFormatError
from minisandbox.layers.filepool import FilePool
from minisandbox.layers.gitpack import GitPackError, PackIndex, PackReader, blob_id
from minisandbox.layers.manifest import ManifestEntry
from minisandbox.layers.store import CorruptLayerError, LayerStore


def snapshot(root: Path) -> dict[str, tuple]:
    """Per path: kind and mode, and a file's content hash and mtime (what unpacking keeps)."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*dirnames, *filenames]:
            path = Path(dirpath, name)
            st = path.lstat()
            if path.is_file() and not path.is_symlink():
                digest = hashlib.sha256(path.read_bytes()).hexdigest()
                out[str(path.relative_to(root))] = (st.st_mode, digest, int(st.st_mtime))
            else:
                out[str(path.relative_to(root))] = (st.st_mode,)
    return out


GIT = {
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@t",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@t",
}


def git(repo: Path, *args: str) -> str:
    env = {**os.environ, **GIT}
    return subprocess.run(
        ["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True
    ).stdout


def make_repo(path: Path, *, ofs_deltas: bool) -> Path:
    """A repository whose files changed over ten commits (so that its pack holds deltas),
    everything in one pack: git's own packing (OFS deltas, zlib) or ours (REF deltas, raw)."""
    git(path.parent, "init", "-q", "--template=", str(path))
    src = path / "src"
    src.mkdir()
    for n in range(10):
        for i in range(6):
            lines = [f"def f{i}_{k}(x):\n    return x * {k} + {i}\n" for k in range(40 + n)]
            (src / f"mod{i}.py").write_text("".join(lines))
        (path / "README").write_text(f"version {n}\n" + "words " * 100)
        git(path, "add", "-A")
        git(path, "commit", "-q", "-m", f"c{n}")
    (path / "tiny").write_text("small\n")  # below the size worth a reference
    git(path, "add", "-A")
    git(path, "commit", "-q", "-m", "tiny")
    if ofs_deltas:
        git(path, "repack", "-a", "-d", "-f", "-q")
    else:
        packs = path / ".git" / "objects" / "pack"
        packs.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **GIT}
        subprocess.run(
            ["git", "-C", str(path), "-c", "pack.compression=0", "pack-objects", "--revs",
             "--no-reuse-object", "-q", str(packs / "pack")],
            input="HEAD\n", env=env, check=True, capture_output=True, text=True,
        )  # fmt: skip
        git(path, "prune-packed")
    for pack in (path / ".git" / "objects" / "pack").iterdir():
        os.chmod(pack, 0o444)
    return path


def pack_of(repo: Path) -> Path:
    (pack,) = (repo / ".git" / "objects" / "pack").glob("*.pack")
    return pack


@pytest.mark.parametrize("ofs_deltas", [True, False], ids=["git-repack", "raw-ref-deltas"])
def test_every_object_of_a_real_pack_reads_as_git_reads_it(tmp_path: Path, ofs_deltas: bool):
    repo = make_repo(tmp_path / "repo", ofs_deltas=ofs_deltas)
    pack = pack_of(repo)
    listing = git(repo, "verify-pack", "-v", str(pack.with_suffix(".idx")))
    deltas = [line for line in listing.splitlines() if " blob " in line and len(line.split()) > 5]
    assert deltas, "the repository must give the pack some deltas to resolve"
    index = PackIndex(pack.with_suffix(".idx").read_bytes())
    reader = PackReader(pack.read_bytes(), index)
    blobs = [line.split()[0] for line in listing.splitlines() if " blob " in line]
    for oid in blobs:
        data = reader.blob(index.offset(bytes.fromhex(oid)))  # type: ignore[arg-type]
        assert blob_id(data).hex() == oid
        assert (
            data
            == subprocess.run(
                ["git", "-C", str(repo), "cat-file", "blob", oid], capture_output=True, check=True
            ).stdout
        )
    assert index.offset(b"\0" * 20) is None


def test_a_checkout_beside_its_pack_is_stored_once_and_unpacks_whole(tmp_path: Path):
    tree = tmp_path / "tree"
    tree.mkdir()
    make_repo(tree / "testbed", ofs_deltas=False)
    (tree / "site").mkdir()  # an installed copy of a checkout's file is found too
    (tree / "site" / "mod0.py").write_bytes((tree / "testbed" / "src" / "mod0.py").read_bytes())
    for same in (tree / "site" / "mod0.py", tree / "testbed" / "src" / "mod0.py"):
        os.utime(same, (1_600_000_000, 1_600_000_000))  # one pool file: same bytes, mode, mtime
    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(tree)
    manifest = store.read_manifest(ref.id)
    in_pack = {e.path for e in manifest.entries if e.pack}
    worktree = {f"testbed/src/mod{i}.py" for i in range(6)} | {"testbed/README", "site/mod0.py"}
    assert in_pack == worktree  # not "tiny" (under MIN_IN_PACK_BYTES), not .git's own files
    assert all(e.blob == -1 for e in manifest.entries if e.pack)
    for e in manifest.entries:
        if e.pack:
            assert e.pack.startswith("testbed/.git/objects/pack/pack-")
    stored_blobs = {store.read_blob(sha) for sha in manifest.blobs}
    mod0 = (tree / "testbed" / "src" / "mod0.py").read_bytes()
    # Its bytes are stored once, in the (raw) pack, not again as the checkout's or site's file.
    assert sum(mod0 in blob for blob in stored_blobs) == 1

    # Unpacked, with and without the node's pool: the same tree, byte for byte, modes and mtimes.
    store.unpack(ref.id, tmp_path / "plain")
    pool = FilePool(tmp_path / "pool")
    store.unpack(ref.id, tmp_path / "pooled", pool=pool)
    store.unpack(ref.id, tmp_path / "pooled-again", pool=pool)
    for out in ("plain", "pooled", "pooled-again"):
        assert snapshot(tmp_path / out) == snapshot(tree)
    assert (
        os.stat(tmp_path / "pooled" / "site" / "mod0.py").st_ino
        == os.stat(tmp_path / "pooled-again" / "testbed" / "src" / "mod0.py").st_ino
    )  # one pooled file for both paths, both unpacks
    assert pool.verify(store.read_blob) == []
    assert store.read_file(ref.id, "testbed/src/mod0.py") == mod0
    assert store.publish(tmp_path / "plain").id == ref.id  # the same tree, the same layer
    assert git(tmp_path / "plain" / "testbed", "status", "--porcelain") == ""

    # The same tree without its pack: every file stored as a blob (the control).
    bare = tmp_path / "bare"
    bare.mkdir()
    subprocess.run(["cp", "-a", str(tree / "testbed" / "src"), str(bare)], check=True)
    assert not any(e.pack for e in store.read_manifest(store.publish(bare).id).entries)


def _corrupt_objects(pack: Path) -> None:
    """Flip a byte inside every stored object's data (raw packs keep file text verbatim)."""
    data = bytearray(pack.read_bytes())
    i = 0
    while (i := data.find(b"def f", i)) >= 0:
        data[i + 4] = ord("g")
        i += 5
    os.chmod(pack, 0o644)
    pack.write_bytes(bytes(data))
    os.chmod(pack, 0o444)


def test_a_pack_that_does_not_hold_the_file_stores_the_file(tmp_path: Path):
    """A build sandbox wrote the tree: its pack may lie. A file is referenced only when the
    object read back equals it; otherwise it is stored, and publishing does not fail."""
    tree = tmp_path / "tree"
    tree.mkdir()
    repo = make_repo(tree / "testbed", ofs_deltas=False)
    _corrupt_objects(pack_of(repo))
    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(tree)
    assert not any(e.pack for e in store.read_manifest(ref.id).entries if "src/" in e.path)
    store.unpack(ref.id, tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(tree)

    # A pack readable by its owner only is not used either (unpacking must read it back).
    tree2 = tmp_path / "tree2"
    tree2.mkdir()
    repo2 = make_repo(tree2 / "testbed", ofs_deltas=True)
    os.chmod(pack_of(repo2), 0o400)
    assert not any(e.pack for e in store.read_manifest(store.publish(tree2).id).entries)


def _plant(store: LayerStore, doc: dict) -> str:
    data = json.dumps(doc, separators=(",", ":")).encode()
    layer_id = hashlib.sha256(data).hexdigest()
    store.manifest_path(layer_id).write_bytes(zstandard.ZstdCompressor().compress(data))
    return layer_id


def test_a_manifest_whose_row_names_another_object_unpacks_nothing(tmp_path: Path):
    """A planted manifest (it hashes to its id) says a file is an object it is not: unpacking
    checks what it read against the row's sha256 and leaves no tree."""
    tree = tmp_path / "tree"
    tree.mkdir()
    make_repo(tree / "testbed", ofs_deltas=True)
    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(tree)
    doc = store.manifest(ref.id)
    rows = [r for r in doc["entries"] if r[0] == "g"]
    mod0 = next(r for r in rows if r[1].endswith("mod0.py"))
    mod1 = next(r for r in rows if r[1].endswith("mod1.py"))
    mod0[7] = mod1[7]  # mod0's row points at mod1's object
    forged = _plant(store, doc)
    with pytest.raises(CorruptLayerError, match="not the content of"):
        store.unpack(forged, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(CorruptLayerError):
        store.read_file(forged, mod0[1])
    mod0[7] = 13  # not where an object starts
    with pytest.raises(CorruptLayerError):
        store.unpack(_plant(store, doc), tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "row",
    [
        ["g", "a", 0o644, 5, 0, "0" * 64, "x/pack/p.pack", 11],  # offset inside the header
        ["g", "a", 0o644, 0, 0, "0" * 64, "x/pack/p.pack", 12],  # empty: stored as such
        ["g", "a", 0o644, 5, 0, "not-a-sha", "x/pack/p.pack", 12],
        ["g", "a", 0o644, 5, 0, "0" * 64, "x/pack/p.idx", 12],
        ["g", "a", 0o644, 5, 0, "0" * 64, "../p.pack", 12],
        ["g", "a", 0o644, 5, 0, "0" * 64, "x/pack/p.pack"],
    ],
)
def test_pack_rows_that_are_refused(row: object) -> None:
    with pytest.raises(ManifestFormatError):
        ManifestEntry.from_row(row)


def test_a_pack_row_needs_a_stored_pack_and_index_in_its_layer(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    row = ["g", "a", 0o644, 5, 0, "0" * 64, "p/pack/x.pack", 12]
    layer = _plant(store, {"format": 1, "blobs": [], "entries": [["d", ".", 0o755], row]})
    with pytest.raises(CorruptLayerError, match="no stored pack"):
        store.unpack(layer, tmp_path / "out")
    row_ok = ManifestEntry.from_row(row)
    assert row_ok.to_row() == row and row_ok.kind == "f"


def _pack_bytes(objects: list[bytes]) -> bytes:
    data = b"PACK" + struct.pack(">II", 2, len(objects)) + b"".join(objects)
    return data + hashlib.sha1(data, usedforsecurity=False).digest()


def _index_bytes(entries: dict[bytes, int]) -> bytes:
    ids = sorted(entries)
    fanout = [sum(1 for i in ids if i[0] <= b) for b in range(256)]
    return (
        b"\xfftOc" + struct.pack(">I", 2) + struct.pack(">256I", *fanout) + b"".join(ids)
        + b"\0" * 4 * len(ids) + b"".join(struct.pack(">I", entries[i]) for i in ids)
        + b"\0" * 40
    )  # fmt: skip


def _ref_delta(base: bytes, delta: bytes) -> bytes:
    assert len(delta) < 16
    return bytes([(7 << 4) | len(delta)]) + base + zlib.compress(delta)


def test_hostile_packs_end_in_an_error_not_a_hang(tmp_path: Path) -> None:
    """A REF_DELTA that is its own base (a cycle), a delta that copies past its base, an
    offset outside the pack, a truncated index: GitPackError, at once."""
    me = b"\x11" * 20
    cycle = _pack_bytes([_ref_delta(me, b"\x05\x05\x90\x05")])
    reader = PackReader(cycle, PackIndex(_index_bytes({me: 12})))
    with pytest.raises(GitPackError, match="too deep"):
        reader.blob(12)
    with pytest.raises(GitPackError, match="outside the pack"):
        reader.blob(len(cycle) + 5)

    whole = b"hello"
    base_obj = bytes([(3 << 4) | len(whole)]) + zlib.compress(whole)
    base_id = blob_id(whole)
    past = _ref_delta(base_id, b"\x05\x10\x91\x00\x10")  # copy 16 bytes from offset 0 of 5
    pack = _pack_bytes([base_obj, past])
    reader = PackReader(pack, PackIndex(_index_bytes({base_id: 12, me: 12 + len(base_obj)})))
    assert reader.blob(12) == whole
    with pytest.raises(GitPackError, match="past its base"):
        reader.blob(12 + len(base_obj))
    with pytest.raises(GitPackError):
        PackIndex(_index_bytes({me: 12})[:-50])
    with pytest.raises(GitPackError):
        PackReader(b"PACK" + b"\0" * 40, None)
