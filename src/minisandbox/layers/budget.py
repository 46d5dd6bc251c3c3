"""How many bytes may be unpacked at once: an I/O budget shared by the processes of a node.

`IOBudget` is the whole interface (`async with budget.reserve(nbytes):`), so that a cluster-wide
implementation can stand in for `LocalIOBudget`, which covers one node: a size-weighted semaphore
whose state is a small JSON file guarded by `fcntl.flock`. Holders are keyed by pid (plus the
process's start time, against pid reuse) and a token; entries of dead processes are dropped on
every look, so a crashed holder never leaks budget. Waiters queue in arrival order (FIFO: a large
request is not starved by a stream of small ones) and poll with a short backoff. A request larger
than the whole limit is admitted alone, when nothing else is in flight.

All processes sharing a budget must see the same pids (one pid namespace).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import re
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Iterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

from minisandbox.layers.errors import IOBudgetError, IOBudgetStateError
from minisandbox.utils.procfs import start_time

ENV_VAR = "MINISANDBOX_IO_BUDGET"
_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4, "P": 1024**5}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([KMGTP]?)(?:I?B)?\s*$", re.IGNORECASE)
_POLL_MIN = 0.005
_POLL_MAX = 0.1


def parse_size(text: str | int) -> int:
    """Bytes from "2G", "512M", "1.5GiB", "100k" or "4096" (binary units: K = 1024)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise IOBudgetError(f"cannot parse size {text!r} (expected e.g. 4096, 512M, 2G)")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


class IOBudget(ABC):
    """Admits work weighted by bytes; `reserve` waits until `nbytes` fit."""

    @abstractmethod
    def reserve(self, nbytes: int) -> AbstractAsyncContextManager[None]:
        """`async with budget.reserve(n):` holds n bytes of the budget for the block."""


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (perhaps another user's)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _alive(pid: int, start: str) -> bool:
    if os.path.isdir("/proc/self"):
        now = start_time(pid, unreadable="")
        return now is not None and (not start or not now or now == start)
    return pid_alive(pid)


class NodeSemaphore:
    """At most `limit_bytes` units reserved at once across every process using `state_dir`,
    admitted first come first served; a dead process's reservations stop counting. The I/O
    budget counts bytes with it (LocalIOBudget), a node's sandbox capacity sandboxes."""

    def __init__(self, state_dir: Path, limit_bytes: int | str) -> None:
        self.limit = parse_size(limit_bytes)
        if self.limit < 1:
            raise IOBudgetError(f"budget limit must be at least 1 byte, not {self.limit}")
        self.state_dir = Path(state_dir)
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self._lock_path = self.state_dir / "io-budget.lock"
        self._state_path = self.state_dir / "io-budget.json"
        self._me: tuple[int, str] | None = None

    # state, always read and written under the lock

    @contextlib.contextmanager
    def _locked(self) -> Iterator[dict[str, Any]]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                state = json.loads(self._state_path.read_bytes())
            except (FileNotFoundError, ValueError):
                state = {}
            holders = [h for h in state.get("holders", []) if _alive(h["pid"], h["start"])]
            queue = [w for w in state.get("queue", []) if _alive(w["pid"], w["start"])]
            state = {"holders": holders, "queue": queue, "peak": state.get("peak", 0)}
            before = json.dumps(state, sort_keys=True)
            yield state
            after = json.dumps(state, sort_keys=True)
            if after != before or not self._state_path.exists():
                # Rename over the old state: a crash mid-write never leaves half a file.
                tmp = self.state_dir / f"io-budget.json.{os.getpid()}.tmp"
                tmp.write_text(after)
                os.replace(tmp, self._state_path)
        finally:
            os.close(fd)  # releases the flock

    def _identity(self) -> tuple[int, str]:
        # Looked up per pid, not once: a forked child must not queue under its parent's name.
        pid = os.getpid()
        if self._me is None or self._me[0] != pid:
            self._me = (pid, start_time(pid, unreadable="") or "")
        return self._me

    def _enqueue(self, token: str, nbytes: int) -> None:
        pid, start = self._identity()
        with self._locked() as state:
            entry = {"pid": pid, "start": start, "token": token, "nbytes": nbytes}
            state["queue"].append(entry)

    def _try_admit(self, token: str) -> bool:
        with self._locked() as state:
            queue = state["queue"]
            if not queue or queue[0]["token"] != token:
                if not any(w["token"] == token for w in queue):
                    raise IOBudgetStateError(
                        f"budget ticket {token} vanished from {self._state_path}"
                    )
                return False
            head = queue[0]
            in_flight = sum(h["nbytes"] for h in state["holders"])
            if state["holders"] and in_flight + head["nbytes"] > self.limit:
                return False
            state["holders"].append(queue.pop(0))
            # The high-water mark of bytes in flight, for a node's operators and benchmarks
            # (above the limit only when one request larger than the limit ran alone).
            state["peak"] = max(state["peak"], in_flight + head["nbytes"])
            return True

    def _remove(self, token: str) -> None:
        with self._locked() as state:
            state["holders"] = [h for h in state["holders"] if h["token"] != token]
            state["queue"] = [w for w in state["queue"] if w["token"] != token]

    def in_flight(self) -> int:
        """Bytes reserved right now by live holders."""
        with self._locked() as state:
            return sum(h["nbytes"] for h in state["holders"])

    def peak(self) -> int:
        """The most bytes ever reserved at once through this budget's state directory."""
        with self._locked() as state:
            return int(state["peak"])

    def waiting(self) -> int:
        with self._locked() as state:
            return len(state["queue"])

    # the API

    @asynccontextmanager
    async def reserve(self, nbytes: int) -> AsyncIterator[None]:
        if nbytes <= 0:
            yield
            return
        token = secrets.token_hex(8)
        # The lock is held for microseconds, but it is a blocking call: keep it off the loop.
        await asyncio.to_thread(self._enqueue, token, nbytes)
        try:
            delay = _POLL_MIN
            while not await asyncio.to_thread(self._try_admit, token):
                await asyncio.sleep(delay)
                delay = min(delay * 1.5, _POLL_MAX)
            yield
        finally:
            # Synchronous on purpose: it must also run when the waiting task is cancelled.
            self._remove(token)

    @contextlib.contextmanager
    def reserve_blocking(self, nbytes: int) -> Iterator[None]:
        """`reserve` for threads and scripts without an event loop."""
        if nbytes <= 0:
            yield
            return
        token = secrets.token_hex(8)
        self._enqueue(token, nbytes)
        try:
            delay = _POLL_MIN
            while not self._try_admit(token):
                time.sleep(delay)
                delay = min(delay * 1.5, _POLL_MAX)
            yield
        finally:
            self._remove(token)


class LocalIOBudget(NodeSemaphore, IOBudget):
    """At most `limit_bytes` being unpacked at once across every process using `state_dir`."""

    @classmethod
    def from_env(cls, state_dir: Path) -> LocalIOBudget | None:
        """A budget of $MINISANDBOX_IO_BUDGET bytes, or None when unset (no throttling)."""
        value = os.environ.get(ENV_VAR, "").strip()
        return cls(state_dir, value) if value else None
