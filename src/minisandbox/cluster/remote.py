"""A sandbox on another node, with a local `Sandbox`'s API: every call goes to the node's agent.

What the local API takes as a callable (`execute`'s `on_output`) cannot cross nodes: the output
comes with the result. `pid` is None (the sandbox's processes are not this host's).
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
from typing import Any

from minisandbox.errors import (
    MiniSandboxError,
    NodeLostError,
    SandboxFileError,
    SandboxLimitError,
    SandboxNotRunningError,
    SessionError,
)
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
    """A persistent shell of a RemoteSandbox (ShellSession's run/send/interrupt/close)."""

    def __init__(self, sandbox: RemoteSandbox, name: str) -> None:
        self.sandbox = sandbox
        self.name = name
        self.closed = False
        self.busy = False
        """A command is still running (after a timeout or an `expect` match), as on the node."""

    async def _do(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.closed:
            raise SessionError(f"session {self.name!r} is closed")
        try:
            result, self.busy = await self.sandbox.call(
                "session_call", self.name, method, list(args), kwargs
            )
        except MiniSandboxError:
            with contextlib.suppress(MiniSandboxError):
                self.busy = await self.sandbox.call("session_busy", self.name)
            raise
        return result

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult:
        return await self._do("run", command, timeout=timeout, expect=expect, input=input)

    async def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        return await self._do("send", text, timeout=timeout, expect=expect)

    async def interrupt(self, timeout: float = 2.0) -> SessionResult:
        return await self._do("interrupt", timeout=timeout)

    async def close(self) -> None:
        if not self.closed:
            try:
                await self._do("close")
            except SessionError:
                pass  # already gone on the node (its shell exited): closed all the same
            self.closed = True
            self.sandbox._sessions.pop(self.name, None)


class RemoteSandbox:
    """A sandbox a pool started on node `node_id`. Its calls raise what the local Sandbox's
    raise, and NodeLostError when the node is gone."""

    def __init__(self, call: Call, node: Any, facts: dict[str, Any]) -> None:
        self._call = call
        self._node = node
        self.id: str = facts["id"]
        self.node_id: str = node.node_id
        self.facts = facts
        """How it started: layer `hits` and `misses` in the node's cache, `prep_s`."""
        self.pid: int | None = None
        self._sessions: dict[str, RemoteSession] = {}
        self._stopped = False

    async def call(self, method: str, *args: Any) -> Any:
        """`method` of the node's agent, for this sandbox.

        Raises:
            NodeLostError: the node is gone; and what the method raised on the node.
        """
        try:
            return await self._call(self._node, method, self.id, *args)
        except (SandboxNotRunningError, SandboxLimitError, NodeLostError):
            self._stopped = True
            raise

    @property
    def running(self) -> bool:
        """Whether it runs, as far as this driver has seen: its node is alive and no call
        found it stopped (`is_running()` asks the node)."""
        return bool(self._node.alive) and not self._stopped

    async def is_running(self) -> bool:
        return bool(await self.call("running"))

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
    ) -> ExecResult:
        """`Sandbox.execute` on the node."""
        kwargs = {
            "cwd": cwd,
            "env": dict(env) if env is not None else None,
            "timeout": timeout,
            "stdin": stdin,
            "merge_stderr": merge_stderr,
            "max_output": max_output,
        }
        cmd = command if isinstance(command, str) else list(command)
        return await self.call("execute", cmd, kwargs)

    async def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        return await self.call("read_file", path, max_bytes)

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
        await self.call("write_file", path, raw, mode)

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
        await self.call("upload", src.name, data, target, src.is_dir() and not src.is_symlink())

    async def create_session(self, name: str = "default", **kwargs: Any) -> RemoteSession:
        await self.call("create_session", name, kwargs)
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
