"""The asyncio helpers that wait for others without swallowing our own cancellation."""

from __future__ import annotations

import asyncio

import pytest

from minisandbox.utils.aio import cancel_and_wait, settle


async def test_settle_waits_drops_errors_and_lets_our_cancellation_through() -> None:
    async def fails() -> None:
        raise OSError("dropped")

    await settle([fails(), asyncio.sleep(0)])  # errors are retrieved, not raised
    never = asyncio.get_running_loop().create_future()
    await settle([never], timeout=0.01)  # a timeout leaves it as it is
    assert not never.done()
    waiter = asyncio.ensure_future(settle([never]))
    await asyncio.sleep(0)
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):  # suppress(BaseException) would swallow it
        await waiter
    assert not never.done()


async def test_cancel_and_wait_ends_tasks_that_resist_once() -> None:
    ended = asyncio.Event()

    async def stubborn() -> None:
        try:
            await asyncio.sleep(100)
        finally:
            await asyncio.sleep(0.01)  # cleanup that takes a moment
            ended.set()

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await cancel_and_wait([task])
    assert task.cancelled() and ended.is_set()
