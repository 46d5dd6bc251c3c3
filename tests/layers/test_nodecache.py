"""The node cache with real processes: one unpack per layer per node, pins, LRU eviction."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from minisandbox.layers.budget import LocalIOBudget
from minisandbox.layers.errors import LayerIdError, LayerNotFoundError
from minisandbox.layers.nodecache import NodeCache
from minisandbox.layers.store import CorruptLayerError, LayerStore

SRC = str(Path(__file__).resolve().parents[2] / "src")
MiB = 1 << 20


class RecordingStore(LayerStore):
    """A real store that also notes each unpack (start, end) in a marker file."""

    def __init__(self, root: Path, marker: Path, delay: float = 0.0) -> None:
        super().__init__(root)
        self.marker = marker
        self.delay = delay

    def unpack(self, layer_id: str, dest: Path, **kw: Any) -> Path:
        start = time.time()
        time.sleep(self.delay)
        out = super().unpack(layer_id, dest, **kw)
        with open(self.marker, "a") as fh:
            fh.write(f"{os.getpid()} {layer_id} {start} {time.time()}\n")
        return out


def unpacks(marker: Path) -> list[list[str]]:
    return [line.split() for line in marker.read_text().splitlines()] if marker.exists() else []


def make_layer(store: LayerStore, tmp: Path, name: str, size: int) -> str:
    src = tmp / f"src-{name}"
    (src / "data").mkdir(parents=True)
    (src / "data" / "blob.bin").write_bytes(os.urandom(size))
    (src / "data" / "name.txt").write_text(name)
    return store.publish(src).id


CLIENT = textwrap.dedent(
    """
    import os, sys, time
    from pathlib import Path
    sys.path.insert(0, sys.argv[1])
    from minisandbox.layers.nodecache import NodeCache
    from minisandbox.layers.store import LayerStore

    class RecordingStore(LayerStore):
        def unpack(self, layer_id, dest, **kw):
            start = time.time()
            time.sleep(0.3)  # a slow unpack: everyone else arrives while it runs
            out = super().unpack(layer_id, dest, **kw)
            with open(sys.argv[5], "a") as fh:
                fh.write(f"{os.getpid()} {layer_id} {start} {time.time()}\\n")
            return out

    store, cache_root, layer = Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4]
    cache = NodeCache(cache_root, RecordingStore(store), max_bytes=1 << 30)
    Path(sys.argv[6], str(os.getpid())).touch()  # ready
    while not Path(sys.argv[6], "go").exists():
        time.sleep(0.002)
    with cache.use_sync([layer]) as paths:
        print((paths[0] / "data" / "name.txt").read_text(), flush=True)
        if len(sys.argv) > 7:  # hold the pin until killed
            time.sleep(60)
    """
)


def spawn_client(tmp: Path, layer: str, barrier: Path, *extra: str) -> subprocess.Popen[str]:
    args = [SRC, str(tmp / "store"), str(tmp / "cache"), layer, str(tmp / "marker"), str(barrier)]
    return subprocess.Popen(
        [sys.executable, "-c", CLIENT, *args, *extra], stdout=subprocess.PIPE, text=True
    )


def test_processes_share_one_unpack(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    layer = make_layer(store, tmp_path, "shared", 4 * MiB)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    procs = [spawn_client(tmp_path, layer, barrier) for _ in range(4)]
    try:
        deadline = time.monotonic() + 20
        while len(list(barrier.iterdir())) < len(procs):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (barrier / "go").touch()
        outs = [p.communicate(timeout=30)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in procs] == [0] * 4
    assert [o.strip() for o in outs] == ["shared"] * 4
    assert len(unpacks(tmp_path / "marker")) == 1
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)
    assert cache.cached() == [layer]
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []


async def test_coroutines_share_one_unpack(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    store = RecordingStore(tmp_path / "store", marker, delay=0.2)
    a = make_layer(store, tmp_path, "a", MiB)
    b = make_layer(store, tmp_path, "b", MiB)
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)

    async def user(ids: list[str]) -> list[str]:
        async with cache.use(ids) as paths:
            await asyncio.sleep(0.05)
            return [(p / "data" / "name.txt").read_text() for p in paths]

    results = await asyncio.gather(*(user([a, b]) for _ in range(5)), user([b]))
    assert results == [["a", "b"]] * 5 + [["b"]]
    assert sorted(line[1] for line in unpacks(marker)) == sorted([a, b])
    assert cache.usage().pinned == []


async def test_unpacks_go_through_the_budget(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    store = RecordingStore(tmp_path / "store", marker, delay=0.1)
    ids = [make_layer(store, tmp_path, str(i), MiB) for i in range(3)]
    budget = LocalIOBudget(tmp_path / "budget", MiB + MiB // 2)  # room for one layer at a time
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30, budget=budget)
    async with cache.use(ids) as paths:
        assert [(p / "data" / "name.txt").read_text() for p in paths] == ["0", "1", "2"]
    spans = sorted((float(s), float(e)) for _pid, _id, s, e in unpacks(marker))
    assert len(spans) == 3
    for (_s1, end), (start, _e2) in itertools.pairwise(spans):
        assert start >= end  # one at a time: two layers never fit the budget together
    assert budget.in_flight() == 0


def test_lru_eviction_and_pins(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    store = LayerStore(tmp_path / "store")
    l1, l2, l3 = (make_layer(store, tmp_path, n, MiB) for n in ("l1", "l2", "l3"))
    cache = NodeCache(tmp_path / "cache", store, max_bytes=2 * MiB + MiB // 2)

    def use(*ids: str) -> None:
        with cache.use_sync(list(ids)):
            pass
        time.sleep(0.01)  # distinct stamps

    use(l1)
    use(l2)
    use(l3)  # l1 is the least recently used: it goes
    assert set(cache.cached()) == {l2, l3}
    use(l2)  # now l3 is the oldest
    use(l1)
    assert set(cache.cached()) == {l1, l2}

    # A pinned layer is never evicted, even when it is the oldest.
    held = cache.acquire_sync([l2])
    time.sleep(0.01)
    use(l1)
    use(l3)  # l2 (oldest, pinned) stays; l1 goes
    assert set(cache.cached()) == {l2, l3}

    # Everything pinned and over the cap: nothing is evicted, and it is reported.
    with (
        caplog.at_level(logging.WARNING, logger="minisandbox.layers.nodecache"),
        cache.use_sync([l1, l3]) as paths,
    ):
        assert all(p.is_dir() for p in paths)
        usage = cache.usage()
        assert usage.over_cap and sorted(usage.pinned) == sorted([l1, l2, l3])
        assert set(cache.cached()) == {l1, l2, l3}
    assert "over its cap" in caplog.text
    held.release()  # the most recent use now: l1 or l3 goes
    evicted = cache.evict()
    assert len(evicted) == 1 and evicted[0] in (l1, l3)
    assert not cache.usage().over_cap
    assert cache.clear() and cache.cached() == []


def test_pin_held_by_another_process(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    layer = make_layer(store, tmp_path, "pinned", MiB)
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    (barrier / "go").touch()
    proc = spawn_client(tmp_path, layer, barrier, "hold")
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "pinned"
        cache = NodeCache(tmp_path / "cache", store, max_bytes=0)
        assert cache.evict() == []
        assert cache.usage().pinned == [layer]
        proc.kill()
        proc.wait()
        assert cache.evict() == [layer]  # the kernel dropped the dead process's pin
        assert cache.cached() == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_corrupt_layer_leaves_cache_clean(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    bad = make_layer(store, tmp_path, "bad", MiB)
    good = make_layer(store, tmp_path, "good", MiB)
    doc = store.manifest(bad)
    blob = store.blob_path(doc["blobs"][0])
    os.chmod(blob, 0o644)
    os.truncate(blob, blob.stat().st_size - 10)
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)
    with pytest.raises(CorruptLayerError), cache.use_sync([good, bad]):
        pass
    assert cache.cached() in ([], [good])
    assert not cache.usage().pinned
    assert list((tmp_path / "cache" / "tmp").iterdir()) == []
    assert sorted(os.listdir(tmp_path / "cache" / "stamps")) == cache.cached()
    # What the failed unpack had counted in is not left in the count: the count is gone (the
    # next unpack counts afresh) or was counted afresh already (by the good layer's unpack).
    count = tmp_path / "cache" / "accounts" / "bytes"
    assert not count.exists() or int(count.read_text()) == cache.usage().bytes
    with cache.use_sync([good]) as paths:
        assert (paths[0] / "data" / "name.txt").read_text() == "good"


def test_layer_ids_are_checked_before_any_path_is_made(tmp_path: Path) -> None:
    store = LayerStore(tmp_path / "store")
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)
    for bad in ("../../etc", "0" * 63, "A" * 64):
        with pytest.raises(LayerIdError):
            cache.path(bad)
        with pytest.raises(LayerNotFoundError), cache.use_sync([bad]):  # as it always was
            pass
    assert os.listdir(tmp_path / "cache" / "locks") == []
    (tmp_path / "cache" / "layers" / "not-a-layer").mkdir()  # ignored, as any stray name
    assert cache.cached() == []


@pytest.mark.skipif(os.geteuid() != 0, reason="only a root caller's cache is made root's")
async def test_root_callers_cache_is_roots_alone(tmp_path: Path) -> None:
    """Its layers belong to the sandboxes' host uid; the directories above them are root's,
    mode 0700, so that uid cannot reach them from the host (attack_mapped_uid_writes_node_cache
    tries). A cache root the sandboxes' uid owned is taken back."""
    store = LayerStore(tmp_path / "store")
    layer = make_layer(store, tmp_path, "a", 1024)
    owner = (1500000000, 1500000000)
    (tmp_path / "cache").mkdir()
    os.chown(tmp_path / "cache", *owner)
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30, owner=owner)
    async with cache.use([layer]) as (path,):
        assert (path.stat().st_uid, path.stat().st_gid) == owner
    for sub in ("", "layers", "stamps", "locks", "tmp", "pool", "compat", "io-budget", "accounts"):
        st = (tmp_path / "cache" / sub).stat()
        assert (st.st_uid, st.st_mode & 0o7777) == (0, 0o700), sub
    assert (tmp_path / "cache" / "evict.lock").stat().st_mode & 0o777 == 0o600
    # A root that is not that uid's (a shared directory) keeps its mode: only what the cache
    # puts in it is made private.
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    NodeCache(shared, store, max_bytes=1 << 30, owner=owner)
    assert shared.stat().st_mode & 0o7777 == 0o755
    assert (shared / "layers").stat().st_mode & 0o7777 == 0o700


