"""The Runtime: every sandbox of a task, and every grade, comes from here.

    runtime = Runtime()                                   # this host; Runtime(backend=pool): Ray
    async with runtime.sandbox(task) as sb:               # the agent's (policy checked)
        await sb.execute("pytest -x")
    result = await runtime.evaluate(task, patch)          # graded in a fresh sandbox

What a sandbox is made of for its purpose (agent, evaluation, build) is evaluation.purposes'
table; the validation policy is checked here, for agents' sandboxes only; the backend only
starts what it is given, so an integration never asks which backend it has: `LocalBackend`
(this host) here, `cluster.SandboxPool` (a Ray cluster's nodes) the other.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from minisandbox.envs.layerbuild import install_host_ca
from minisandbox.envs.settings import BuildSettings
from minisandbox.evaluation import purposes
from minisandbox.evaluation.evaluator import (
    DEFAULT_TIMEOUT,
    EvalResult,
    Evaluator,
    Grading,
    evaluate_many,
)
from minisandbox.evaluation.purposes import Purpose
from minisandbox.evaluation.validation import Validation, check_validated, validate
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.tasks.builder import Builder, TaskLayers, launch
from minisandbox.tasks.specs import Task


class Backend(Protocol):
    """Starts sandboxes of layers; grades a patch in one (where its files are)."""

    @property
    def builder(self) -> Builder:
        """The store the layers are in (and where missing ones are built)."""
        ...

    def open(self, layers: TaskLayers, **overrides: Any) -> AbstractAsyncContextManager[SandboxAPI]:
        """A sandbox of `layers`, stopped when the block ends; `overrides` are SandboxConfig
        fields.

        Raises:
            SandboxStartError: it could not be set up (and the node cache's errors).
        """
        ...

    async def grade(
        self,
        layers: TaskLayers,
        task: Task,
        patch: str | None,
        evaluator: Evaluator,
        **overrides: Any,
    ) -> EvalResult:
        """`evaluator`'s procedure for `task` (as graded) in a fresh sandbox of `layers`; an
        error result when the sandbox could not be had."""
        ...


class LocalBackend:
    """Sandboxes on this host, their layers from `builder`'s store through its node cache."""

    def __init__(self, builder: Builder) -> None:
        self._builder = builder

    @property
    def builder(self) -> Builder:
        return self._builder

    def open(self, layers: TaskLayers, **overrides: Any) -> AbstractAsyncContextManager[SandboxAPI]:
        return launch(self._builder, layers, **overrides)

    async def grade(
        self,
        layers: TaskLayers,
        task: Task,
        patch: str | None,
        evaluator: Evaluator,
        **overrides: Any,
    ) -> EvalResult:
        return await evaluator.evaluate_in(lambda: self.open(layers, **overrides), task, patch)


class Runtime:
    """A store and node cache (`builder`) and where sandboxes run (`backend`: this host by
    default). `build`: whether a task's missing layers are built on first use (else
    TaskNotBuiltError)."""

    def __init__(
        self,
        settings: BuildSettings | None = None,
        *,
        builder: Builder | None = None,
        backend: Backend | None = None,
        build: bool = True,
    ) -> None:
        if backend is not None and builder is not None and builder is not backend.builder:
            raise ValueError("a Runtime's builder is its backend's: pass one of them")
        if builder is None:
            builder = backend.builder if backend is not None else Builder(settings)
        self.builder = builder
        self.backend: Backend = backend if backend is not None else LocalBackend(builder)
        self.build = build

    async def layers(
        self,
        task: Task,
        purpose: Purpose = "agent",
        *,
        build: bool | None = None,
        extra_env: dict[str, str] | None = None,
        on_phase: Callable[[str, str], None] | None = None,
    ) -> TaskLayers:
        """What a sandbox of `task` for `purpose` is made of (evaluation.purposes), built first
        when missing and `build` (default: the runtime's).

        Raises:
            ValueError: not a purpose.
            TaskNotBuiltError, TaskBuildError, ServiceError, BuildError: as `Builder.task_layers`.
        """
        return await purposes.purpose_layers(
            self.builder,
            task,
            purpose,
            build=self.build if build is None else build,
            extra_env=extra_env,
            on_phase=on_phase,
        )

    @contextlib.asynccontextmanager
    async def sandbox(
        self,
        task: Task | None = None,
        *,
        purpose: Purpose = "agent",
        require_validated: bool | None = None,
        build: bool | None = None,
        extra_env: dict[str, str] | None = None,
        on_phase: Callable[[str, str], None] | None = None,
        **overrides: Any,
    ) -> AsyncIterator[SandboxAPI]:
        """A sandbox of `task` for `purpose` (evaluation.purposes), stopped when the block
        ends; without a task, a plain one on this host (the host's system and Python, an empty
        /testbed). An agent's is refused for a task without a passing validation when the
        policy asks for one (`require_validated`, default BuildSettings.require_validated,
        $MINISANDBOX_REQUIRE_VALIDATED). `overrides` are SandboxConfig fields; `on_phase` is
        told the build's phases.

        Raises:
            ValueError: not a purpose.
            TaskNotValidatedError: the policy is on and the task has no passing validation.
            TaskNotBuiltError, TaskBuildError, ServiceError, BuildError: see `layers`.
            SandboxStartError: the sandbox could not be set up.
            NodeLostError, PoolError: (a cluster's backend) its node was lost; none is alive.
        """
        if task is None:
            async with self.plain(**overrides) as plain:
                yield plain
            return
        row = purposes.spec(purpose)
        if row.validation_policy:
            required = self.builder.settings.require_validated
            if required if require_validated is None else require_validated:
                check_validated(self.builder, task)
        layers, more = await purposes.purpose_sandbox(
            self.builder,
            task,
            purpose,
            build=self.build if build is None else build,
            extra_env=extra_env,
            on_phase=on_phase,
        )
        async with self.backend.open(layers, **more, **overrides) as sb:
            if row.build_network:
                await install_host_ca(sb)
            yield sb

    @staticmethod
    def plain(**overrides: Any) -> AbstractAsyncContextManager[SandboxAPI]:
        """A sandbox of no task, on this host: its system and Python, an empty /testbed, no
        network unless `overrides` (SandboxConfig fields) ask.

        Raises:
            SandboxStartError: it could not be set up.
        """
        return Sandbox(**overrides)

    async def evaluate(
        self,
        task: Task,
        patch: str | None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        grading: Grading = "guarded",
        on_phase: Callable[[str, str], None] | None = None,
        **overrides: Any,
    ) -> EvalResult:
        """Grade `patch` for `task` in a fresh evaluation sandbox, as SWE-bench's harness does
        (evaluation.evaluator; `grading="harness"`: its verdict exactly, no guard). Whatever
        fails, an EvalResult: an error one when the task could not be built or started."""
        evaluator = Evaluator(self.builder, timeout=timeout, grading=grading, on_phase=on_phase)
        return await self.evaluate_with(evaluator, task, patch, **overrides)

    async def evaluate_with(
        self, evaluator: Evaluator, task: Task, patch: str | None, **overrides: Any
    ) -> EvalResult:
        """`evaluate` with an Evaluator's settings (its timeout, grading and `on_phase`)."""

        def run(layers: TaskLayers, graded: Task) -> Awaitable[EvalResult]:
            return self.backend.grade(layers, graded, patch, evaluator, **overrides)

        return await evaluator.evaluate(task, patch, build=self.build, run=run)

    async def evaluate_many(
        self,
        items: list[tuple[Task, str | None]],
        *,
        jobs: int = 1,
        on_done: Callable[[EvalResult], None] | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        grading: Grading = "guarded",
        on_phase: Callable[[str, str], None] | None = None,
    ) -> list[EvalResult]:
        """`evaluate` for several (task, patch) pairs, `jobs` at a time, in input order (see
        evaluation.evaluator.evaluate_many for how a failure stops the rest)."""
        evaluator = Evaluator(self.builder, timeout=timeout, grading=grading, on_phase=on_phase)
        return await evaluate_many(_Bound(self, evaluator), items, jobs=jobs, on_done=on_done)

    async def validate(
        self, task: Task, *, timeout: float | None = None, force: bool = False
    ) -> Validation:
        """The task's recorded verdict, or a new one (evaluation.validation.validate: gold and
        empty patches graded on this host, the history checked).

        Raises:
            TaskNotBuiltError: the task is not built.
        """
        return await validate(self.builder, task, timeout=timeout, force=force)


class _Bound:
    """A runtime's `evaluate_with` as an object with `evaluate(task, patch)`."""

    def __init__(self, runtime: Runtime, evaluator: Evaluator) -> None:
        self.runtime, self.evaluator = runtime, evaluator

    async def evaluate(self, task: Task, patch: str | None) -> EvalResult:
        return await self.runtime.evaluate_with(self.evaluator, task, patch)
