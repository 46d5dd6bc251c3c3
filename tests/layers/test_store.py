"""The layer store on real files: round trips, dedup, crash safety, corruption, gc."""

from __future__ import annotations

import concurrent.futures
import errno
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zstandard

from minisandbox.layers.errors import (
    LayerIdError,
    LayerMetaError,
    ManifestFormatError,
    RefNameError,
    UnpackDestinationExistsError,
    UnsupportedTreeError,
)
from minisandbox.layers.ids import check_layer_id, is_layer_id
from minisandbox.layers.manifest import Manifest, ManifestEntry
from minisandbox.layers.store import (
    CorruptLayerError,
    LayerNotFoundError,
    LayerStore,
    LayerStoreError,
)

SRC = str(Path(__file__).resolve().parents[2] / "src")


def snapshot(root: Path) -> dict[str, tuple]:
    """Everything unpack must preserve, keyed by relative path."""
    out: dict[str, tuple] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [".", *dirnames, *filenames]:
            path = os.path.join(dirpath, name) if name != "." else dirpath
            rel = os.path.relpath(path, root)
            if name == "." and dirpath != str(root):
                continue
            st = os.lstat(path)
            mode = stat.S_IMODE(st.st_mode)
            if stat.S_ISLNK(st.st_mode):
                out[rel] = ("l", os.readlink(path))
            elif stat.S_ISDIR(st.st_mode):
                out[rel] = ("d", mode)
            else:
                digest = hashlib.sha256(Path(path).read_bytes()).hexdigest()
                out[rel] = ("f", mode, st.st_size, digest, int(st.st_mtime))
    return out


def make_tree(root: Path, *, big: int = 0) -> Path:
    root.mkdir(parents=True)
    (root / "bin").mkdir()
    (root / "bin" / "tool").write_text("#!/bin/sh\necho hi\n")
    os.chmod(root / "bin" / "tool", 0o755)
    (root / "secret").write_text("s")
    os.chmod(root / "secret", 0o600)
    (root / "empty-file").touch()
    (root / "empty-dir" / "nested").mkdir(parents=True)
    (root / "ünïcødé" / "日本").mkdir(parents=True)
    (root / "ünïcødé" / "日本" / "ファイル.txt").write_text("こんにちは\n")
    os.mkdir(os.path.join(os.fsencode(root), b"raw-\xff-name"))  # not UTF-8
    (root / "lib" / "pkg").mkdir(parents=True)
    for i in range(40):
        (root / "lib" / "pkg" / f"mod{i}.py").write_text(f"X = {i}\n" * (i + 1))
    (root / "lib" / "pkg" / "data.bin").write_bytes(os.urandom(100_000))
    os.link(root / "lib" / "pkg" / "mod3.py", root / "lib" / "hardlink.py")
    os.symlink("pkg/mod1.py", root / "lib" / "rel-link")
    os.symlink("/etc/hostname", root / "abs-link")
    os.symlink("does/not/exist", root / "dangling")
    os.symlink("lib/pkg", root / "dir-link")
    ro = root / "readonly"
    ro.mkdir()
    (ro / "inside").write_text("x")
    os.chmod(ro / "inside", 0o444)
    os.chmod(ro, 0o555)
    if big:
        with open(root / "big.bin", "wb") as fh:
            block = os.urandom(1 << 20)
            for i in range(big):
                fh.write(block[: (1 << 20) - i] + bytes([i % 256]) * i)
    os.utime(root / "bin" / "tool", (1_600_000_000, 1_600_000_000))
    return root


def rmtree(path: Path) -> None:
    from minisandbox.utils.safefs import discard_tree

    discard_tree(path)


def blob_of(store: LayerStore, layer_id: str, rel: str) -> Path:
    manifest = store.read_manifest(layer_id)
    entry = next(e for e in manifest.files() if e.path == rel)
    return store.blob_path(manifest.blobs[entry.blob])


