"""The sandbox API, declared once: what every sandbox offers, wherever it runs.

`SandboxAPI` is satisfied by the local `Sandbox`, by `cluster.RemoteSandbox` (a sandbox on another
node, every call sent to its node's agent) and, with the same names and parameters made
synchronous, `SyncSandboxAPI` by `SyncSandbox`. mypy checks each against its protocol where the
class is defined; tests check that the two protocols agree parameter by parameter. Code that only
drives a sandbox (evaluation, the integrations) takes a `SandboxAPI` and runs on any backend.

A command's result and a shell session's result are the same models everywhere (`ExecResult`,
`SessionResult`): what crosses to another node is these, not dicts.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol, runtime_checkable

from minisandbox.sandbox.commands import ExecResult
from minisandbox.sandbox.files import READ_MAX_BYTES
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.session import SessionResult

OnOutput = Callable[[int, bytes], None]
"""Called with (fd, chunk) as a command's output arrives: fd 1 is stdout, 2 stderr."""


@runtime_checkable
class SessionAPI(Protocol):
    """A persistent interactive shell of a sandbox (`Sandbox.create_session`)."""

    name: str

    @property
    def busy(self) -> bool:
        """A command still runs in it (after a timeout, or an `expect` match)."""
        ...

    async def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult:
        """Run `command` as typed at the prompt; its output and exit status."""
        ...

    async def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult:
        """Type `text` as is; what the shell printed until `expect` (or the prompt)."""
        ...

    async def interrupt(self, timeout: float = 2.0) -> SessionResult:
        """Ctrl-C, then harder, until the prompt is back."""
        ...

    async def close(self) -> None:
        """Kill the shell and what it started. Idempotent."""
        ...


@runtime_checkable
class SandboxAPI(Protocol):
    """One running sandbox: commands, files and shell sessions. See `Sandbox` for the
    behaviour and the errors of each call."""

    id: str

    @property
    def running(self) -> bool:
        """Whether it runs (as far as this process has seen)."""
        ...

    @property
    def pid(self) -> int | None:
        """The host pid of its init, or None when its processes are not this host's."""
        ...

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
        """Run one command to completion (a string under `bash -c`)."""
        ...

    async def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes:
        """The bytes of a regular file inside, refused past `max_bytes`."""
        ...

    async def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str:
        """`read_file` decoded."""
        ...

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        """Create or replace a file inside (its parents too)."""
        ...

    async def upload(self, source: str | os.PathLike[str], target: str) -> None:
        """Copy a host file or directory in (links stay links)."""
        ...

    async def create_session(
        self,
        name: str = "default",
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> SessionAPI:
        """Start a persistent shell named `name`."""
        ...

    def session(self, name: str = "default") -> SessionAPI:
        """The open session `name`."""
        ...

    @property
    def sessions(self) -> list[str]:
        """The names of the open sessions."""
        ...

    async def close_session(self, name: str) -> None:
        """Close session `name`."""
        ...

    async def stop(self) -> None:
        """Kill everything in it and let go of what it holds. Idempotent."""
        ...


class SyncSessionAPI(Protocol):
    """`SessionAPI`, each call blocking until done."""

    name: str

    @property
    def busy(self) -> bool: ...

    def run(
        self,
        command: str,
        *,
        timeout: float | None = None,
        expect: Sequence[str] | None = None,
        input: str | None = None,
    ) -> SessionResult: ...

    def send(
        self, text: str, *, timeout: float | None = None, expect: Sequence[str] | None = None
    ) -> SessionResult: ...

    def interrupt(self, timeout: float = 2.0) -> SessionResult: ...

    def close(self) -> None: ...


class SyncSandboxAPI(Protocol):
    """`SandboxAPI`, each call blocking until done (the same names and parameters)."""

    id: str

    @property
    def running(self) -> bool: ...

    @property
    def pid(self) -> int | None: ...

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
    ) -> ExecResult: ...

    def read_file(self, path: str, *, max_bytes: int = READ_MAX_BYTES) -> bytes: ...

    def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = READ_MAX_BYTES,
    ) -> str: ...

    def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None: ...

    def upload(self, source: str | os.PathLike[str], target: str) -> None: ...

    def create_session(
        self,
        name: str = "default",
        *,
        env: dict[str, str] | None = None,
        max_output: int | None = DEFAULT_MAX_OUTPUT,
        columns: int = 200,
        rows: int = 50,
    ) -> SyncSessionAPI: ...

    def session(self, name: str = "default") -> SyncSessionAPI: ...

    @property
    def sessions(self) -> list[str]: ...

    def close_session(self, name: str) -> None: ...

    def stop(self) -> None: ...


__all__ = ["OnOutput", "SandboxAPI", "SessionAPI", "SyncSandboxAPI", "SyncSessionAPI"]
