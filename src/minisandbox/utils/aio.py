"""Small asyncio helpers shared across the package (standard library only)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Iterable
from typing import TypeVar

T = TypeVar("T")


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
