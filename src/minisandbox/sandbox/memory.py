"""Whole-sandbox memory where no cgroup can be had: a share of the host's memory per sandbox,
watched from the host, and the kernel's OOM killer pointed at sandboxes first.

With a delegated cgroup v2 (cgroups.py) the kernel caps the sandbox at `total_memory_bytes`.
Without one, this watchdog sums the private resident memory (resident minus shared pages: what
a memory hog allocates) of every process in the sandbox, walking its process tree from pid 1,
every `POLL_S`, and the sandbox is stopped once the sum passes the cap; a sandbox may overshoot
by what it allocates within one poll. Its /tmp and /dev/shm (memory too) are capped by their
own sizes. Every sandbox process also gets the highest OOM score adjustment, so that if the
host runs out of memory all the same, the kernel kills a sandbox's largest process, never the
host's own work (the caller, a trainer, a shell).

The default cap (`total_memory_bytes` unset) is `default_share()`: 80% of the host's memory
divided by the node's slots ($MINISANDBOX_SLOTS, else its CPU count), at least 4 GiB; 0 turns
the cap off. Build sandboxes get half the host's memory and a /tmp of at most a quarter.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable

POLL_S = 0.25
OOM_SCORE_ADJ = 1000
_PAGE = os.sysconf("SC_PAGE_SIZE")


def host_memory() -> int:
    """The host's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def slots() -> int:
    """How many sandboxes the node runs at once, for sizing defaults: $MINISANDBOX_SLOTS, else
    its CPU count."""
    given = os.environ.get("MINISANDBOX_SLOTS", "")
    return int(given) if given.isdigit() and int(given) > 0 else (os.cpu_count() or 1)


# The smallest default cap: one process at the default per-process limit (Limits.memory_bytes)
# must fit, or a many-core host with little memory would fail test suites, silently, as 0.
MIN_SHARE = 4 * 1024**3


def default_share() -> int:
    """A sandbox's default whole-memory cap: 80% of the host's memory over the node's slots,
    at least MIN_SHARE (then the OOM killer's order is what protects the host)."""
    return max(MIN_SHARE, int(host_memory() * 0.8) // slots())


def point_oom_killer_at(pid: int) -> None:
    """Give `pid` (a sandbox's pid 1, before anything runs: its children inherit it) the
    highest OOM score adjustment. Raising it needs no privilege."""
    with open(f"/proc/{pid}/oom_score_adj", "w") as f:
        f.write(str(OOM_SCORE_ADJ))


def tree_memory(pid: int) -> int:
    """Private resident bytes (resident minus shared pages) of `pid` and its descendants."""
    total = 0
    todo, seen = [pid], set()
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        try:
            with open(f"/proc/{current}/statm") as f:
                fields = f.read().split()
            total += max(0, int(fields[1]) - int(fields[2])) * _PAGE
            tids = os.listdir(f"/proc/{current}/task")
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        for tid in tids:
            with (
                contextlib.suppress(OSError, ValueError),
                open(f"/proc/{current}/task/{tid}/children") as f,
            ):
                todo += [int(c) for c in f.read().split()]
    return total


async def watch_memory(
    pid: int, cap: int, *, sandbox_id: str, running: Callable[[], bool]
) -> str | None:
    """Poll the memory of the sandbox whose pid 1 is host pid `pid` while `running()`; return
    why it must stop once it holds more than `cap` bytes (None if it stopped first). The first
    look is one poll after the start: a sandbox that just started holds its control shell
    alone, and a thread's work then would only compete with its first command."""
    while running():
        await asyncio.sleep(POLL_S)
        if not running():
            break
        used = await asyncio.to_thread(tree_memory, pid)
        if used > cap:
            return (
                f"sandbox {sandbox_id} used {used >> 20} MiB of memory, more than its "
                f"Limits.total_memory_bytes={cap} ({cap >> 20} MiB); it was stopped. Raise "
                "total_memory_bytes (0: no cap) or MINISANDBOX_SLOTS' share"
            )
    return None
