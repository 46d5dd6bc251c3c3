"""One sandbox: bubblewrap namespaces over a layered root, commands, shell sessions and files.

The bottom of the package: it knows nothing of layers' provenance, environments or tasks."""

from minisandbox.sandbox.config import Limits, SandboxConfig
from minisandbox.sandbox.sandbox import ExecResult, Sandbox
from minisandbox.sandbox.session import SessionResult, ShellSession
from minisandbox.sandbox.sync import SyncSandbox

__all__ = [
    "ExecResult",
    "Limits",
    "Sandbox",
    "SandboxConfig",
    "SessionResult",
    "ShellSession",
    "SyncSandbox",
]