def test_an_unpack_that_fits_by_the_count_walks_no_stamps(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With thousands of layers on a node (SWE-smith's tasks are one each), walking every
    layer's stamp at each unpack would cost more than the unpack: the count goes instead."""
    store = LayerStore(tmp_path / "store")
    layers = [make_layer(store, tmp_path, f"l{i}", 4096) for i in range(6)]
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)
    walks: list[int] = []
    real = NodeCache._entries

    def counting(self: NodeCache) -> list[tuple[float, str, int]]:
        walks.append(1)
        return real(self)

    monkeypatch.setattr(NodeCache, "_entries", counting)
    for layer in layers:
        with cache.use_sync([layer]):
            pass
    assert len(walks) == 1, walks  # the first unpack: there was no count yet
    count = tmp_path / "cache" / "accounts" / "bytes"
    assert (
        int(count.read_text())
        == cache.usage().bytes
        == sum(store.info(layer).size for layer in layers)
    )
    # Without a count (an unpack failed, say), the next unpack counts afresh.
    count.unlink()
    walks.clear()
    with cache.use_sync([make_layer(store, tmp_path, "l6", 4096)]):
        pass
    assert len(walks) == 1 and int(count.read_text()) == cache.usage().bytes


def test_a_full_count_during_an_unpack_still_counts_it(tmp_path: Path) -> None:
    """Between making room for an unpack and the unpack itself (waiting for the I/O budget),
    another process's full count must count it: otherwise the count stays low and the cache
    goes over its cap until it is counted again."""
    import fcntl

    store = LayerStore(tmp_path / "store")
    cached, coming = (make_layer(store, tmp_path, n, 4096) for n in ("cached", "coming"))
    size = store.info(coming).size
    cache = NodeCache(tmp_path / "cache", store, max_bytes=1 << 30)
    with cache.use_sync([cached]):
        pass
    fd = cache._open_lock(coming)  # as _pin holds it for the unpack
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        cache._make_room(size, coming)
        cache.evict()  # a full count, from anyone, meanwhile
        cache._unpack_blocking(coming, size)
    finally:
        os.close(fd)
    count = int((tmp_path / "cache" / "accounts" / "bytes").read_text())
    assert count >= cache.usage().bytes == store.info(cached).size + size
