"""Small asyncio helpers shared across the package (standard library only)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


def running_loop() -> asyncio.AbstractEventLoop | None:
    """The event loop running in this thread, or None outside one."""
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


async def all_or_none(coros: Iterable[Awaitable[T]]) -> list[T]:
    """Like gather, but the first exception (or our own cancellation) cancels and awaits all the
    others before it is raised: nothing is left running (holding a sandbox, a build lock or a
    thread) for asyncio.run to wait on after an error. Results in input order."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    first: BaseException | None = None
    try:
        if tasks:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            failed = [t for t in tasks if t in done and not t.cancelled() and t.exception()]
            first = failed[0].exception() if failed else None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    if first is not None:
        raise first
    return [t.result() for t in tasks]


async def settle(aws: Iterable[Awaitable[object]], timeout: float | None = None) -> None:
    """Wait up to `timeout` for `aws` to finish, however they end (their errors are retrieved
    and dropped; those still running are left running). Unlike `suppress(BaseException)`
    around an await, our own cancellation still propagates."""
    futures = [asyncio.ensure_future(a) for a in aws]
    if not futures:
        return
    done, _ = await asyncio.wait(futures, timeout=timeout)
    for f in done:
        if not f.cancelled():
            f.exception()  # retrieved: an error nobody awaited is not logged


async def cancel_and_wait(tasks: Iterable[asyncio.Future[Any]]) -> None:
    """Cancel `tasks` and wait until they are over; our own cancellation still propagates."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    await settle(tasks)
