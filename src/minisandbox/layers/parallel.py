"""Running the store's per-blob work on a few threads (hashing, zstd and file system calls
release the GIL)."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from typing import TypeVar

T = TypeVar("T")


def run_parallel(fn: Callable[[T], None], items: Iterable[T], workers: int) -> None:
    """Run fn over items on a thread pool; the first error cancels what has not started, and
    is raised once the running calls are over."""
    todo = list(items)
    if workers <= 1 or len(todo) <= 1:
        for item in todo:
            fn(item)
        return
    with ThreadPoolExecutor(max_workers=workers) as pool:
        futures: list[Future[None]] = [pool.submit(fn, item) for item in todo]
        _done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        for fut in pending:
            fut.cancel()
        for fut in futures:
            if fut.done() and not fut.cancelled():
                error = fut.exception()
                if error is not None:
                    raise error
