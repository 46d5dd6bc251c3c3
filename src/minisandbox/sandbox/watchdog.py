"""The upper-layer watchdog: a sandbox whose writable layer outgrows its caps is stopped.

The upper layer (and the channel directory) are scanned off the event loop, in threads of their
own, at most `_SCAN_MAX_PAUSE` apart whatever a scan costs (a scan stops early at a cap, so its
cost is bounded by the caps too). Between two scans a single file cannot outgrow the byte cap:
RLIMIT_FSIZE is at most the cap (see startup.apply_rlimits).

Scans walk by directory descriptors and never follow a symlink: the tree is the sandbox's.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import errno
import functools
import logging
import os
import stat
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from minisandbox.utils import safefs

logger = logging.getLogger(__name__)


async def watch_upper(
    roots: Sequence[Path],
    max_bytes: int | None,
    max_inodes: int | None,
    *,
    sandbox_id: str,
    running: Callable[[], bool],
) -> str | None:
    """Scan `roots` while `running()`; return why the sandbox must stop once they hold more
    than `max_bytes` bytes of blocks or more than `max_inodes` files and directories (None if
    it stopped running first). The first scan comes one short pause after the start, not at
    once: it would compete with the sandbox's first command for nothing (a fresh upper is
    empty; a kept one is caught then)."""
    loop = asyncio.get_running_loop()
    failures = 0
    await asyncio.sleep(_SCAN_MIN_PAUSE)
    while running():
        began = time.monotonic()
        try:
            scan = await loop.run_in_executor(
                _scan_pool(), disk_usage, roots, max_bytes, max_inodes
            )
        except OSError as e:  # e.g. out of descriptors: try again at the next poll
            logger.warning("cannot measure the upper layer of sandbox %s: %s", sandbox_id, e)
            failures += 1
            if failures >= _SCAN_MAX_FAILURES:  # an upper that cannot be measured is not capped
                return (
                    f"sandbox {sandbox_id}: its upper layer could not be measured "
                    f"{failures} times in a row ({e}); it was stopped"
                )
        else:
            failures = 0
            if scan.breach is not None:
                return _breach_message(sandbox_id, scan, max_bytes, max_inodes)
        took = time.monotonic() - began
        # Scans cost CPU: at most a third of a thread's time, but never more than
        # _SCAN_MAX_PAUSE apart.
        await asyncio.sleep(min(_SCAN_MAX_PAUSE, max(_SCAN_MIN_PAUSE, 2 * took)))
    return None


# The upper-layer watchdog: pauses between scans, and how deep it follows directories (one
# descriptor per level is held while scanning; deeper nesting stops the sandbox, as it would
# otherwise hide what lies below from the count).
_SCAN_MIN_PAUSE = 0.25
_SCAN_MAX_PAUSE = 1.0
_SCAN_MAX_DEPTH = 256
_SCAN_MAX_FAILURES = 5
_UNREADABLE = -2  # _open_scan_dir: a directory that not even its owner could open
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@functools.cache
def _scan_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads of their own for upper-layer scans: a slow scan must not hold up the default
    executor, which sandbox starts use."""
    return concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="minisandbox-upper-scan")


@dataclasses.dataclass
class Usage:
    """What a scan counted, and where it stopped."""

    bytes: int = 0
    inodes: int = 0
    # "bytes", "inodes", "depth" or "unreadable" (a directory not even its owner could open):
    # the scan stopped there
    breach: str | None = None


class _StopScan(Exception):
    """Ends a scan at its first breach (never leaves this module)."""


