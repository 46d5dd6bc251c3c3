"""swe-minisandbox: container-free sandboxes for training and evaluating SWE agents."""

from __future__ import annotations

TYPE_CHECKING = False  # (not typing's: importing typing costs the CLI's warm path 10 ms)

__version__ = "0.1.0"

# Exports resolve lazily so that `import minisandbox` (and the CLI's --help) stays fast.
_EXPORTS = {
    "Sandbox": "sandbox.sandbox",
    "ExecResult": "sandbox.sandbox",
    "SandboxConfig": "sandbox.config",
    "Limits": "sandbox.config",
    "ShellSession": "sandbox.session",
    "SessionResult": "sandbox.session",
    "SyncSandbox": "sandbox.sync",
    "Runtime": "runtime.runtime",
    "Builder": "tasks.builder",
    "BuildSettings": "tasks.builder",
    "Task": "tasks.specs",
    "load_tasks": "tasks.loaders",
    "evaluate": "evaluation.evaluator",
    "Evaluator": "evaluation.evaluator",
    "EvalResult": "evaluation.evaluator",
    "evaluate_many": "evaluation.evaluator",
}

if TYPE_CHECKING:
    from typing import Any

    from minisandbox.evaluation.evaluator import EvalResult, Evaluator, evaluate, evaluate_many
    from minisandbox.runtime.runtime import Runtime
    from minisandbox.sandbox.config import Limits, SandboxConfig
    from minisandbox.sandbox.sandbox import ExecResult, Sandbox
    from minisandbox.sandbox.session import SessionResult, ShellSession
    from minisandbox.sandbox.sync import SyncSandbox
    from minisandbox.tasks.builder import Builder, BuildSettings
    from minisandbox.tasks.loaders import load_tasks
    from minisandbox.tasks.specs import Task

__all__ = [
    "BuildSettings",
    "Builder",
    "EvalResult",
    "Evaluator",
    "ExecResult",
    "Limits",
    "Runtime",
    "Sandbox",
    "SandboxConfig",
    "SessionResult",
    "ShellSession",
    "SyncSandbox",
    "Task",
    "__version__",
    "evaluate",
    "evaluate_many",
    "load_tasks",
]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    """The lazy exports too (they are module attributes only once asked for)."""
    return sorted({*globals(), *__all__})
