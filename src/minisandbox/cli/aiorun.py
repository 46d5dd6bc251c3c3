"""asyncio.run for the commands, made to end: nothing a command leaves running (a task, a
thread blocked for good) keeps the CLI from exiting."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")
_DRAIN_GRACE = 120.0  # seconds left to what a command's main coroutine leaves running


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):  # asyncio accepts only these
    """The CLI's default executor: each blocking call in a daemon thread of its own. asyncio.run
    (and the interpreter's exit) joins the threads of the standard executor without a timeout:
    one thread blocked for good (a read of a pipe whose writer never writes, a flock) made the
    CLI hang after an error instead of exiting. A call also never waits in a queue behind others,
    where the descriptor it was given could be closed (and its number reused) before it runs."""

    def submit(
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=run, name="minisandbox-call", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # nothing pooled; a thread still blocked is a daemon and does not hold the exit


def run_async(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run for the commands, made to end. What `main` leaves running (a shielded layer
    unpack goes on when its caller is cancelled) is awaited, its errors retrieved (not printed
    as tracebacks at shutdown), and cancelled after a grace period; threads are not joined."""

    async def body() -> T:
        asyncio.get_running_loop().set_default_executor(_DaemonThreads())
        try:
            return await main
        finally:
            await _drain(asyncio.current_task())

    try:
        return asyncio.run(body())
    except KeyboardInterrupt:
        _INTERRUPTED.set()
        raise


async def _drain(me: asyncio.Task[Any] | None) -> None:
    rest = [t for t in asyncio.all_tasks() if t is not me]
    if not rest:
        return
    _done, pending = await asyncio.wait(rest, timeout=_DRAIN_GRACE)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=_DRAIN_GRACE)
    for t in rest:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: the command reports the error that ended it


_INTERRUPTED = threading.Event()


def interrupted() -> bool:
    """Whether a command's run_async ended by Ctrl-C (its tasks cancelled and awaited)."""
    return _INTERRUPTED.is_set()
