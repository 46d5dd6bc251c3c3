"""verl's uni-agent on minisandbox: a sandbox provider and a task family, both registered with
uni-agent's registries under "minisandbox" when this module is imported.

- `MiniSandboxSandbox`, a uni-agent `Sandbox` (provider "minisandbox"): one instance is the
  agent sandbox of one task, started by `start()` and removed by `stop()`. Selected by a task's
  `sandbox:` block:

      sandbox:
        provider: minisandbox
        sandbox_kwargs: {dataset: examples, task: examples__semverkit-1}

  The task is `sandbox_kwargs.task`, else the official SWE-bench image name in `image` (what
  uni-agent's SWE-bench preprocessing writes there); a sandbox of no task is refused.
- `MiniSandboxTask`, a uni-agent `Task` (name "minisandbox"): one episode runs the configured
  agent (e.g. react) in the task's sandbox, then grades what it left in /testbed with
  minisandbox's evaluator in a fresh sandbox (reward 1.0 resolved, else 0.0).

uni-agent finds providers and tasks in registries filled at import time, so a process must
import this module before it builds one: in a verl run, name `run_task` below as the agent
runner (`runner_fqn: minisandbox.integrations.verl.run_task`), which imports it in every
worker and hands over to uni-agent's own runner.

uni-agent's framework runs each runner under an `asyncio.run` of its own, so one worker sees a
new event loop per episode, while a minisandbox sandbox (and the shared pool of `cluster:`)
belongs to the loop that started it: every sandbox call is handed to minisandbox's own
background loop (`on_loop`).
"""

from __future__ import annotations

import asyncio
import itertools
import shlex
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from minisandbox.errors import CommandTimeoutError, SandboxNotRunningError, TaskNotBoundError
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.integrations.tasks import DEFAULT_DATASET, TaskSandbox, resolve_task, task_runtime
from minisandbox.sandbox.api import SandboxAPI, SessionAPI
from minisandbox.sandbox.config import SandboxConfig as MiniSandboxConfig
from minisandbox.sandbox.sync import on_loop
from minisandbox.tasks.builder import Builder
from minisandbox.tasks.specs import Task as MiniTask

try:
    from uni_agent.sandbox.base import ExecResult, Sandbox, SandboxConfig
    from uni_agent.sandbox.registry import register_sandbox
    from uni_agent.tasks.base import Task, TaskConfig, TaskResult
    from uni_agent.tasks.registry import register_task
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"minisandbox.integrations.verl needs verl's uni-agent ({e}): it is not on PyPI (the "
        "PyPI project named uni-agent is another one); install it from its repository, see "
        "docs/integrations/verl.md"
    ) from e

PROVIDER = "minisandbox"
TASK_NAME = "minisandbox"
_SESSIONS = itertools.count(1)


class MiniSandboxKwargs(BaseModel):
    """What `sandbox_kwargs` of a `provider: minisandbox` block may hold."""

    model_config = ConfigDict(extra="forbid")

    task: str | None = None
    """The task id (of `dataset`) or its official SWE-bench image name; None: from `image`."""
    dataset: str = DEFAULT_DATASET
    """Where task ids are looked up: a dataset name or a path (minisandbox.tasks.loaders)."""
    envs_dir: str | None = None
    """Where SWE-bench conda exports are (default $MINISANDBOX_ENVS_DIR)."""
    cluster: str | None = None
    """A Ray address ("auto": this process's cluster) to take sandboxes from; None: this host."""
    eval_timeout: float = 1800.0
    """Seconds the grading of an episode's patch may take."""
    sandbox: dict[str, Any] = Field(default_factory=dict)
    """minisandbox SandboxConfig fields for the agent sandbox (limits, network...)."""

    @field_validator("sandbox")
    @classmethod
    def _sandbox_fields(cls, value: dict[str, Any]) -> dict[str, Any]:
        # Checked here, not at start(), which uni-agent retries.
        if unknown := sorted(set(value) - set(MiniSandboxConfig.model_fields)):
            raise ValueError(
                f"unknown SandboxConfig field {unknown[0]!r} "
                f"(known: {', '.join(MiniSandboxConfig.model_fields)})"
            )
        return value