def test_round_trip(tmp_path: Path) -> None:
    src = make_tree(tmp_path / "src", big=12)
    store = LayerStore(tmp_path / "store")
    ref = store.publish(src, meta={"recipe": "test"})
    assert ref.files == len(store.read_manifest(ref.id).files())
    assert ref.size > 12 * (1 << 20)
    assert 1 << 20 < ref.stored_bytes < 3 << 20  # one random MiB, repeated: zstd sees it
    assert store.info(ref.id).meta == {"recipe": "test"}
    assert [r.id for r in store.list()] == [ref.id]

    dest = tmp_path / "out" / "layer"
    store.unpack(ref.id, dest)
    assert snapshot(dest) == snapshot(src)
    assert os.stat(dest / "bin" / "tool").st_mtime == 1_600_000_000
    assert not [p for p in dest.parent.iterdir() if p != dest]  # no temp sibling left

    with pytest.raises(FileExistsError) as exists:
        store.unpack(ref.id, dest)
    assert isinstance(exists.value, UnpackDestinationExistsError)
    assert exists.value.errno == errno.EEXIST and exists.value.filename == str(dest)
    with pytest.raises(LayerNotFoundError):
        store.unpack("0" * 64, tmp_path / "nope")
    assert store.verify() == []

    if os.geteuid() == 0:
        owned = tmp_path / "owned"
        store.unpack(ref.id, owned, owner=(12345, 23456))
        for dirpath, dirnames, filenames in os.walk(owned):
            for name in [*dirnames, *filenames]:
                st = os.lstat(os.path.join(dirpath, name))
                assert (st.st_uid, st.st_gid) == (12345, 23456)
        assert stat.S_IMODE(os.stat(owned / "bin" / "tool").st_mode) == 0o755
        rmtree(owned)
    rmtree(dest)
    rmtree(src)


def test_identical_dirs_same_layer_stored_once(tmp_path: Path) -> None:
    a = make_tree(tmp_path / "a")
    b = tmp_path / "b"
    shutil.copytree(a, b, symlinks=True)  # copy2: same modes and mtimes
    store = LayerStore(tmp_path / "store")
    ra = store.publish(a)
    before = store.du()
    rb = store.publish(b, meta={"second": True})
    assert rb.id == ra.id
    assert rb.stored_bytes == 0
    after = store.du()
    assert after["blob_bytes"] == before["blob_bytes"]
    assert after["unique_blobs"] == before["unique_blobs"]
    assert store.meta(ra.id) == {"second": True}
    assert len(store.list()) == 1
    rmtree(a)
    rmtree(b)


def test_shared_files_stored_once(tmp_path: Path) -> None:
    a = tmp_path / "a"
    for pkg in range(5):
        d = a / "site-packages" / f"pkg{pkg}"
        d.mkdir(parents=True)
        for i in range(30):
            (d / f"m{i}.py").write_bytes(os.urandom(2000))  # small: packed
        (d / "ext.so").write_bytes(os.urandom(300_000))  # large: a blob of its own
    b = tmp_path / "b"
    shutil.copytree(a, b)
    new = b / "site-packages" / "newpkg"
    new.mkdir()
    (new / "core.so").write_bytes(os.urandom(200_000))
    (b / "site-packages" / "pkg0" / "m7.py").write_bytes(os.urandom(2000))  # one edit

    store = LayerStore(tmp_path / "store")
    ra = store.publish(a)
    rb = store.publish(b)
    assert ra.id != rb.id
    assert ra.stored_bytes > 5 * 360_000
    # b adds the new file, the one pack run holding the edit, and its manifest: no more.
    assert 200_000 < rb.stored_bytes < 200_000 + 80_000
    du = store.du()
    assert du["logical_bytes"] == ra.size + rb.size
    assert du["stored_bytes"] < ra.size + 300_000
    for ref, src in ((ra, a), (rb, b)):
        out = tmp_path / f"out-{ref.id[:8]}"
        store.unpack(ref.id, out)
        assert snapshot(out) == snapshot(src)


PUBLISHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.store import LayerStore
    store = LayerStore(Path(sys.argv[2]), level=int(sys.argv[4]), workers=1)
    print(store.publish(Path(sys.argv[3])).id, flush=True)
    """
)


def test_crash_mid_publish_leaves_no_layer(tmp_path: Path) -> None:
    src = tmp_path / "big-tree"
    for d in range(20):
        sub = src / f"d{d}"
        sub.mkdir(parents=True)
        for i in range(50):
            (sub / f"f{i}.txt").write_bytes(f"{d}-{i}\n".encode() * 300)
        (sub / "blob.bin").write_bytes(os.urandom(1 << 20) + bytes(3 << 20))
    store_root = tmp_path / "store"
    store = LayerStore(store_root)
    proc = subprocess.Popen(
        [sys.executable, "-c", PUBLISHER, SRC, str(store_root), str(src), "19"],
        stdout=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 20
        while not list((store_root / "blobs").rglob("*.zst")):
            assert proc.poll() is None, "publish ended before it could be killed"
            assert time.monotonic() < deadline
            time.sleep(0.005)
        assert proc.poll() is None, "publish ended before it could be killed"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL

    assert store.list() == []
    assert not list((store_root / "layers").glob("*.manifest.zst"))
    assert store.verify() == []  # the blobs that did land are whole

    ref = store.publish(src)  # the next publish works, and reuses what landed
    assert [r.id for r in store.list()] == [ref.id]
    out = tmp_path / "out"
    store.unpack(ref.id, out)
    assert snapshot(out) == snapshot(src)

    # A leftover temp file (a killed writer's), old enough for gc, and an orphan blob.
    stale = store_root / "tmp" / "otherhost.1.dead.blob"
    stale.write_bytes(b"partial")
    orphan = store.blob_path("ab" * 32)
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"nobody uses me")
    for path in [orphan, *(store_root / "tmp").iterdir()]:  # the killed publisher's too
        os.utime(path, (time.time() - 7200, time.time() - 7200))
    report = store.gc()
    assert report.removed_temps >= 1
    assert report.removed_blobs == 1
    assert not stale.exists()
    assert not orphan.exists()
    assert list((store_root / "tmp").iterdir()) == []
    assert store.verify() == []


def test_corrupt_and_truncated_blobs(tmp_path: Path) -> None:
    a = tmp_path / "a"
    a.mkdir()
    (a / "large.bin").write_bytes(os.urandom(200_000))
    for i in range(5):
        (a / f"small{i}.txt").write_text(f"small file {i}\n" * 20)
    b = tmp_path / "b"
    b.mkdir()
    (b / "other.bin").write_bytes(os.urandom(200_000))
    (b / "note.txt").write_text("b only\n")
    store = LayerStore(tmp_path / "store")
    ra, rb = store.publish(a), store.publish(b)

    large = blob_of(store, ra.id, "large.bin")
    os.chmod(large, 0o644)
    with open(large, "r+b") as fh:
        fh.seek(5000)
        byte = fh.read(1)
        fh.seek(5000)
        fh.write(bytes([byte[0] ^ 0x40]))
    dest = tmp_path / "unpacked" / "a"
    with pytest.raises(CorruptLayerError) as err:
        store.unpack(ra.id, dest)
    assert err.value.path == large
    assert ra.id in str(err.value) and str(large) in str(err.value)
    assert not dest.exists()
    assert list(dest.parent.iterdir()) == []  # no half-unpacked temp dir either
    store.unpack(rb.id, tmp_path / "unpacked" / "b")  # other layers are fine
    assert snapshot(tmp_path / "unpacked" / "b") == snapshot(b)
    problems = store.verify()
    assert len(problems) == 1 and str(large) in problems[0] and ra.id in problems[0]

    # Repair moves it aside; publishing the tree again stores it anew.
    store.verify(repair=True)
    assert not large.exists()
    store.publish(a)
    assert store.verify() == []
    store.unpack(ra.id, dest)
    rmtree(dest)

    pack = blob_of(store, ra.id, "small2.txt")
    os.chmod(pack, 0o644)
    os.truncate(pack, pack.stat().st_size // 2)
    with pytest.raises(CorruptLayerError) as err:
        store.unpack(ra.id, dest)
    assert err.value.path == pack
    assert not dest.exists()
    assert any(str(pack) in p for p in store.verify())

    # A truncated large blob and a damaged manifest are caught as well.
    os.chmod(large, 0o644)
    os.truncate(large, 1000)
    assert any(str(large) in p for p in store.verify())
    manifest = store.manifest_path(rb.id)
    os.chmod(manifest, 0o644)
    manifest.write_bytes(manifest.read_bytes()[:-3])
    with pytest.raises(CorruptLayerError) as err:
        store.unpack(rb.id, tmp_path / "b2")
    assert err.value.path == manifest
    assert not (tmp_path / "b2").exists()


def test_refs_gc_and_reuse_touch(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    dirs = []
    for name in ("one", "two", "three"):
        d = tmp_path / name
        d.mkdir()
        (d / "common.bin").write_bytes(b"shared by all" * 5000)
        (d / "own.bin").write_bytes(name.encode() * 10000)
        dirs.append(d)
    r1, r2, r3 = (store.publish(d) for d in dirs)
    store.tag("env/django__django-1234", r2.id)
    assert store.resolve("env/django__django-1234") == r2.id
    assert store.resolve("env/missing") is None
    store.tag("env/django__django-1234", r3.id)  # atomic replace
    assert store.resolve("env/django__django-1234") == r3.id
    assert store.refs() == {"env/django__django-1234": r3.id}

    # Age everything, then republish `one`: its reused blobs are touched, so they are fresh.
    old = time.time() - 7200
    for path in (tmp_path / "store").rglob("*.zst"):
        os.utime(path, (old, old))
    assert store.publish(dirs[0]).stored_bytes == 0
    assert time.time() - blob_of(store, r1.id, "own.bin").stat().st_mtime < 60
    assert time.time() - blob_of(store, r2.id, "own.bin").stat().st_mtime > 3600

    report = store.gc(keep={r1.id})  # r3 is kept by its ref, r2 goes with its own blob
    assert report.removed_layers == [r2.id]
    assert report.removed_blobs == 1
    assert {r.id for r in store.list()} == {r1.id, r3.id}
    assert store.verify() == []
    store.unpack(r3.id, tmp_path / "u3")
    assert snapshot(tmp_path / "u3") == snapshot(dirs[2])
    assert store.untag("env/django__django-1234")
    assert store.resolve("env/django__django-1234") is None


CONCURRENT_PUBLISHER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.store import LayerStore
    print(LayerStore(Path(sys.argv[2])).publish(Path(sys.argv[3])).id)
    """
)


