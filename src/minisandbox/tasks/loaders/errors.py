"""Errors the task loaders raise. Each is a `MiniSandboxError` and names what went wrong: the
file, record and field of a malformed source, the ids a source does not have, the package a
source needs, the version comparison that cannot be read."""

from __future__ import annotations

from collections.abc import Sequence

from minisandbox.errors import MiniSandboxError


class TaskFormatError(MiniSandboxError, ValueError):
    """A task source is malformed. The message names the file, the record and the field;
    the attributes hold them (None when not known)."""

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        index: int | None = None,
        instance_id: str | None = None,
        field: str | None = None,
    ) -> None:
        super().__init__(message)
        self.path = path
        self.index = index
        self.instance_id = instance_id
        self.field = field


class TaskFileNotFoundError(TaskFormatError, FileNotFoundError):
    """A task file that does not exist."""


class TaskNotFoundError(MiniSandboxError, LookupError):
    """Some requested instance ids are not in the source.

    `missing` holds every id that was not found, sorted (the message shows the first 20);
    `source` names the source that was searched."""

    def __init__(
        self, message: str, *, missing: Sequence[str] = (), source: str | None = None
    ) -> None:
        super().__init__(message)
        self.missing: list[str] = list(missing)
        self.source = source


class MissingDependencyError(MiniSandboxError, ImportError):
    """An optional package is needed for this source; the message says what to install."""


class VersionSpecError(MiniSandboxError, ValueError):
    """A recipe override's version spec is not made of comparisons like '>=1.0' or '<2.9'."""
