"""What every integration needs: a task named the way its stack names it, a sandbox that is
started and stopped by explicit calls (stacks do not hold an `async with` open for us), and the
reward for what the agent left in /testbed."""

from __future__ import annotations

import contextlib
import functools
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisandbox.errors import AgentEnvironmentError
from minisandbox.evaluation.evaluator import EvalResult, Evaluator
from minisandbox.evaluation.validation import agent_sandbox
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import TaskNotFoundError, load_tasks
from minisandbox.tasks.specs import Task

if TYPE_CHECKING:  # (the cluster needs the `ray` extra: imported only when asked for)
    from minisandbox.cluster import RemoteSandbox, SandboxPool

DEFAULT_DATASET = "examples"
# swebench's image names: "swebench/sweb.eval.x86_64.psf_1776_requests-1142:latest", where
# "_1776_" stands for the "__" of the instance id (Docker names cannot hold "__").
_IMAGE = re.compile(r"(?:^|/)sweb\.eval\.[a-z0-9_]+\.(?P<id>[^:/]+?)(?::[^/]*)?$")


def instance_id_from_image(image: str) -> str | None:
    """The SWE-bench instance id an official image name stands for, else None."""
    m = _IMAGE.search(image.strip())
    return m.group("id").replace("_1776_", "__") if m else None


@functools.lru_cache(maxsize=8)
def _dataset(dataset: str, envs_dir: str | None) -> dict[str, Task]:
    tasks = load_tasks(dataset, envs_dir=Path(envs_dir) if envs_dir else None)
    return {t.id: t for t in tasks}


def resolve_task(
    task: str | Task, dataset: str | os.PathLike[str] = DEFAULT_DATASET, envs_dir: str | None = None
) -> Task:
    """A task given as a Task, an id of `dataset`, or an official SWE-bench image name.
    `envs_dir` (default $MINISANDBOX_ENVS_DIR) holds SWE-bench conda exports."""
    if isinstance(task, Task):
        return task
    envs_dir = envs_dir or os.environ.get("MINISANDBOX_ENVS_DIR") or None
    tasks = _dataset(os.fspath(dataset), envs_dir)
    wanted = task if task in tasks else instance_id_from_image(task) or task
    if wanted not in tasks:
        # Image names are lowercase (SWE-agent lowercases the ones it derives from ids).
        folded = {k.lower(): k for k in tasks}
        wanted = folded.get(wanted.lower(), wanted)
    if wanted not in tasks:
        raise TaskNotFoundError(
            f"{dataset}: no task {task!r}", missing=[task], source=os.fspath(dataset)
        )
    return tasks[wanted]


class TaskSandbox:
    """A sandbox opened by `start()` and closed by `stop()`: the task's (built on first use
    when needed) or, without a task, a plain one (host system and Python, empty /testbed)."""

    def __init__(
        self,
        task: Task | None = None,
        *,
        builder: Builder | None = None,
        pool: SandboxPool | None = None,
        **overrides: Any,
    ) -> None:
        self.task = task
        self.builder = builder if builder is not None or task is None else Builder(BuildSettings())
        self.pool = pool
        """A cluster's pool: the task's sandboxes and evaluations run on its nodes."""
        self.overrides = overrides
        self._stack: contextlib.AsyncExitStack | None = None
        self._sandbox: Sandbox | RemoteSandbox | None = None

    @property
    def sandbox(self) -> Sandbox | RemoteSandbox:
        if self._sandbox is None:
            raise AgentEnvironmentError("the sandbox is not started")
        return self._sandbox

    @property
    def running(self) -> bool:
        return self._sandbox is not None

    async def start(self) -> Sandbox | RemoteSandbox:
        if self._sandbox is not None:
            return self._sandbox
        stack = contextlib.AsyncExitStack()
        sb: Sandbox | RemoteSandbox
        try:
            if self.task is None:
                sb = await stack.enter_async_context(Sandbox(**self.overrides))
            elif self.pool is not None:  # (it checks the validation policy as agent_sandbox)
                sb = await stack.enter_async_context(self.pool.sandbox(self.task, **self.overrides))
            else:
                assert self.builder is not None
                # An agent's sandbox: refused without a passing validation when required.
                sb = await stack.enter_async_context(
                    agent_sandbox(self.builder, self.task, **self.overrides)
                )
        except BaseException:
            await stack.aclose()
            raise
        self._stack, self._sandbox = stack, sb
        return sb

    async def stop(self) -> None:
        stack, self._stack, self._sandbox = self._stack, None, None
        if stack is not None:
            await stack.aclose()

    async def diff(self) -> str:
        """What the agent changed in /testbed, as a patch against the task's base commit
        (new files included; the harness applies it to a fresh checkout)."""
        r = await self.sandbox.execute(
            "git add -A >/dev/null 2>&1; git diff --cached --binary HEAD", cwd="/testbed"
        )
        if r.exit_code != 0:
            raise AgentEnvironmentError(f"git diff in /testbed failed: {r.stderr.strip()}")
        return r.stdout

    async def evaluate(self, patch: str | None = None, *, timeout: float = 1800.0) -> EvalResult:
        """Score `patch` (default: the agent's changes) for the task in a fresh sandbox."""
        if self.task is None:
            raise AgentEnvironmentError("a plain sandbox has no task to evaluate")
        if patch is None:
            patch = await self.diff()
        if self.pool is not None:
            return await self.pool.evaluate(self.task, patch, timeout=timeout)
        return await Evaluator(self.builder, timeout=timeout).evaluate(self.task, patch)
