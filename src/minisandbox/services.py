"""Test-time services a task's test suite reaches over the network, served inside its sandbox.

Evaluation keeps the network off. Some suites call a public service (requests' tests call
httpbin.org); a task lists such services (`Task.services`, usually set by the recipe overrides),
and each is started inside the sandbox on loopback for the test run, with the environment
variables that point the suite at it.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from .errors import MiniSandboxError
from .sandbox import Sandbox
from .specs import Task

KNOWN_SERVICES: tuple[str, ...] = ()


@contextlib.asynccontextmanager
async def start_services(sb: Sandbox, task: Task) -> AsyncIterator[dict[str, str]]:
    """Start the task's services in `sb`; yields the environment variables for the tests."""
    unknown = [s for s in task.services if s not in KNOWN_SERVICES]
    if unknown:
        raise MiniSandboxError(
            f"task {task.id}: unknown service {unknown[0]!r} (known: {', '.join(KNOWN_SERVICES)})"
        )
    yield {}