class _Scan:
    def __init__(self, max_bytes: int | None, max_inodes: int | None) -> None:
        self.usage = Usage()
        self._max_bytes = max_bytes
        self._max_inodes = max_inodes
        self._linked: set[tuple[int, int]] = set()

    def count(self, st: os.stat_result) -> None:
        if st.st_nlink > 1 and not stat.S_ISDIR(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if key in self._linked:
                return
            self._linked.add(key)
        usage = self.usage
        usage.inodes += 1
        usage.bytes += st.st_blocks * 512
        if self._max_inodes is not None and usage.inodes > self._max_inodes:
            usage.breach = "inodes"
        elif self._max_bytes is not None and usage.bytes > self._max_bytes:
            usage.breach = "bytes"
        if usage.breach:
            raise _StopScan

    def visit(self, fd: int, depth: int) -> None:
        subdirs = []
        with os.scandir(fd) as it:
            for entry in it:
                try:
                    st = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                self.count(st)
                if stat.S_ISDIR(st.st_mode):
                    subdirs.append((entry.name, stat.S_IMODE(st.st_mode)))
        for name, mode in subdirs:
            child, lent = _open_scan_dir(fd, name, searchable=mode & 0o500 == 0o500)
            if child == _UNREADABLE:  # what cannot be measured is not capped
                self.usage.breach = "unreadable"
                raise _StopScan
            if child < 0:
                continue
            try:
                if depth >= _SCAN_MAX_DEPTH:
                    self.usage.breach = "depth"
                    raise _StopScan
                self.visit(child, depth + 1)
            finally:
                if lent:  # its mode back, once its entries are measured
                    with contextlib.suppress(OSError):
                        os.fchmod(child, mode)
                os.close(child)


def disk_usage(
    roots: Sequence[Path], max_bytes: int | None = None, max_inodes: int | None = None
) -> Usage:
    """Bytes allocated (blocks) and inodes under `roots`, stopping as soon as either passes its
    cap. Walks by directory descriptors and never follows a symlink; a file with several hard
    links counts once. A directory that its owner made unreadable (mode 000, the sandbox's
    own right) is measured with its owner's rwx lent, and given its mode back; a vanished one
    counts as nothing.

    Raises:
        OSError: a directory could not be opened for another reason (e.g. out of descriptors).
    """
    scan = _Scan(max_bytes, max_inodes)
    for root in roots:
        try:
            fd = os.open(root, _DIR_FLAGS)
        except FileNotFoundError:
            continue
        try:
            scan.visit(fd, 1)
        except _StopScan:
            return scan.usage
        finally:
            os.close(fd)
    return scan.usage


def _open_scan_dir(parent: int, name: str, *, searchable: bool) -> tuple[int, bool]:
    """A descriptor of the directory `name` in `parent` (-1 if it is gone or was replaced by
    something else: the next scan sees what it became), and whether its owner's rwx was lent
    to open it (the caller gives its mode back once done). A directory its owner may not both
    read and search (`searchable` false: 0o444, 0o600...) is lent rwx at once: it may open,
    but its entries could not be measured."""
    try:
        if searchable or os.geteuid() == 0:  # (root reads and searches any directory)
            return os.open(name, _DIR_FLAGS, dir_fd=parent), False
    except (FileNotFoundError, NotADirectoryError):
        return -1, False
    except OSError as e:
        if e.errno == errno.ELOOP:
            return -1, False
        if e.errno != errno.EACCES:
            raise
    # Not readable and searchable by us, its owner (a root caller is never refused).
    fd = safefs.open_dir_as_owner(parent, name)
    return (fd, True) if fd >= 0 else (_UNREADABLE, False)


def _breach_message(
    sandbox_id: str, usage: Usage, max_bytes: int | None, max_inodes: int | None
) -> str:
    if usage.breach == "inodes":
        return (
            f"sandbox {sandbox_id} created more than {max_inodes} files and directories in its "
            f"upper layer (Limits.upper_inodes={max_inodes}); it was stopped. Raise "
            "Limits.upper_inodes to allow more"
        )
    if usage.breach == "unreadable":
        return (
            f"sandbox {sandbox_id} made a directory of its upper layer that its size watchdog "
            "cannot open, so cannot measure; it was stopped"
        )
    if usage.breach == "depth":
        return (
            f"sandbox {sandbox_id} nested directories more than {_SCAN_MAX_DEPTH} deep in its "
            "upper layer, deeper than its size watchdog measures; it was stopped"
        )
    return (
        f"sandbox {sandbox_id} wrote more than {max_bytes} bytes to its upper layer "
        f"(Limits.upper_bytes={max_bytes}); it was stopped. Raise Limits.upper_bytes to allow more"
    )
