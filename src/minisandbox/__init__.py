"""swe-minisandbox: container-free sandboxes for training and evaluating SWE agents."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Exports resolve lazily so that `import minisandbox` (and the CLI's --help) stays fast.
_EXPORTS = {
    "Sandbox": "sandbox",
    "ExecResult": "sandbox",
    "SandboxConfig": "config",
    "Limits": "config",
    "ShellSession": "session",
    "SessionResult": "session",
    "SyncSandbox": "sync",
}

if TYPE_CHECKING:
    from .config import Limits, SandboxConfig
    from .sandbox import ExecResult, Sandbox
    from .session import SessionResult, ShellSession
    from .sync import SyncSandbox

__all__ = [
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SessionResult",
    "ShellSession",
    "SyncSandbox",
    "__version__",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