def _kwargs_error(e: ValidationError) -> ValueError:
    """One line naming each bad `sandbox_kwargs` entry (pydantic's message is a page)."""
    problems = []
    for err in e.errors():
        where = ".".join(map(str, err["loc"]))
        if err["type"] == "extra_forbidden":
            known = ", ".join(MiniSandboxKwargs.model_fields)
            problems.append(f"sandbox_kwargs: unknown key {where!r} (known: {known})")
        else:
            problems.append(f"sandbox_kwargs.{where}: {err['msg']}")
    return ValueError(f"sandbox provider {PROVIDER!r}: {'; '.join(problems)}")


def _unbound(what: str) -> TaskNotBoundError:
    return TaskNotBoundError(
        f"{what}: no task to open a sandbox for; add `task: <task id>` under "
        "`sandbox.sandbox_kwargs` (or give the task in `metadata.instance_id` of a "
        f"`name: {TASK_NAME}` task)"
    )


@register_sandbox(PROVIDER)
class MiniSandboxSandbox(Sandbox):  # type: ignore[misc]  # uni-agent is untyped
    """A task's agent sandbox as a uni-agent provider. Commands, files and native shells map to
    the minisandbox sandbox's own; `expose_port` is not supported (the sandbox's private network
    namespace has only a loopback, which nothing outside reaches; with `network: true` it shares
    the host's, where a port needs no publishing).

    Raises:
        TaskNotBoundError: (at construction) no task is named.
        TaskNotFoundError: the task is not in the dataset.
    """

    supports_shell: ClassVar[bool] = True

    def __init__(
        self,
        task: str | MiniTask | None = None,
        *,
        dataset: str = DEFAULT_DATASET,
        envs_dir: str | None = None,
        cluster: str | None = None,
        eval_timeout: float = 1800.0,
        sandbox: Mapping[str, Any] | None = None,
        builder: Builder | None = None,
    ) -> None:
        if task is None or task == "":
            raise _unbound(f"sandbox provider {PROVIDER!r}")
        self.task = resolve_task(task, dataset, envs_dir)
        self.cluster = cluster
        self.eval_timeout = eval_timeout
        self.overrides = dict(sandbox or {})
        self.builder = builder
        self.task_sandbox: TaskSandbox | None = None

    @classmethod
    def from_config(cls, config: SandboxConfig) -> MiniSandboxSandbox:
        """The sandbox a `provider: minisandbox` block describes (see `MiniSandboxKwargs`).

        Raises:
            ValueError: `sandbox_kwargs` holds an unknown key or a value of the wrong type.
            TaskNotBoundError: neither `sandbox_kwargs.task` nor a SWE-bench `image` names one.
            TaskNotFoundError: the task is not in the dataset.
        """
        try:
            kw = MiniSandboxKwargs(**config.sandbox_kwargs)
        except ValidationError as e:
            raise _kwargs_error(e) from None
        task = kw.task
        if task is None and "image" in config.model_fields_set:
            task = config.image  # resolve_task maps SWE-bench image names to ids
        return cls(task, **kw.model_dump(exclude={"task"}))

    @property
    def sandbox(self) -> SandboxAPI:
        """The running minisandbox sandbox.

        Raises:
            SandboxNotRunningError: not started (or stopped).
        """
        if self.task_sandbox is None or not self.task_sandbox.running:
            raise SandboxNotRunningError(f"the {PROVIDER} sandbox of {self.task.id} is not running")
        return self.task_sandbox.sandbox

    async def start(self) -> None:
        if self.task_sandbox is not None and self.task_sandbox.running:
            return

        async def start() -> TaskSandbox:
            runtime = await task_runtime(self.cluster, builder=self.builder)
            ts = TaskSandbox(self.task, runtime=runtime, **self.overrides)
            await ts.start()
            return ts

        self.task_sandbox = await on_loop(start())

    async def stop(self) -> None:
        if self.task_sandbox is not None:
            await on_loop(self.task_sandbox.stop())

    async def is_alive(self) -> bool:
        return self.task_sandbox is not None and self.task_sandbox.running

    async def _exec(
        self,
        argv: list[str],
        *,
        timeout: float | None = None,
        workdir: str | None = None,
        env: dict[str, str] | None = None,
    ) -> ExecResult:
        # A CommandTimeoutError is a TimeoutError: uni-agent's `exec` reports it as exit -1.
        r = await on_loop(self.sandbox.execute(list(argv), cwd=workdir, env=env, timeout=timeout))
        return ExecResult(exit_code=r.exit_code, stdout=r.stdout, stderr=r.stderr)

    async def read_file(self, path: str) -> bytes:
        return await on_loop(self.sandbox.read_file(path))

    async def write_file(self, path: str, content: bytes | str) -> None:
        await on_loop(self.sandbox.write_file(path, content))

    async def upload(self, local_path: Path | str, remote_path: str) -> None:
        await on_loop(self.sandbox.upload(local_path, remote_path))

    async def open_shell(
        self, *, cwd: str | None = None, env: dict[str, str] | None = None
    ) -> _Shell:
        """A persistent shell of the sandbox (cwd and variables carry over between runs)."""
        session = await on_loop(
            self.sandbox.create_session(f"uni-agent-{next(_SESSIONS)}", env=env)
        )
        shell = _Shell(session)
        if cwd:
            await shell.run(f"cd {shlex.quote(cwd)}", timeout=30)
        return shell

    async def diff(self) -> str:
        """What the agent changed in /testbed, as a patch against the task's base commit."""
        if self.task_sandbox is None:
            raise SandboxNotRunningError("the sandbox is not started")
        return await on_loop(self.task_sandbox.diff())

    async def evaluate(self, patch: str) -> EvalResult:
        """Grade `patch` for the task in a fresh sandbox (this one may be stopped)."""

        async def grade() -> EvalResult:
            ts = self.task_sandbox or TaskSandbox(
                self.task, runtime=await task_runtime(self.cluster, builder=self.builder)
            )
            return await ts.evaluate(patch, timeout=self.eval_timeout)

        return await on_loop(grade())


