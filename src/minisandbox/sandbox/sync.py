"""Blocking wrappers for code that is not async (scripts, some integrations).

All sandboxes of a process share one event loop thread. It lives as long as the process: bwrap
is told to die with its parent *thread*, so sandboxes must be started from a long-lived one.
"""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Coroutine, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

from minisandbox.sandbox.api import OnOutput, SessionAPI, SyncSandboxAPI
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.files import READ_MAX_BYTES
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.sandbox import ExecResult, Sandbox
from minisandbox.sandbox.session import SessionResult
from minisandbox.utils.aio import running_loop

T = TypeVar("T")
_loop: asyncio.AbstractEventLoop | None = None
_lock = threading.Lock()


def background_loop() -> asyncio.AbstractEventLoop:
    """The process's sandbox loop, started on first use in a daemon thread."""
    global _loop
    with _lock:
        if _loop is None or _loop.is_closed() or not _loop.is_running():
            loop = asyncio.new_event_loop()
            ready = threading.Event()

            def run() -> None:
                asyncio.set_event_loop(loop)
                loop.call_soon(ready.set)
                loop.run_forever()

            threading.Thread(target=run, name="minisandbox-loop", daemon=True).start()
            ready.wait()
            _loop = loop
        return _loop


def run_sync(coro: Coroutine[Any, Any, T]) -> T:
    """Run `coro` on the sandbox loop and block until it is done (not from that loop)."""
    return asyncio.run_coroutine_threadsafe(coro, background_loop()).result()


async def on_loop(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop | None = None) -> T:
    """Await `coro` on `loop` (default: the sandbox loop) from any event loop. For callers
    that run a new loop per call (asyncio.run each time): a sandbox belongs to the loop that
    started it (`home_loop`)."""
    loop = loop or background_loop()
    if running_loop() is loop:
        return await coro
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def home_loop(sandbox: object) -> asyncio.AbstractEventLoop | None:
    """The running event loop that started `sandbox` (a Sandbox the caller started on a loop
    of its own), where its calls must run; None for the sandbox loop's own, or another kind."""
    loop = getattr(sandbox, "loop", None)
    if isinstance(loop, asyncio.AbstractEventLoop) and loop.is_running():
        return loop
    return None


def call_soon(coro: Coroutine[Any, Any, None]) -> None:
    """Run `coro` on the sandbox loop: wait for it, unless called from that loop's own thread,
    where waiting would deadlock (then it is only scheduled)."""
    loop = background_loop()
    if running_loop() is loop:
        loop.create_task(coro)
    else:
        run_sync(coro)


class SyncSession:
    """A ShellSession whose calls block (see SyncSandboxAPI)."""

    def __init__(self, session: SessionAPI) -> None:
        self._session = session
        self.name = session.name

    @property
    def busy(self) -> bool:
        return self._session.busy

    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult:
        return run_sync(self._session.run(command, timeout=timeout, expect=expect, input=input))

    def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        return run_sync(self._session.send(text, timeout=timeout, expect=expect))

    def interrupt(self, timeout: float = 2.0) -> SessionResult:
        return run_sync(self._session.interrupt(timeout))

    def close(self) -> None:
        run_sync(self._session.close())


class SyncSandbox:
    """`with SyncSandbox(layers=[...]) as sb: sb.execute("pytest")`: a `Sandbox` whose calls
    block, with its names and parameters (SyncSandboxAPI). `execute`'s `on_output` is called
    in the sandbox loop's thread."""

    def __init__(self, config: SandboxConfig | None = None, **kwargs: Any) -> None:
        self.sandbox = Sandbox(config, **kwargs)
        self.id = self.sandbox.id

    def __enter__(self) -> SyncSandbox:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def running(self) -> bool:
        return self.sandbox.running

    @property
    def pid(self) -> int | None:
        return self.sandbox.pid

    def start(self) -> SyncSandbox:
        run_sync(self.sandbox.start())
        return self

    def stop(self) -> None:
        run_sync(self.sandbox.stop())

    def execute(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        stdin: bytes | str | None = None,
        merge_stderr: bool = False,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        on_output: OnOutput | None = None,
    ) -> ExecResult:
        return run_sync(
            self.sandbox.execute(
                command,
                cwd=cwd,
                env=env,
                timeout=timeout,
                stdin=stdin,
                merge_stderr=merge_stderr,
                max_output=max_output,
                on_output=on_output,
            )
        )

    def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        return run_sync(self.sandbox.read_file(path, max_bytes=max_bytes))

    def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str:
        return run_sync(
            self.sandbox.read_text(path, encoding=encoding, errors=errors, max_bytes=max_bytes)
        )

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        run_sync(self.sandbox.write_file(path, data, mode=mode))

    def upload(self, source: str | os.PathLike[str], target: str) -> None:
        run_sync(self.sandbox.upload(source, target))

    def create_session(
        self,
        name: str = "default",
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> SyncSession:
        session = self.sandbox.create_session(
            name, env=env, max_output=max_output, columns=columns, rows=rows
        )
        return SyncSession(run_sync(session))

    def session(self, name: str = "default") -> SyncSession:
        return SyncSession(self.sandbox.session(name))

    @property
    def sessions(self) -> list[str]:
        return self.sandbox.sessions

    def close_session(self, name: str) -> None:
        run_sync(self.sandbox.close_session(name))


if TYPE_CHECKING:
    _api: SyncSandboxAPI = cast(SyncSandbox, None)  # the declared API (sandbox/api.py)
