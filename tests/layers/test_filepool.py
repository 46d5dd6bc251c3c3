"""The node's file pool: layers unpacked with it hold each file once (hard links), insertions
are atomic, concurrent inserters make one file, and sweep/verify keep it honest."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from minisandbox.layers.filepool import FilePool, pool_name
from minisandbox.layers.store import LayerStore


def _tree(root: Path, extra: str) -> Path:
    (root / "pkg").mkdir(parents=True)
    for i in range(40):
        (root / "pkg" / f"m{i}.py").write_text(f"x = {i}\n" * 20)
    (root / "big.bin").write_bytes(os.urandom(100_000))
    (root / "own.txt").write_text(extra)
    (root / "empty").write_text("")
    return root


def _inode(path: Path) -> int:
    return os.stat(path).st_ino


def test_layers_share_unpacked_files(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    a = _tree(tmp_path / "a", "a")
    b = tmp_path / "b"
    os.system(f"cp -a {a} {b}")
    (b / "own.txt").write_text("b")
    la, lb = store.publish(a), store.publish(b)
    pool = FilePool(tmp_path / "cache" / "pool")
    ua = store.unpack(la.id, tmp_path / "cache" / "A", pool=pool)
    files_after_a = pool.usage()[0]
    ub = store.unpack(lb.id, tmp_path / "cache" / "B", pool=pool)
    assert _inode(ua / "big.bin") == _inode(ub / "big.bin")
    assert _inode(ua / "pkg/m3.py") == _inode(ub / "pkg/m3.py")
    assert _inode(ua / "own.txt") != _inode(ub / "own.txt")
    assert (ub / "own.txt").read_text() == "b" and (ua / "pkg/m7.py").read_text() == "x = 7\n" * 20
    assert pool.usage()[0] == files_after_a + 1, "B wrote more than its one new file"
    # A layer without the pool (positive control) gets files of its own.
    uc = store.unpack(la.id, tmp_path / "cache" / "C")
    assert _inode(uc / "big.bin") != _inode(ua / "big.bin")
    assert pool.verify(store.read_blob) == []
    # Removing a layer's tree leaves the pool files of the other; sweep drops unused ones.
    os.system(f"rm -rf {ua}")
    removed, _ = pool.sweep()
    assert removed == 1  # a's own.txt
    assert (ub / "big.bin").exists()
    os.system(f"rm -rf {ub}")
    pool.sweep()
    assert pool.usage()[0] == 0


def _insert(root: str, dest: str, barrier) -> None:  # type: ignore[no-untyped-def]
    pool = FilePool(Path(root))
    barrier.wait()

    def make(fd: int) -> None:
        os.write(fd, b"same content\n")
        os.close(fd)
        barrier.wait()  # all four have written their own copy: they race to insert it

    pool.link_into("f" * 64 + "-644-0-0.0", dest, make)


def test_concurrent_insertion_makes_one_file_and_a_failed_one_leaves_the_pool_as_it_was(
    tmp_path: Path,
) -> None:
    root = tmp_path / "pool"
    FilePool(root)
    barrier = multiprocessing.Barrier(4)
    procs = [
        multiprocessing.Process(target=_insert, args=(str(root), str(tmp_path / f"d{i}"), barrier))
        for i in range(4)
    ]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    inodes = {_inode(tmp_path / f"d{i}") for i in range(4)}
    assert len(inodes) == 1 and (tmp_path / "d0").read_bytes() == b"same content\n"
    pool = FilePool(root)
    assert pool.usage()[0] == 1
    assert sorted(os.listdir(tmp_path)) == ["d0", "d1", "d2", "d3", "pool"]  # no spare left

    # An insertion that fails half-way (a corrupt blob, a full disk) leaves its half-written
    # file where the caller wanted it (a tree it removes), never under a pool name.
    def half(fd: int) -> None:
        os.write(fd, b"half")
        os.close(fd)
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        pool.link_into("e" * 64 + "-644-0-0.0", str(tmp_path / "e"), half)
    assert pool.usage()[0] == 1 and not pool.has("e" * 64 + "-644-0-0.0")
    # Positive control: the same insertion completed is in the pool.
    pool.link_into("e" * 64 + "-644-0-0.0", str(tmp_path / "e2"), lambda fd: os.close(fd))
    assert pool.usage()[0] == 2 and pool.has("e" * 64 + "-644-0-0.0")


def test_verify_finds_a_corrupt_pool_file(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store", fsync=False)
    layer = store.publish(_tree(tmp_path / "a", "a"))
    pool = FilePool(tmp_path / "cache" / "pool")
    tree = store.unpack(layer.id, tmp_path / "cache" / "A", pool=pool)
    assert pool.verify(store.read_blob) == []
    victim = tree / "pkg" / "m1.py"
    os.chmod(victim, 0o644)
    victim.write_text("tampered\n")
    problems = pool.verify(store.read_blob)
    assert len(problems) == 1 and "does not match" in problems[0]


def test_pool_names_ignore_setid_bits() -> None:
    assert pool_name("a" * 64, 0o4755, 1, (0, 0)) == pool_name("a" * 64, 0o755, 1, (0, 0))


def test_cache_verify_checks_the_pool(tmp_path: Path) -> None:
    import subprocess
    import sys

    store = LayerStore(tmp_path / "store", fsync=False)
    layer = store.publish(_tree(tmp_path / "a", "a"))
    pool = FilePool(tmp_path / "cache" / "pool")
    tree = store.unpack(layer.id, tmp_path / "cache" / "layers" / layer.id, pool=pool)
    cmd = [sys.executable, "-m", "minisandbox.cli", "cache", "verify"]
    cmd += ["--store", str(tmp_path / "store"), "--cache", str(tmp_path / "cache")]
    ok = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "0 problems" in ok.stdout, ok.stdout + ok.stderr
    os.chmod(tree / "big.bin", 0o644)
    (tree / "big.bin").write_bytes(b"tampered")
    bad = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 1 and "does not match its name" in bad.stdout, bad.stdout