class _Shell:
    """What uni-agent's `stateful_shell` tool expects of `open_shell()`: `run` and `close`."""

    def __init__(self, session: SessionAPI) -> None:
        self.session = session

    async def run(self, command: str, *, timeout: float = 120.0) -> ExecResult:
        """Run `command` at the prompt (stdout and stderr interleaved, as on a terminal).

        Raises:
            TimeoutError: it ran past `timeout`; it was interrupted, the shell is usable again.
        """

        async def run() -> ExecResult:
            try:
                r = await self.session.run(command, timeout=timeout)
            except CommandTimeoutError as e:
                await self.session.interrupt()
                raise TimeoutError(
                    f"command timed out after {timeout}s; output:\n{e.output}"
                ) from e
            return ExecResult(
                exit_code=-1 if r.exit_code is None else r.exit_code, stdout=r.output, stderr=""
            )

        return await on_loop(run())

    async def close(self) -> None:
        await on_loop(self.session.close())


class MiniSandboxTaskConfig(TaskConfig):  # type: ignore[misc]  # uni-agent is untyped
    """A `name: minisandbox` task: the sample's task in `metadata.instance_id` (or in the
    sandbox block), the agent in `agent`, an optional `prompt` (default: the task's problem
    statement)."""

    name: str = TASK_NAME
    run_gold_patch: bool = False
    """Oracle mode: apply the task's gold patch instead of running the agent."""


