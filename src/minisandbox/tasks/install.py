"""A task's install commands as its repository layer runs them: as given, or, with
`install_as_of`, their pip installs resolved as of a date (envs.asof).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from minisandbox.envs.asof import as_of_date, install_env, not_before_python, pip_as_of
from minisandbox.tasks.repos import RepoSources
from minisandbox.tasks.specs import Task


async def install_commands(
    task: Task, repos: RepoSources, python: str, logs: Path
) -> tuple[list[str], dict[str, Any]]:
    """The commands to run for `task.install` and what to record of them in the layer's
    metadata: the date its pip installs resolve as of, and the commit's date when that date
    is "commit" (the date is then no earlier than Python `python` could be installed for).

    Raises:
        BuildError: at step "resolve", when the commit's date cannot be read.
    """
    if not task.install_as_of:
        return task.install, {}
    meta: dict[str, Any] = {}
    date = task.install_as_of
    if date == "commit":
        date = await asyncio.to_thread(repos.commit_date, task, logs)
        meta["commit_date"] = date
        date = not_before_python(date, python)
    meta["install_as_of"] = date = as_of_date(date)
    return [install_env(date), *(pip_as_of(command, date) for command in task.install)], meta
