"""A sandbox on another node, with a local `Sandbox`'s API (SandboxAPI): every call goes to the
node's agent as one typed request (messages.py).

What the local API takes as a callable (`execute`'s `on_output`) cannot cross nodes: the output
comes with the result, and `on_output` is given it then. `pid` is None (the sandbox's processes
are not this host's).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import io
import os
import tarfile
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from minisandbox.cluster.messages import (
    CreateSession,
    Execute,
    IsRunning,
    ReadFile,
    SandboxRequest,
    SessionBusy,
    SessionClose,
    SessionInterrupt,
    SessionReply,
    SessionRequest,
    SessionRun,
    SessionSend,
    StartFacts,
    Upload,
    WriteFile,
)
from minisandbox.errors import (
    MiniSandboxError,
    NodeLostError,
    SandboxFileError,
    SandboxLimitError,
    SandboxNotRunningError,
    SessionError,
)
from minisandbox.sandbox.api import OnOutput, SandboxAPI
from minisandbox.sandbox.commands import ExecResult
from minisandbox.sandbox.files import READ_MAX_BYTES
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.session import SessionResult

Call = Callable[..., Awaitable[Any]]


def _tar(src: Path) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(src, arcname=src.name)  # links as links, never followed
    return buf.getvalue()


class RemoteSession:
    """A persistent shell of a RemoteSandbox (SessionAPI)."""

    def __init__(self, sandbox: RemoteSandbox, name: str) -> None:
        self.sandbox = sandbox
        self.name = name
        self.closed = False
        self.busy = False
        """A command is still running (after a timeout or an `expect` match), as on the node."""

    async def _do(self, request: SessionRequest) -> SessionResult | None:
        if self.closed:
            raise SessionError(f"session {self.name!r} is closed")
        try:
            reply: SessionReply = await self.sandbox.call(request)
        except MiniSandboxError:
            with contextlib.suppress(MiniSandboxError):
                self.busy = await self.sandbox.call(SessionBusy(name=self.name))
            raise
        self.busy = reply.busy
        return reply.result

    async def _result(self, request: SessionRequest) -> SessionResult:
        result = await self._do(request)
        assert result is not None  # only `close` answers without one
        return result

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult:
        return await self._result(
            SessionRun(
                name=self.name,
                command=command,
                timeout=timeout,
                expect=list(expect) if expect is not None else None,
                input=input,
            )
        )

    async def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        return await self._result(
            SessionSend(
                name=self.name,
                text=text,
                timeout=timeout,
                expect=list(expect) if expect is not None else None,
            )
        )

    async def interrupt(self, timeout: float = 2.0) -> SessionResult:
        return await self._result(SessionInterrupt(name=self.name, timeout=timeout))

    async def close(self) -> None:
        if not self.closed:
            try:
                await self._do(SessionClose(name=self.name))
            except SessionError:
                pass  # already gone on the node (its shell exited): closed all the same
            self.closed = True
            self.sandbox._sessions.pop(self.name, None)


class RemoteSandbox:
    """A sandbox a pool started on node `node_id`. Its calls raise what the local Sandbox's
    raise, and NodeLostError when the node is gone. `stop()` lets the pool's block end it
    early (the pool stops it at the block's end in any case)."""

    def __init__(
        self,
        call: Call,
        node: Any,
        facts: StartFacts,
        stop: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        self._call = call
        self._node = node
        self.id: str = facts.id
        self.node_id: str = node.node_id
        self.facts = facts
        """How it started: layer `hits` and `misses` in the node's cache, `prep_s`."""
        self._sessions: dict[str, RemoteSession] = {}
        self._stopped = False  # stopped, or found stopped by a call
        self._stop = stop
        self._stop_called = False

    @property
    def pid(self) -> int | None:
        return None  # its processes are another host's

    async def call(self, request: SandboxRequest) -> Any:
        """Send one request to the node's agent for this sandbox.

        Raises:
            NodeLostError: the node is gone; and what the call raised on the node.
        """
        try:
            return await self._call(self._node, "call", self.id, request)
        except (SandboxNotRunningError, SandboxLimitError, NodeLostError):
            self._stopped = True
            raise

    @property
    def running(self) -> bool:
        """Whether it runs, as far as this driver has seen: its node is alive and no call
        found it stopped (`is_running()` asks the node)."""
        return bool(self._node.alive) and not self._stopped

    async def is_running(self) -> bool:
        return bool(await self.call(IsRunning()))

    async def stop(self) -> None:
        """Stop it on its node. Idempotent."""
        self._stopped = True
        if self._stop is not None and not self._stop_called:
            self._stop_called = True
            await self._stop()

    async def execute(
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
        """`Sandbox.execute` on the node; `on_output` sees the output once it has come."""
        request = Execute(
            command=command if isinstance(command, str) else list(command),
            cwd=cwd,
            env=dict(env) if env is not None else None,
            timeout=timeout,
            stdin=stdin,
            merge_stderr=merge_stderr,
            max_output=max_output,
        )
        result: ExecResult = await self.call(request)
        if on_output is not None:
            for fd, text in ((1, result.stdout), (2, result.stderr)):
                if text:
                    on_output(fd, text.encode())
        return result

    async def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        data: bytes = await self.call(ReadFile(path=path, max_bytes=max_bytes))
        return data

    async def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str:
        return (await self.read_file(path, max_bytes=max_bytes)).decode(encoding, errors)

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        raw = data.encode() if isinstance(data, str) else data
        await self.call(WriteFile(path=path, data=raw, mode=mode))

    async def upload(self, source: str | os.PathLike[str], target: str) -> None:
        """`Sandbox.upload` of a file, link or directory of this host (sent to the node as a
        tar: links stay links).

        Raises:
            SandboxFileError: the source does not exist; and what `Sandbox.upload` raises.
            OSError: a file of the source cannot be read.
        """
        src = Path(source)
        if not src.exists() and not src.is_symlink():
            raise SandboxFileError(f"upload source {src} does not exist", errno.ENOENT)
        data = await asyncio.to_thread(_tar, src)
        is_dir = src.is_dir() and not src.is_symlink()
        await self.call(Upload(name=src.name, data=data, target=target, is_dir=is_dir))

    async def create_session(
        self,
        name: str = "default",
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> RemoteSession:
        if name in self._sessions:
            raise SessionError(f"session {name!r} already exists in sandbox {self.id}")
        request = CreateSession(
            name=name, env=env, max_output=max_output, columns=columns, rows=rows
        )
        await self.call(request)
        session = RemoteSession(self, name)
        self._sessions[name] = session
        return session

    def session(self, name: str = "default") -> RemoteSession:
        try:
            return self._sessions[name]
        except KeyError:
            raise SessionError(f"no session {name!r} in sandbox {self.id}") from None

    @property
    def sessions(self) -> list[str]:
        return list(self._sessions)

    async def close_session(self, name: str) -> None:
        await self.session(name).close()


if TYPE_CHECKING:
    _api: SandboxAPI = cast(RemoteSandbox, None)  # the declared API (sandbox/api.py)
