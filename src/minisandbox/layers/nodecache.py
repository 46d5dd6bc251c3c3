"""Layers unpacked once per node, shared read-only by every sandbox that uses them.

Layout of `root`:

    layers/<id>/      an unpacked layer; appears by an atomic rename, so it is complete if present
    stamps/<id>       its unpacked size in bytes (eviction never walks trees); mtime = last use
    locks/<id>        flock target: shared = pinned (in use), exclusive = unpacking or evicting
    evict.lock        serialises eviction decisions across the node's processes
    accounts/bytes    what the layers take, as the last full count left it plus the unpacks
                      since: an unpack that fits under the cap by it needs no walk of stamps/
    compat/           the per-node compatibility layer (compat.py)
    tmp/<pid>.<rnd>*  unpacks in progress and evicted trees being deleted; a dead pid's are removed
    io-budget/        state of the default I/O budget ($MINISANDBOX_IO_BUDGET), if set
    pool/             every unpacked file once (pool.py): layers hard-link their files from it,
                      so what layers share (a repository's history packs, identical packages)
                      is written once per node; files no layer holds any more are swept

Every process that uses a layer holds a shared flock on its lock file, on a descriptor of its own,
for as long as it uses it. Whoever finds a layer absent takes the exclusive lock (non-blocking: all
waiting is polling, so no thread ever blocks on a lock), unpacks, and downgrades that lock to its
own pin; everyone else waits for it to finish. Eviction takes the exclusive lock non-blocking too,
so it skips layers in use. Least recently used layers go first, while the cache is over
`max_bytes`; layers in use are never evicted, even when that leaves the cache over its cap (then a
warning is logged and `usage().over_cap` tells). The cap is checked around each unpack, so unpacks
running at once may exceed it briefly. The cap counts each layer at its full size, although
layers share their common files through the pool: the disk holds less than the count says, so
the cap is never exceeded on disk, but eviction may come sooner than it would need to.

For a root caller the cache is root's, mode 0700 (see cacheperms.py); layers are owned by the
uid sandboxes run as. Layers are shared read-only (sandboxes mount them as overlay lower layers);
after a machine crash (not a process crash) an unpacked layer may have lost data that was never
flushed: `clear()` such a cache.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import fcntl
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager
from pathlib import Path

from pydantic import BaseModel

from minisandbox.layers.budget import IOBudget, LocalIOBudget, pid_alive
from minisandbox.layers.cacheperms import make_own, make_private
from minisandbox.layers.filepool import FilePool
from minisandbox.layers.ids import check_layer_id, is_layer_id
from minisandbox.layers.store import LayerStore
from minisandbox.utils.safefs import discard_tree

logger = logging.getLogger(__name__)

# Everything of the cache lives in these (compat/: the per-node compatibility layer; io-budget/:
# the default I/O budget's state), so that a root caller can keep them from its sandboxes' uid.
_PRIVATE = ("layers", "stamps", "locks", "tmp", "pool", "compat", "io-budget", "accounts")
_POLL_MIN = 0.01
_POLL_MAX = 0.2


class CacheUsage(BaseModel):
    bytes: int
    max_bytes: int
    layers: int
    pinned: list[str]
    over_cap: bool


def _try_flock(fd: int, op: int) -> bool:
    try:
        fcntl.flock(fd, op | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


class Lease:
    """Layers pinned for use; `paths` are their directories, in the order asked for."""

    def __init__(self, cache: NodeCache, layer_ids: list[str], fds: dict[str, int]) -> None:
        self.cache = cache
        self.layer_ids = layer_ids
        self.paths = [cache.path(i) for i in layer_ids]
        self._fds = fds

    def release(self) -> None:
        """Unpin (idempotent). Counts as a use for LRU."""
        fds, self._fds = self._fds, {}
        for layer_id, fd in fds.items():
            self.cache._touch(layer_id)
            os.close(fd)  # drops the shared flock

    def __enter__(self) -> list[Path]:
        return self.paths

    def __exit__(self, *exc: object) -> None:
        self.release()


class NodeCache:
    """Unpacked layers under `root`, at most about `max_bytes` of them that are not in use."""

    def __init__(
        self,
        root: Path,
        store: LayerStore,
        *,
        max_bytes: int,
        budget: IOBudget | None = None,
        owner: tuple[int, int] | None = None,
    ) -> None:
        self.root = Path(root)
        self.store = store
        self.max_bytes = max_bytes
        self.owner = owner
        created = not os.path.lexists(self.root)
        for sub in _PRIVATE:
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self.pool = FilePool(self.root / "pool")
        if os.geteuid() == 0:
            uid = None if owner is None else owner[0]
            make_private(self.root, _PRIVATE, created=created, sandbox_uid=uid)
        else:
            make_own(self.root, _PRIVATE, created=created)
        self.budget = (
            budget if budget is not None else LocalIOBudget.from_env(self.root / "io-budget")
        )
        self._sweep_tmp()
        self.unpacked: collections.Counter[str] = collections.Counter()  # by this process

    # paths and bookkeeping

    def path(self, layer_id: str) -> Path:
        return self.root / "layers" / check_layer_id(layer_id)

    def _stamp(self, layer_id: str) -> Path:
        return self.root / "stamps" / layer_id

    def _open_lock(self, layer_id: str) -> int:
        path = self.root / "locks" / layer_id
        return os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)

    def present(self, layer_id: str) -> bool:
        return os.path.isdir(self.root / "layers" / layer_id)

    def _touch(self, layer_id: str) -> None:
        # An explicit time: the kernel's own stamps are coarse (a tick), too coarse for LRU order.
        now = time.time_ns()
        with contextlib.suppress(FileNotFoundError):
            os.utime(self._stamp(layer_id), ns=(now, now))

    def _size(self, layer_id: str) -> int:
        size = self._read_number(self._stamp(layer_id))
        if size is None:
            # A layer without its stamp (removed by hand): measure once, then remember.
            total = 0
            for dirpath, _dirs, files in os.walk(self.root / "layers" / layer_id):
                for name in files:
                    with contextlib.suppress(OSError):
                        total += os.lstat(os.path.join(dirpath, name)).st_size
            self._write_stamp(layer_id, total)
            return total
        return size

    def _write_stamp(self, layer_id: str, size: int) -> None:
        self._write_number(self._stamp(layer_id), size)

    def _write_number(self, path: Path, value: int) -> None:
        """`path` holds `value` (a stamp's size, the count), replaced atomically."""
        tmp = self.root / "tmp" / f"{os.getpid()}.{secrets.token_hex(4)}.number"
        tmp.write_text(str(value))
        os.replace(tmp, path)

    @staticmethod
    def _read_number(path: Path) -> int | None:
        """What `path` holds; None when it is absent or not a number."""
        try:
            return int(path.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def cached(self) -> list[str]:
        return sorted(n for n in os.listdir(self.root / "layers") if is_layer_id(n))

    # acquiring

    async def acquire(self, layer_ids: Sequence[str]) -> Lease:
        """Make the layers present (unpacking what is missing, once per node) and pin them until
        `release`. Concurrent callers, in this process or others, wait for a single unpack."""
        ids = [check_layer_id(i) for i in layer_ids]
        unique = list(dict.fromkeys(ids))
        tasks = [asyncio.ensure_future(self._pin(i)) for i in unique]
        try:
            fds = await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            for result in await asyncio.gather(*tasks, return_exceptions=True):
                if isinstance(result, int):
                    os.close(result)
            raise
        return Lease(self, ids, dict(zip(unique, fds, strict=True)))

    def release(self, lease: Lease) -> None:
        lease.release()

    @asynccontextmanager
    async def use(self, layer_ids: Sequence[str]) -> AsyncIterator[list[Path]]:
        """`async with cache.use(ids) as paths:` the layers' directories, pinned for the block."""
        lease = await self.acquire(layer_ids)
        try:
            yield lease.paths
        finally:
            lease.release()

    def acquire_sync(self, layer_ids: Sequence[str]) -> Lease:
        """`acquire` for code without an event loop (a Lease is also a context manager)."""
        return asyncio.run(self.acquire(layer_ids))

    @contextlib.contextmanager
    def use_sync(self, layer_ids: Sequence[str]) -> Iterator[list[Path]]:
        with self.acquire_sync(layer_ids) as paths:
            yield paths

    async def _pin(self, layer_id: str) -> int:
        """A descriptor holding a shared lock on the present layer."""
        fd = self._open_lock(layer_id)
        unpacking: asyncio.Future[None] | None = None
        try:
            delay = _POLL_MIN
            while True:
                if _try_flock(fd, fcntl.LOCK_SH):
                    if self.present(layer_id):
                        self._touch(layer_id)
                        return fd
                    fcntl.flock(fd, fcntl.LOCK_UN)
                if _try_flock(fd, fcntl.LOCK_EX):
                    fresh = not self.present(layer_id)
                    if fresh:
                        # Shielded: once started, an unpack finishes (and frees its budget)
                        # even if this caller is cancelled; others may be waiting for it.
                        unpacking = asyncio.ensure_future(self._unpack(layer_id))
                        await asyncio.shield(unpacking)
                        unpacking = None
                    # Downgrade to the pin on the same descriptor: with no gap in between, no
                    # evictor can take the layer we just unpacked before we use it.
                    if not _try_flock(fd, fcntl.LOCK_SH):
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    elif fresh:
                        await asyncio.to_thread(self._make_room, 0)
                    delay = _POLL_MIN
                    continue
                await asyncio.sleep(delay)  # another process is unpacking or evicting it
                delay = min(delay * 1.5, _POLL_MAX)
        except BaseException:
            if unpacking is not None and not unpacking.done():
                # Cancelled mid-unpack: keep the exclusive lock until the unpack is over. Its
                # error is nobody's to raise now (retrieved here, or asyncio logs a traceback
                # when the task is collected: an unpack that hit a full disk, say).
                unpacking.add_done_callback(lambda f: _settle_unpack(f, fd))
            else:
                os.close(fd)
            raise

    async def _unpack(self, layer_id: str) -> None:
        """Unpack a layer that is absent; the caller holds its exclusive lock."""
        size = (await asyncio.to_thread(self.store.info, layer_id)).size
        await asyncio.to_thread(self._make_room, size, layer_id)
        if self.budget is None:
            await asyncio.to_thread(self._unpack_blocking, layer_id, size)
        else:
            async with self.budget.reserve(size):
                await asyncio.to_thread(self._unpack_blocking, layer_id, size)

    def _unpack_blocking(self, layer_id: str, size: int) -> None:
        work = self.root / "tmp" / f"{os.getpid()}.{secrets.token_hex(4)}"
        unpacked = False
        try:
            started = time.monotonic()
            work.mkdir()
            self._write_stamp(layer_id, size)  # before the rename: a present layer has a size
            self.store.unpack(layer_id, work / "layer", owner=self.owner, pool=self.pool)
            os.rename(work / "layer", self.root / "layers" / layer_id)
            self._touch(layer_id)
            unpacked = True
            self.unpacked[layer_id] += 1
            logger.info(
                "unpacked layer %s (%d bytes) in %.2fs",
                layer_id,
                size,
                time.monotonic() - started,
            )
        finally:
            discard_tree(work)
            if not unpacked:  # what the failed unpack put in the pool and no layer holds
                with contextlib.suppress(OSError):
                    self.pool.sweep()
            if not unpacked and not self.present(layer_id):
                with contextlib.suppress(FileNotFoundError):
                    self._stamp(layer_id).unlink()
            if not unpacked:  # its bytes were counted in: the next unpack counts afresh
                with contextlib.suppress(FileNotFoundError):
                    self._count_path.unlink()

    # eviction and accounting

    def _entries(self) -> list[tuple[float, str, int]]:
        out = []
        for layer_id in self.cached():
            try:
                mtime = self._stamp(layer_id).stat().st_mtime
            except FileNotFoundError:
                mtime = 0.0
            out.append((mtime, layer_id, self._size(layer_id)))
        return sorted(out)

    def evict(self, need_bytes: int = 0) -> list[str]:
        """Evict least recently used layers not in use until `need_bytes` more fit under the cap.
        Returns the evicted ids."""
        return self._evict(need_bytes, self.max_bytes)

    def _make_room(self, need_bytes: int, layer_id: str | None = None) -> list[str]:
        """`evict(need_bytes)` before the unpack of `layer_id` (None: after one), counting its
        bytes in. The walk of every layer's stamp that eviction needs is skipped while the
        count says they fit: with thousands of layers on a node (a SWE-smith task is one),
        a walk per unpack would cost more than the unpack."""
        return self._evict(need_bytes, self.max_bytes, counted=True, stamp=layer_id)

    @property
    def _count_path(self) -> Path:
        return self.root / "accounts" / "bytes"

    def _read_count(self) -> int | None:
        return self._read_number(self._count_path)

    def _write_count(self, total: int) -> None:
        self._write_number(self._count_path, total)

    def _in_flight(self) -> int:
        """Bytes of unpacks under way (a stamp without its layer, its lock held)."""
        total = 0
        for name in os.listdir(self.root / "stamps"):
            if is_layer_id(name) and not self.present(name):
                total += self._read_number(self._stamp(name)) or 0
        return total

    def _evict(
        self, need_bytes: int, cap: int, counted: bool = False, stamp: str | None = None
    ) -> list[str]:
        """Evict until `need_bytes` more fit under `cap`. With `counted`, by the count alone
        while it fits (then count the bytes in); the full count is written either way, with
        the unpacks under way: it may exceed what is on disk (a crashed unpack), never the
        reverse, so the cap still holds. `stamp` is the layer about to be unpacked (its lock
        held): its stamp is written before the eviction lock is let go, so that a full count
        from then on counts it as under way."""
        evicted: list[str] = []
        trash: list[Path] = []
        lock = os.open(self.root / "evict.lock", os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # held only while deciding and renaming
            known = self._read_count() if counted else None
            if known is not None and known + need_bytes <= cap:
                self._write_count(known + need_bytes)
                if stamp is not None:
                    self._write_stamp(stamp, need_bytes)
                return []
            self._sweep_stamps()
            # Before the layers: an unpack that lands in between is counted twice, not never.
            in_flight = self._in_flight()
            total = self._evict_lru(need_bytes, cap, evicted, trash)
            self._write_count(total + in_flight + (need_bytes if counted else 0))
            if stamp is not None:
                self._write_stamp(stamp, need_bytes)
            if total + need_bytes > cap:
                logger.warning(
                    "node cache %s over its cap: %d bytes in use (+%d needed) > %d; the rest is"
                    " pinned",
                    self.root,
                    total,
                    need_bytes,
                    cap,
                )
        finally:
            os.close(lock)
        for path in trash:
            discard_tree(path)
        if trash:
            # Files that only the evicted layers held. An unpack that races with the sweep
            # re-inserts what it needs (a pool file is linked right after insertion).
            self.pool.sweep()
        if evicted:
            logger.info("evicted layers %s", ", ".join(evicted))
        return evicted

    def _evict_lru(self, need_bytes: int, cap: int, evicted: list[str], trash: list[Path]) -> int:
        """Under the eviction lock: move least recently used layers not in use to tmp/ (into
        `trash`, their ids into `evicted`) until `need_bytes` more fit under `cap`; return
        the bytes the layers left take."""
        entries = self._entries()
        total = sum(size for _m, _i, size in entries)
        for _mtime, layer_id, size in entries:
            if total + need_bytes <= cap:
                break
            fd = self._open_lock(layer_id)
            try:
                if not _try_flock(fd, fcntl.LOCK_EX):
                    continue  # in use, or being unpacked
                if not self.present(layer_id):
                    continue
                target = self.root / "tmp" / f"{os.getpid()}.{secrets.token_hex(4)}.evicted"
                os.rename(self.root / "layers" / layer_id, target)
                with contextlib.suppress(FileNotFoundError):
                    self._stamp(layer_id).unlink()
                trash.append(target)
                evicted.append(layer_id)
                total -= size
            finally:
                os.close(fd)
        return total

    def _sweep_stamps(self) -> None:
        # A stamp without its layer: an unpack that failed or crashed.
        for name in os.listdir(self.root / "stamps"):
            if self.present(name):
                continue
            fd = self._open_lock(name) if is_layer_id(name) else None
            try:
                if fd is None or _try_flock(fd, fcntl.LOCK_EX):
                    with contextlib.suppress(FileNotFoundError):
                        (self.root / "stamps" / name).unlink()
            finally:
                if fd is not None:
                    os.close(fd)

    def _sweep_tmp(self) -> None:
        for name in os.listdir(self.root / "tmp"):
            pid = name.split(".", 1)[0]
            if pid.isdigit() and not pid_alive(int(pid)):
                discard_tree(self.root / "tmp" / name)

    def usage(self) -> CacheUsage:
        entries = self._entries()
        pinned = []
        for _m, layer_id, _s in entries:
            fd = self._open_lock(layer_id)
            try:
                if not _try_flock(fd, fcntl.LOCK_EX):
                    pinned.append(layer_id)
            finally:
                os.close(fd)
        total = sum(size for _m, _i, size in entries)
        return CacheUsage(
            bytes=total,
            max_bytes=self.max_bytes,
            layers=len(entries),
            pinned=pinned,
            over_cap=total > self.max_bytes,
        )

    def clear(self) -> list[str]:
        """Remove every layer not in use, whatever the cap."""
        return self._evict(0, cap=0)


def _settle_unpack(task: asyncio.Future[None], fd: int) -> None:
    """The end of an unpack whose caller was cancelled: release its lock, retrieve its error."""
    if not task.cancelled():
        task.exception()
    os.close(fd)