def test_concurrent_publishers(tmp_path: Path) -> None:
    base = tmp_path / "base"
    for i in range(10):
        d = base / f"pkg{i}"
        d.mkdir(parents=True)
        (d / "lib.so").write_bytes(os.urandom(50_000))
        for j in range(20):
            (d / f"m{j}.py").write_text(f"# {i} {j}\n" * 50)
    trees = []
    for k in range(3):
        t = tmp_path / f"tree{k}"
        shutil.copytree(base, t)
        (t / "own.txt").write_text(f"tree {k}\n")
        trees.append(t)
    store_root = tmp_path / "store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", CONCURRENT_PUBLISHER, SRC, str(store_root), str(t)],
            stdout=subprocess.PIPE,
            text=True,
        )
        for t in trees
    ]
    ids = [p.communicate(timeout=60)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    store = LayerStore(store_root)
    assert sorted(r.id for r in store.list()) == sorted(ids)
    assert store.verify() == []
    for layer_id, t in zip(ids, trees, strict=True):
        out = tmp_path / f"out-{layer_id[:8]}"
        store.unpack(layer_id, out)
        assert snapshot(out) == snapshot(t)


def overlay_upper(root: Path) -> Path:
    """What a sandbox's upper directory holds after `rm testbed/f; rm -r testbed/d; mkdir
    testbed/d; echo new > testbed/d/h`: a whiteout and an opaque directory."""
    (root / "testbed" / "d").mkdir(parents=True)
    (root / "testbed" / "d" / "h").write_text("new\n")
    os.setxattr(root / "testbed" / "d", "user.overlay.opaque", b"y")
    os.mknod(root / "testbed" / "f", stat.S_IFCHR, os.makedev(0, 0))
    return root


def test_overlay_whiteouts_and_opaque_dirs(tmp_path: Path) -> None:
    try:
        upper = overlay_upper(tmp_path / "upper")
    except OSError as exc:  # no user xattrs or whiteouts on this filesystem
        pytest.skip(f"cannot make an overlay upper here: {exc}")
    store = LayerStore(tmp_path / "store")
    ref = store.publish(upper)
    out = store.unpack(ref.id, tmp_path / "out")
    st = os.lstat(out / "testbed" / "f")
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == 0
    assert os.getxattr(out / "testbed" / "d", "user.overlay.opaque") == b"y"
    assert (out / "testbed" / "d" / "h").read_text() == "new\n"

    (tmp_path / "fifo-tree").mkdir()
    os.mkfifo(tmp_path / "fifo-tree" / "pipe")
    with pytest.raises(UnsupportedTreeError, match="pipe"):  # a LayerStoreError
        store.publish(tmp_path / "fifo-tree")


async def test_layers_stack_as_overlay_lowers(tmp_path: Path, layer_dir: Path) -> None:
    """Unpacked layers work as a sandbox's lower layers, whiteouts included."""
    from minisandbox import Sandbox, SandboxConfig

    base = tmp_path / "base"
    (base / "testbed" / "d").mkdir(parents=True)
    (base / "testbed" / "f").write_text("old\n")
    (base / "testbed" / "d" / "g").write_text("old\n")
    (base / "testbed" / "keep").write_text("kept\n")
    try:
        upper = overlay_upper(tmp_path / "upper")
    except OSError as exc:
        pytest.skip(f"cannot make an overlay upper here: {exc}")
    store = LayerStore(tmp_path / "store")
    owner = SandboxConfig().layer_owner()
    lowers = [
        store.unpack(store.publish(d).id, layer_dir / d.name, owner=owner) for d in (base, upper)
    ]
    async with Sandbox(SandboxConfig(layers=lowers)) as sb:
        result = await sb.execute("ls -A /testbed; ls -A /testbed/d; cat /testbed/d/h")
    assert result.exit_code == 0, result
    assert result.stdout.split() == ["d", "keep", "h", "new"]


def test_unpack_never_restores_set_id_bits(tmp_path: Path) -> None:
    """A layer may hold what a sandbox wrote; the node cache is readable by other host users:
    a setuid file there would run as its owner for anyone."""
    src = tmp_path / "src"
    src.mkdir()
    tool = src / "tool"
    tool.write_bytes(b"#!/bin/sh\n" + b"x" * 40000)  # a large file: the streaming path
    small = src / "small"
    small.write_bytes(b"#!/bin/sh\n")  # a small one: the packed path
    for f in (tool, small):
        os.chmod(f, 0o6755)
    store = LayerStore(tmp_path / "store")
    ref = store.publish(src)
    out = store.unpack(ref.id, tmp_path / "out")
    for name in ("tool", "small"):
        assert stat.S_IMODE(os.stat(out / name).st_mode) == 0o755


def _flip_byte(path: Path, at: int = 20) -> None:
    os.chmod(path, 0o644)
    with open(path, "r+b") as fh:
        fh.seek(at)
        byte = fh.read(1)
        fh.seek(at)
        fh.write(bytes([byte[0] ^ 0x40]))


def test_forced_publish_rewrites_the_corrupt_blobs_it_would_reuse(tmp_path: Path) -> None:
    """A rebuild publishes the same contents again: a plain publish reuses a stored blob when
    it merely exists, a verifying one (`build --force`) re-hashes it and stores it anew."""
    src = tmp_path / "src"
    src.mkdir()
    (src / "large.bin").write_bytes(os.urandom(200_000))
    (src / "small.txt").write_text("small\n" * 10)
    store = LayerStore(tmp_path / "store")
    ref = store.publish(src)
    large, pack = blob_of(store, ref.id, "large.bin"), blob_of(store, ref.id, "small.txt")
    _flip_byte(large, 5000)
    _flip_byte(pack)
    assert store.publish(src).id == ref.id
    with pytest.raises(CorruptLayerError):  # reused as it was: still corrupt
        store.unpack(ref.id, tmp_path / "out0")
    again = store.publish(src, verify_existing=True)
    assert again.id == ref.id
    assert store.verify() == []
    store.unpack(ref.id, tmp_path / "out")
    assert snapshot(tmp_path / "out") == snapshot(src)
    # A corrupt manifest under the same id is written anew too.
    manifest = store.manifest_path(ref.id)
    os.chmod(manifest, 0o644)
    manifest.write_bytes(manifest.read_bytes()[:-3])
    store.publish(src)
    assert store.manifest(ref.id)["blobs"]


def test_verify_repair_drops_the_refs_of_broken_layers(tmp_path: Path) -> None:
    """What repair cannot restore (a blob missing or corrupt, a manifest corrupt) loses its
    refs, so a build rebuilds it instead of finding it cached; healthy layers keep theirs."""
    store = LayerStore(tmp_path / "store")
    ids = {}
    for name in ("missing", "corrupt", "manifest", "good"):
        d = tmp_path / name
        d.mkdir()
        (d / f"{name}.bin").write_bytes(os.urandom(50_000))
        ids[name] = store.publish(d).id
        store.tag(f"env/{name}", ids[name])
    store.tag("task/also-missing", ids["missing"])
    os.unlink(blob_of(store, ids["missing"], "missing.bin"))
    _flip_byte(blob_of(store, ids["corrupt"], "corrupt.bin"), 3000)
    manifest = store.manifest_path(ids["manifest"])
    os.chmod(manifest, 0o644)
    manifest.write_bytes(manifest.read_bytes()[:-3])

    report = store.check()  # no repair: nothing changes
    broken = sorted(ids[n] for n in ("missing", "corrupt", "manifest"))
    assert sorted(report.broken_layers) == broken
    assert report.dropped_refs == [] and store.resolve("env/missing") == ids["missing"]

    report = store.check(repair=True)
    assert sorted(report.dropped_refs) == [
        "env/corrupt",
        "env/manifest",
        "env/missing",
        "task/also-missing",
    ]
    assert any("dropped" in p for p in report.problems)
    for name in ("missing", "corrupt", "manifest"):
        assert store.resolve(f"env/{name}") is None
    assert store.resolve("env/good") == ids["good"]
    # What is left verifies clean, apart from the blob that is gone for good.
    assert [p for p in store.verify() if "missing" not in p] == []
    # Publishing the trees again restores them under their refs' names.
    for name in ("missing", "corrupt", "manifest"):
        store.tag(f"env/{name}", store.publish(tmp_path / name).id)
        store.unpack(store.resolve(f"env/{name}"), tmp_path / "out" / name)  # type: ignore[arg-type]
    assert store.verify() == []


def test_publish_stores_a_link_to_a_host_dir_as_a_link(tmp_path: Path) -> None:
    """A built tree (an upper a sandbox wrote) may hold a symlink to a host directory: the
    layer gets the link itself, never the content it points at."""
    host = tmp_path / "host-dir"
    (host / "sub").mkdir(parents=True)
    token = f"host-secret-{os.getpid()}-{time.time_ns()}"
    (host / "sub" / "secret.txt").write_text(token)
    tree = tmp_path / "upper"
    (tree / "opt").mkdir(parents=True)
    (tree / "opt" / "venv").symlink_to(host)
    (tree / "root").symlink_to(host / "sub")
    store = LayerStore(tmp_path / "store")
    ref = store.publish(tree)
    entries = store.read_manifest(ref.id).entries
    assert ManifestEntry.symlink("opt/venv", str(host)) in entries
    assert ManifestEntry.symlink("root", str(host / "sub")) in entries
    assert not [e for e in entries if e.path.endswith("secret.txt")], entries
    assert ref.files == 0
    for _sha, path in store.blob_files():
        data = zstandard.ZstdDecompressor().decompress(path.read_bytes())
        assert token.encode() not in data
    out = tmp_path / "out"
    store.unpack(ref.id, out)
    assert os.readlink(out / "opt" / "venv") == str(host)


# -- the manifest format, ids and names --------------------------------------------------------


def golden_tree(root: Path) -> Path:
    """A tree whose every stored property (names, contents, modes, mtimes) is fixed."""
    (root / "pkg" / "sub").mkdir(parents=True)
    (root / "empty-dir").mkdir()
    (root / "pkg" / "__init__.py").write_text("")
    for i in range(20):
        (root / "pkg" / f"m{i:02}.py").write_text(f"X = {i}\n" * (i + 1))
    (root / "pkg" / "sub" / "big.bin").write_bytes(bytes(range(256)) * 100)
    (root / "pkg" / "sub" / "note.txt").write_text("note\n")
    os.symlink("pkg/m01.py", root / "link")
    for dirpath, dirnames, filenames in os.walk(root):
        for name in filenames:
            os.chmod(os.path.join(dirpath, name), 0o644)
            os.utime(os.path.join(dirpath, name), (1_600_000_000, 1_600_000_000))
        for name in dirnames:
            os.chmod(os.path.join(dirpath, name), 0o755)
    os.chmod(root, 0o755)
    os.chmod(root / "pkg" / "m03.py", 0o755)
    return root


# The id the store has always given golden_tree: a change to how manifests are written (key
# order, separators, escaping, row shapes, pack cuts) would give every stored layer a new id.
GOLDEN_ID = "94f47d1a7026b68f3220a55a255fc84d7efb51be31f7c9ab667ea80b5c4a587d"


def test_manifest_format_is_stable(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(golden_tree(tmp_path / "tree"))
    assert ref.id == GOLDEN_ID
    stored = zstandard.ZstdDecompressor().decompress(store.manifest_path(ref.id).read_bytes())
    manifest = store.read_manifest(ref.id)
    assert manifest.to_bytes() == stored  # rows read into entries and written back: the same
    assert Manifest.from_document(json.loads(stored)) == manifest
    assert [e.to_row() for e in manifest.entries] == store.manifest(ref.id)["entries"]
    big = next(e for e in manifest.files() if e.path == "pkg/sub/big.bin")
    assert (big.size, big.mtime, big.mode, big.offset) == (25600, 1_600_000_000, 0o644, 0)
    assert ManifestEntry.symlink("link", "pkg/m01.py") in manifest.entries
    assert ManifestEntry.directory("empty-dir", 0o755) in manifest.entries


@pytest.mark.parametrize(
    "row",
    [
        ["d", ".", 0o755],
        ["d", "a/b", 0o700, "opaque"],
        ["l", "a/link", "../../anywhere"],
        ["w", "gone"],
        ["f", "a/f.py", 0o644, 12, 1_600_000_000, 3, 120],
        ["f", "empty", 0o600, 0, 0, -1, 0],
    ],
)
def test_manifest_rows_round_trip(row: list) -> None:
    entry = ManifestEntry.from_row(row)
    assert entry.to_row() == row
    assert ManifestEntry.from_row(entry.to_row()) == entry


@pytest.mark.parametrize(
    "row",
    [
        ["d", "../up", 0o755],
        ["d", "/abs", 0o755],
        ["f", "a/../../b", 0o644, 1, 0, 0, 0],
        ["d", "a", "0755"],
        ["d", "a", 0o755, "transparent"],
        ["f", "a", 0o644, 1, 0, 0],  # short
        ["f", "a", 0o644, 5, 0, -1, 0],  # content, but no blob
        ["f", "a", 0o644, 1, 0, True, 0],  # not an integer
        ["l", "a"],
        ["l", "a", "nul\0byte"],
        ["d", "nul\0byte", 0o755],
        ["x", "a"],
        ["w"],
        "w",
    ],
)
def test_manifest_rows_that_are_refused(row: object) -> None:
    with pytest.raises(ManifestFormatError):
        ManifestEntry.from_row(row)


def _plant_manifest(store: LayerStore, doc: dict) -> str:
    """A manifest in the store under its true id, whatever it holds."""
    data = json.dumps(doc, separators=(",", ":")).encode()
    layer_id = hashlib.sha256(data).hexdigest()
    store.manifest_path(layer_id).write_bytes(zstandard.ZstdCompressor().compress(data))
    return layer_id


def test_a_manifest_with_a_bad_row_or_blob_name_is_corrupt(tmp_path: Path) -> None:
    """A manifest that hashes to its id but is not a valid one (only a writer of the store
    could plant it) unpacks nothing: no path outside the tree, no blob outside blobs/."""
    store = LayerStore(tmp_path / "store", fsync=False)
    escape = _plant_manifest(
        store, {"format": 1, "blobs": [], "entries": [["d", ".", 0o755], ["d", "../out", 0o755]]}
    )
    with pytest.raises(CorruptLayerError, match="bad path") as err:
        store.unpack(escape, tmp_path / "a" / "dest")
    assert err.value.path == store.manifest_path(escape)
    assert not (tmp_path / "a" / "out").exists() and not (tmp_path / "a" / "dest").exists()
    with pytest.raises(CorruptLayerError):
        store.info(escape)  # no info file: rebuilt from the rows, which are read
    blob_name = _plant_manifest(store, {"format": 1, "blobs": ["../../x"], "entries": []})
    with pytest.raises(CorruptLayerError):
        store.manifest(blob_name)
    future = _plant_manifest(store, {"format": 2, "blobs": [], "entries": []})
    with pytest.raises(ManifestFormatError, match="unknown manifest format 2"):
        store.manifest(future)
    report = store.check()
    assert report.broken_layers == sorted([escape, blob_name, future])
    assert all(any(i in p for p in report.problems) for i in (escape, blob_name, future))


def test_layer_ids_and_ref_names_are_checked_once(tmp_path: Path) -> None:
    good = "0123456789abcdef" * 4
    assert is_layer_id(good) and check_layer_id(good) == good
    for bad in ("", "0" * 63, "0" * 65, "A" * 64, "../" + "0" * 61, None, 7):
        assert not is_layer_id(bad)
        with pytest.raises(LayerIdError):
            check_layer_id(bad)
    store = LayerStore(tmp_path / "store", fsync=False)
    assert not store.exists("../../etc/passwd")
    for call in (store.manifest, store.info, store.meta, store.read_blob):
        with pytest.raises(LayerIdError) as err:
            call("../../etc/passwd")
        assert isinstance(err.value, LayerNotFoundError) and isinstance(err.value, ValueError)
    with pytest.raises(LayerIdError):
        store.update_meta("nope", lambda m: m)
    ref = store.publish(golden_tree(tmp_path / "tree"))
    for name in ("", ".", "..", "x" * 300):
        with pytest.raises(RefNameError):
            store.tag(name, ref.id)
        assert isinstance(RefNameError("x"), LayerStoreError)
    store.tag("env/a b/ü", ref.id)
    assert store.refs() == {"env/a b/ü": ref.id} and store.resolve("env/a b/ü") == ref.id


# -- metadata ---------------------------------------------------------------------------------


def test_update_meta(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(golden_tree(tmp_path / "tree"))
    seen: list[dict] = []

    def add(meta: dict) -> dict:
        seen.append(dict(meta))
        meta["a"] = 1  # the argument is a copy: changing it in place is fine
        return meta

    assert store.update_meta(ref.id, add) == {"a": 1} and seen == [{}]  # no meta: an empty dict
    assert store.update_meta(ref.id, lambda m: {**m, "b": [1, 2]}) == {"a": 1, "b": [1, 2]}
    assert store.meta(ref.id) == {"a": 1, "b": [1, 2]}
    assert store.info(ref.id).size == ref.size  # the rest of the info is kept
    with pytest.raises(LayerMetaError):
        # Not a dict, on purpose: what the types forbid is refused at run time as well.
        store.update_meta(ref.id, lambda m: None)  # type: ignore[arg-type,return-value]
    assert store.meta(ref.id) == {"a": 1, "b": [1, 2]}
    with pytest.raises(LayerNotFoundError):
        store.update_meta("0" * 64, lambda m: m)
    store.info_path(ref.id).unlink()  # lost info: rebuilt from the manifest, then written
    assert store.update_meta(ref.id, lambda m: {**m, "c": 3}) == {"c": 3}
    assert store.info(ref.id).files == ref.files
    # Publishing the same tree again keeps the meta unless it brings its own.
    store.publish(tmp_path / "tree")
    assert store.meta(ref.id) == {"c": 3}


META_UPDATER = textwrap.dedent(
    """
    import sys, threading, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.store import LayerStore
    store, layer, name, rounds = LayerStore(Path(sys.argv[2])), sys.argv[3], sys.argv[4], 25
    while not Path(sys.argv[5]).exists():
        time.sleep(0.002)

    def worker(who):
        for i in range(rounds):
            def add(meta, key=f"{who}-{i}"):
                time.sleep(0.001)  # widen the read-modify-write window: races would show
                return {**meta, key: i}
            store.update_meta(layer, add)

    threads = [threading.Thread(target=worker, args=(f"{name}.{t}",)) for t in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    """
)


def test_update_meta_from_many_processes_loses_nothing(tmp_path: Path) -> None:
    """Processes (each with two threads) add keys of their own to one layer's meta at once:
    every key is there in the end."""
    store = LayerStore(tmp_path / "store", fsync=False)
    layer = store.publish(golden_tree(tmp_path / "tree"), meta={"kind": "env"}).id
    go = tmp_path / "go"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", META_UPDATER, SRC, str(store.root), layer, f"p{n}", str(go)]
        )
        for n in range(4)
    ]
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0
    meta = store.meta(layer)
    assert meta is not None
    expected = {f"p{n}.{t}-{i}" for n in range(4) for t in range(2) for i in range(25)}
    assert set(meta) == expected | {"kind"}
    assert store.verify() == []


def test_gc_removes_the_lock_files_of_removed_layers(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    one, two = (tmp_path / "one", tmp_path / "two")
    for d in (one, two):
        d.mkdir()
        (d / "f").write_text(d.name)
    r1, r2 = store.publish(one), store.publish(two)
    for r in (r1, r2):
        store.update_meta(r.id, lambda m: {**m, "x": 1})
    assert store.gc(keep=set()).removed_layers == []  # within the grace: kept, locks too
    assert sorted(os.listdir(store.root / "locks")) == sorted([r1.id, r2.id])
    old = time.time() - 7200
    for path in [*(store.root / "layers").iterdir(), *(store.root / "locks").iterdir()]:
        os.utime(path, (old, old))
    report = store.gc(keep={r1.id})
    assert report.removed_layers == [r2.id]
    assert os.listdir(store.root / "locks") == [r1.id]
    assert store.meta(r1.id) == {"x": 1}


def test_the_meta_lock_refuses_to_be_taken_twice_by_one_thread(tmp_path: Path) -> None:
    """A flock taken again on another descriptor waits for itself forever: refused instead."""
    from minisandbox.layers.errors import MetaLockHeldError

    store = LayerStore(tmp_path / "store", fsync=False)
    ref = store.publish(golden_tree(tmp_path / "tree"))

    def nested(meta: dict) -> dict:
        return store.update_meta(ref.id, lambda m: {**m, "inner": 1})

    with pytest.raises(MetaLockHeldError):
        store.update_meta(ref.id, nested)
    assert store.update_meta(ref.id, lambda m: {**m, "after": 1}) == {"after": 1}  # released


def test_gc_keeps_a_lock_file_that_is_held(tmp_path: Path) -> None:
    """gc removes an old lock file of a layer that is gone only under the file's own flock: a
    locker holding it keeps it (else a second locker would lock a new file of the same name)."""
    store = LayerStore(tmp_path / "store", fsync=False)
    gone = "ab" * 32
    old = time.time() - 7200
    with store.meta_lock(gone):
        os.utime(store.lock_path(gone), (old, old))
        store.gc(keep=set())
        assert store.lock_path(gone).exists(), "gc removed a lock file while it was held"
    os.utime(store.lock_path(gone), (old, old))
    store.gc(keep=set())
    assert not store.lock_path(gone).exists(), "gc kept an old, unheld lock file"  # control


def test_read_file_reads_one_file_of_a_stored_layer(tmp_path: Path) -> None:
    """Small files share a blob (a pack): each comes back whole from its offset."""
    tree = tmp_path / "tree"
    (tree / "d").mkdir(parents=True)
    files = {"a.txt": b"alpha\n", "d/b.txt": b"beta" * 100, "empty": b""}
    for name, data in files.items():
        (tree / name).write_bytes(data)
    store = LayerStore(tmp_path / "store")
    layer = store.publish(tree).id
    for name, data in files.items():
        assert store.read_file(layer, name) == data
    for absent in ("nope", "d"):  # no such file; a directory
        with pytest.raises(FileNotFoundError):
            store.read_file(layer, absent)


def test_identity_names_one_store_whatever_its_path(tmp_path: Path) -> None:
    a = LayerStore(tmp_path / "a")
    assert a.identity() == a.identity() == LayerStore(tmp_path / "a").identity()
    os.symlink(tmp_path / "a", tmp_path / "mounted-elsewhere")
    assert LayerStore(tmp_path / "mounted-elsewhere").identity() == a.identity()
    assert LayerStore(tmp_path / "b").identity() != a.identity()
    # Many first callers at once agree on one name.
    c = [LayerStore(tmp_path / "c") for _ in range(8)]
    with concurrent.futures.ThreadPoolExecutor(8) as ex:
        assert len(set(ex.map(lambda s: s.identity(), c))) == 1