@register_task(TASK_NAME)
class MiniSandboxTask(Task):  # type: ignore[misc]  # uni-agent is untyped
    """One episode on a minisandbox task: the agent in the task's sandbox, then the grade of
    its changes to /testbed."""

    config_model = MiniSandboxTaskConfig

    def build_sandbox(self) -> MiniSandboxSandbox:
        """The sandbox block's provider, bound to the sample's task when the block names none.

        Raises:
            ValueError: the block's provider is not "minisandbox".
            TaskNotBoundError: no task is named.
        """
        block: SandboxConfig = self.config.sandbox
        if block.provider != PROVIDER:
            raise ValueError(
                f"task {TASK_NAME!r} grades in minisandbox and needs `sandbox.provider: "
                f"{PROVIDER}` (got {block.provider!r})"
            )
        meta = self.config.metadata or {}
        sample_task = meta.get("instance_id") or meta.get("task")
        if sample_task and not block.sandbox_kwargs.get("task"):
            block = block.model_copy(
                update={"sandbox_kwargs": {**block.sandbox_kwargs, "task": sample_task}}
            )
        try:
            return MiniSandboxSandbox.from_config(block)
        except TaskNotBoundError:
            raise _unbound(f"task {TASK_NAME!r}") from None

    async def run(self) -> TaskResult:
        """Raises:
        ValueError, TaskNotBoundError: see `build_sandbox`; the agent is not named.
        """
        cfg: MiniSandboxTaskConfig = self.config
        if not cfg.run_gold_patch and not cfg.agent.name:
            raise ValueError(
                f"task {TASK_NAME!r} has no agent: set `agent.name` (e.g. react) or "
                "`run_gold_patch: true`"
            )
        # Off the event loop: the first lookup in a dataset loads (downloads) all of it.
        sandbox = await asyncio.to_thread(self.build_sandbox)
        t0 = time.monotonic()
        finished: bool | None = True
        info: dict[str, Any] = {}
        async with sandbox:
            if cfg.run_gold_patch:
                await sandbox.write_file("/tmp/gold.patch", sandbox.task.gold_patch)
                r = await sandbox.exec(["git", "apply", "/tmp/gold.patch"], workdir="/testbed")
                if r.exit_code != 0:
                    raise RuntimeError(f"the gold patch does not apply: {r.stderr.strip()}")
                await sandbox.exec(["rm", "-f", "/tmp/gold.patch"])
            else:
                prompt = cfg.prompt or [{"role": "user", "content": _default_prompt(sandbox.task)}]
                agent_result = await self.build_agent().run(sandbox=sandbox, messages=prompt)
                finished, info = agent_result.finished, dict(agent_result.info)
            patch = await sandbox.diff()
        agent_s = time.monotonic() - t0
        result = await sandbox.evaluate(patch)  # after stop(): grading opens its own sandbox
        return TaskResult(
            reward=result.reward,
            accuracy=float(result.resolved),
            finished=finished,
            extra_info={
                "instance_id": result.instance_id,
                "resolved": result.resolved,
                "status": result.status,
                "reason": result.reason,
                "eval_completed": result.status != "error",
                "eval_execution_time": result.duration_s,
                "agent_time": agent_s,
                "patch": patch,
                "agent_info": info,
            },
        )


def _default_prompt(task: MiniTask) -> str:
    return (
        f"{task.problem_statement}\n\nThe repository is checked out at /testbed. Change it so "
        "that the issue is resolved, then call the submit tool."
    )


async def run_task(**kwargs: Any) -> TaskResult:
    """uni-agent's agent runner (`uni_agent.framework.task_runner.run_task`) in a process that
    has this module's provider and task registered: name it as the runner,
    `runner_fqn: minisandbox.integrations.verl.run_task`, and the same `runner_kwargs`.

    Raises:
        ImportError: uni-agent's framework (verl, torch, Ray) is not installed.
    """
    from uni_agent.framework.task_runner import run_task as uni_agent_run_task

    result: TaskResult = await uni_agent_run_task(**kwargs)
    return result
