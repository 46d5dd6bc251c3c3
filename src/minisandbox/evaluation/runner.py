"""What evaluation needs of a sandbox: a small protocol, so grading can run on a fake in tests."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Protocol

from minisandbox.sandbox.sandbox import ExecResult


class CommandRunner(Protocol):
    """Runs commands and reads and writes files in one environment (a `Sandbox` is one)."""

    @property
    def pid(self) -> int | None:
        """The host pid of the environment's init (services enter its namespaces)."""
        ...

    async def execute(
        self,
        command: str | Sequence[str],
        *,
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        timeout: float | None = None,
        merge_stderr: bool = False,
        max_output: int | None = ...,
    ) -> ExecResult: ...

    async def write_file(
        self, path: str, data: bytes | str, *, mode: int | None = None
    ) -> None: ...

    async def read_text(
        self,
        path: str,
        *,
        encoding: str = "utf-8",
        errors: str = "backslashreplace",
        max_bytes: int = ...,
    ) -> str: ...
