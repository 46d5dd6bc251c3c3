"""What every integration needs: a task named the way its stack names it, a sandbox that is
started and stopped by explicit calls (stacks do not hold an `async with` open for us), and the
reward for what the agent left in /testbed."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import re
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from minisandbox.errors import AgentEnvironmentError
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.runtime import Runtime
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.tasks.builder import Builder
from minisandbox.tasks.loaders import TaskNotFoundError, load_tasks
from minisandbox.tasks.specs import Task

DEFAULT_DATASET = "examples"
# swebench's image names: "swebench/sweb.eval.x86_64.psf_1776_requests-1142:latest", where
# "_1776_" stands for the "__" of the instance id (Docker names cannot hold "__").
_IMAGE = re.compile(r"(?:^|/)sweb\.eval\.[a-z0-9_]+\.(?P<id>[^:/]+?)(?::[^/]*)?$")


def instance_id_from_image(image: str) -> str | None:
    """The SWE-bench instance id an official image name stands for, else None."""
    m = _IMAGE.search(image.strip())
    return m.group("id").replace("_1776_", "__") if m else None


# One load of a dataset at a time: lookups run in worker threads (resolve_task_async), and
# concurrent first lookups of one dataset would each load (download) all of it.
_load_lock = threading.Lock()


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
    with _load_lock:
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


async def resolve_task_async(
    task: str | Task, dataset: str | os.PathLike[str] = DEFAULT_DATASET, envs_dir: str | None = None
) -> Task:
    """`resolve_task` for async code: the first lookup in a dataset loads all of it (for a
    Hugging Face dataset, a download), so it runs in a worker thread, off the event loop.

    Raises:
        TaskNotFoundError: `task` is no task of `dataset`.
    """
    if isinstance(task, Task):
        return task
    return await asyncio.to_thread(resolve_task, task, dataset, envs_dir)


async def resolve_first(
    names: Iterable[str | None],
    dataset: str | os.PathLike[str] = DEFAULT_DATASET,
    envs_dir: str | None = None,
) -> Task | None:
    """The task of the first of `names` (ids or SWE-bench image names; empty ones skipped)
    that names one in `dataset`, looked up off the event loop; None when none does."""
    candidates = [name for name in names if name]

    def first() -> Task | None:
        for name in candidates:
            try:
                return resolve_task(name, dataset, envs_dir)
            except TaskNotFoundError:
                continue
        return None

    return await asyncio.to_thread(first)


async def task_runtime(cluster: str | None = None, *, builder: Builder | None = None) -> Runtime:
    """The Runtime an integration's config names: this host's over `builder`'s store, or with
    `cluster` (a Ray address, "auto": the cluster this process is in) the shared pool of that
    cluster, over the same store (started on first use).

    Raises:
        ImportError: `cluster` is set and Ray is not installed (the `ray` extra).
        PoolError: no node of the cluster has the slots resource.
    """
    if not cluster:
        return Runtime(builder=builder)
    from minisandbox.cluster.shared import shared_pool  # (the `ray` extra: only when asked)

    return (await shared_pool(cluster, builder=builder)).runtime


class TaskSandbox:
    """A sandbox opened by `start()` and closed by `stop()`: the task's agent sandbox (built on
    first use when needed), from `runtime` (default: this host's), or without a task a plain one
    (host system and Python, empty /testbed)."""

    def __init__(
        self, task: Task | None = None, *, runtime: Runtime | None = None, **overrides: Any
    ) -> None:
        self.task = task
        self._runtime = runtime
        self.overrides = overrides
        self._stack: contextlib.AsyncExitStack | None = None
        self._sandbox: SandboxAPI | None = None

    @property
    def runtime(self) -> Runtime:
        """Where the task's sandboxes and grades come from (this host's, made on first use)."""
        if self._runtime is None:
            self._runtime = Runtime()
        return self._runtime

    @property
    def sandbox(self) -> SandboxAPI:
        if self._sandbox is None:
            raise AgentEnvironmentError("the sandbox is not started")
        return self._sandbox

    @property
    def running(self) -> bool:
        return self._sandbox is not None

    async def start(self) -> SandboxAPI:
        if self._sandbox is not None:
            return self._sandbox
        stack = contextlib.AsyncExitStack()
        try:
            if self.task is None:
                sb = await stack.enter_async_context(Runtime.plain(**self.overrides))
            else:  # the agent's: refused without a passing validation when required
                sb = await stack.enter_async_context(
                    self.runtime.sandbox(self.task, purpose="agent", **self.overrides)
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
        return await self.runtime.evaluate(self.task, patch, timeout=timeout)
