"""NeMo Gym on minisandbox: a sandbox provider (`nemo_gym.sandbox_providers` entry point
"minisandbox") whose sandboxes are task sandboxes, selected by a `sandbox:` block:

    sandbox:
      minisandbox:
        dataset: examples            # where task ids are looked up
        # task: examples__semverkit-1  (one task for every sandbox; else per instance)

Each `create()` opens the agent sandbox of one task: the block's `task`, else the one the
agent's `SandboxSpec` names (`metadata.minisandbox_task`, the official SWE-bench image name
mini_swe_agent_2 derives from the row, or `metadata.instance_id`). A sandbox with no task is
refused (TaskNotBoundError naming the line to add), unless `plain: true`.

NeMo Gym drives providers from event loops it makes and closes per sandbox (its sync `Sandbox`
runs one in a thread per sandbox), while a minisandbox sandbox belongs to the loop that started
it and dies with the thread that started it: every call is handed to minisandbox's own
background loop (`on_loop`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Mapping
from pathlib import Path, PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict

from minisandbox.errors import CommandTimeoutError, TaskNotBoundError
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.integrations.tasks import (
    DEFAULT_DATASET,
    TaskSandbox,
    resolve_first,
    resolve_task_async,
    task_runtime,
)
from minisandbox.runtime import Runtime
from minisandbox.sandbox.sync import on_loop
from minisandbox.tasks.builder import Builder
from minisandbox.tasks.loaders import TaskNotFoundError
from minisandbox.tasks.specs import Task

try:
    from nemo_gym.sandbox.providers.base import (
        SandboxExecResult,
        SandboxHandle,
        SandboxSpec,
        SandboxStatus,
    )
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"minisandbox.integrations.nemo_gym needs NeMo Gym ({e}): pip install 'nemo-gym>=0.7' "
        "(it requires Python >=3.13.14; see docs/integrations/nemo-gym.md)"
    ) from e

PROVIDER_NAME = "minisandbox"
# NeMo Gym's providers' return code for a failure of the sandbox runtime, not of the command
# (a timeout among them), told apart by `error_type`.
SANDBOX_RUNTIME_RETURN_CODE = 125
# Spec fields a task sandbox does not apply: its image is the task's, its limits are the
# block's `sandbox` settings, and it has no lifetime of its own or published ports.
_IGNORED_SPEC_FIELDS = ("ttl_s", "ready_timeout_s", "entrypoint", "ports", "provider_options")
_ROOT_USERS = (None, "root", 0, "0")

logger = logging.getLogger(__name__)
_ids = itertools.count(1)


class MiniSandboxProviderConfig(BaseModel):
    """The keys of a `sandbox: {minisandbox: {...}}` block (unknown keys are an error)."""

    model_config = ConfigDict(extra="forbid")

    task: str | None = None
    """A task id of `dataset` or an official SWE-bench image name, for every sandbox; unset,
    each sandbox's task comes from the agent's SandboxSpec (its image or instance id)."""
    dataset: str = DEFAULT_DATASET
    """`examples`, a task/records file, or a Hugging Face dataset name (see `load_tasks`)."""
    envs_dir: str | None = None
    """SWE-bench conda exports (default $MINISANDBOX_ENVS_DIR)."""
    plain: bool = False
    """Allow a plain sandbox (the host's system and Python, an empty /testbed) when no task is
    named; otherwise that is an error."""
    cluster: str | None = None
    """Run the sandboxes on the sandbox pool of this Ray cluster ("auto": the one this process
    is part of; else a Ray address; docs/cluster.md)."""
    sandbox: dict[str, Any] = {}
    """SandboxConfig fields (e.g. `network`, limits), passed to every sandbox."""
    default_timeout_s: float = 180.0
    """A command's timeout when the caller gives none."""


class _Box:
    """What a handle's `raw` holds: the task sandbox and the spec's working directory and
    environment."""

    def __init__(self, ts: TaskSandbox, workdir: str, env: dict[str, str]) -> None:
        self.ts = ts
        self.workdir = workdir
        self.env = env


class MiniSandboxProvider:
    """NeMo Gym's `SandboxProvider` protocol on minisandbox task sandboxes (see the module)."""

    name = PROVIDER_NAME

    def __init__(self, *, builder: Builder | None = None, **config: Any) -> None:
        """`config`: the keys of the `sandbox:` block (MiniSandboxProviderConfig); `builder`
        (Python callers only): the store and node cache, default the environment's.

        Raises:
            pydantic.ValidationError: an unknown key or a value of the wrong type.
        """
        self.config = MiniSandboxProviderConfig(**config)
        self.builder = builder
        self._runtime: Runtime | None = None
        self._boxes: dict[str, _Box] = {}

    # ------------------------------------------------------------------ tasks

    async def task_for(self, spec: SandboxSpec) -> Task | None:
        """The task a sandbox for `spec` runs (None: a plain sandbox, when `plain`), looked up
        off the event loop (the first lookup in a dataset loads all of it).

        Raises:
            TaskNotBoundError: nothing names a task and `plain` is not set.
            TaskNotFoundError: what names the task is no task of `dataset`.
        """
        cfg = self.config
        if cfg.task:
            return await resolve_task_async(cfg.task, cfg.dataset, cfg.envs_dir)
        metadata = spec.metadata or {}
        named = [
            str(v)
            for v in (metadata.get("minisandbox_task"), spec.image, metadata.get("instance_id"))
            if v and str(v) != "unknown"  # mini_swe_agent_2's placeholder for "no instance id"
        ]
        if task := await resolve_first(named, cfg.dataset, cfg.envs_dir):
            return task
        if named:
            raise TaskNotFoundError(
                f"sandbox provider {PROVIDER_NAME!r}: no task of dataset {cfg.dataset!r} is "
                f"named by {' or '.join(map(repr, named))}: set `dataset:` in the "
                f"`sandbox: {{{PROVIDER_NAME}: ...}}` block to the dataset of these instances",
                missing=named,
                source=cfg.dataset,
            )
        if cfg.plain:
            return None
        raise TaskNotBoundError(
            f"sandbox provider {PROVIDER_NAME!r} has no task for this sandbox, so the agent "
            f"would work on an empty one: add `task: <task id>` under `sandbox: "
            f"{{{PROVIDER_NAME}: ...}}`, or have the agent pass the instance (its SWE-bench image "
            "as SandboxSpec.image, or metadata.instance_id, as mini_swe_agent_2 does); "
            "`plain: true` asks for a plain sandbox"
        )

    async def _runtime_for(self) -> Runtime:
        if self._runtime is None:
            self._runtime = await task_runtime(self.config.cluster, builder=self.builder)
        return self._runtime

    def _box(self, handle: SandboxHandle) -> _Box:
        box = handle.raw
        if not isinstance(box, _Box):
            raise ValueError(f"not a {PROVIDER_NAME} sandbox handle: {handle.sandbox_id}")
        return box

    # ------------------------------------------------------------------ the protocol

    async def create(self, spec: SandboxSpec) -> SandboxHandle:
        """Start the sandbox of the spec's task (built first when needed).

        Raises:
            TaskNotBoundError, TaskNotFoundError: see `task_for`.
            TaskNotBuiltError, TaskBuildError, SandboxStartError: the task's sandbox could not
                be built or started.
        """
        task = await self.task_for(spec)
        ignored = [f for f in _IGNORED_SPEC_FIELDS if getattr(spec, f)]
        if ignored:
            logger.debug("%s ignores SandboxSpec %s", PROVIDER_NAME, ", ".join(ignored))

        async def start() -> _Box:
            runtime = await self._runtime_for() if task is not None else None
            ts = TaskSandbox(task, runtime=runtime, **self.config.sandbox)
            await ts.start()
            return _Box(ts, spec.workdir or "/testbed", dict(spec.env))

        box = await on_loop(start())
        sandbox_id = f"{PROVIDER_NAME}-{task.id if task else 'plain'}-{next(_ids)}"
        self._boxes[sandbox_id] = box
        return SandboxHandle(sandbox_id=sandbox_id, provider_name=self.name, raw=box)

    async def exec(
        self,
        handle: SandboxHandle,
        command: str,
        *,
        cwd: str | None = None,
        env: dict[str, str] | None = None,
        timeout_s: int | float | None = None,
        user: str | int | None = None,
    ) -> SandboxExecResult:
        """Run `command` under `bash -c`. A timeout is a result (return code 125, error_type
        "timeout", the output so far), as NeMo Gym's own providers report it.

        Raises:
            ValueError: `user` is not root (commands run as the sandbox's root).
            SandboxNotRunningError: the sandbox was closed.
        """
        if user not in _ROOT_USERS:
            raise ValueError(
                f"{PROVIDER_NAME} runs commands as the sandbox's root only, not user {user!r}"
            )
        box = self._box(handle)
        timeout = timeout_s if timeout_s is not None else self.config.default_timeout_s
        try:
            r = await on_loop(
                box.ts.sandbox.execute(
                    command,
                    cwd=cwd or box.workdir,
                    env={**box.env, **(env or {})},
                    timeout=timeout,
                )
            )
        except CommandTimeoutError as e:
            return SandboxExecResult(
                stdout=e.output,
                stderr=f"command timed out after {timeout:g}s",
                return_code=SANDBOX_RUNTIME_RETURN_CODE,
                error_type="timeout",
            )
        return SandboxExecResult(stdout=r.stdout, stderr=r.stderr, return_code=r.exit_code)

    def _inside(self, box: _Box, path: str) -> str:
        return str(PurePosixPath(box.workdir) / path)  # an absolute `path` stays as it is

    async def upload_file(self, handle: SandboxHandle, source_path: Path, target_path: str) -> None:
        """Copy a host file in (a relative `target_path` is under the spec's workdir).

        Raises:
            SandboxFileError: the source does not exist, or writing it inside failed.
        """
        box = self._box(handle)
        await on_loop(box.ts.sandbox.upload(source_path, self._inside(box, target_path)))

    async def download_file(
        self, handle: SandboxHandle, source_path: str, target_path: Path
    ) -> None:
        """Copy a file out (its parent directories are made).

        Raises:
            SandboxFileError: no such regular file inside, or it is over read_file's cap.
        """
        box = self._box(handle)
        data = await on_loop(box.ts.sandbox.read_file(self._inside(box, source_path)))
        target = Path(target_path)

        def write() -> None:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)

        await asyncio.to_thread(write)

    async def status(self, handle: SandboxHandle) -> SandboxStatus:
        box = self._box(handle)
        running = box.ts.running and box.ts.sandbox.running
        return SandboxStatus.RUNNING if running else SandboxStatus.STOPPED

    async def close(self, handle: SandboxHandle) -> None:
        """Stop the sandbox (idempotent; its task stays known to `evaluate`)."""
        box = self._box(handle)
        self._boxes.pop(handle.sandbox_id, None)
        await on_loop(box.ts.stop())

    async def aclose(self) -> None:
        """Stop the sandboxes still open: nothing outlives the provider.

        Raises:
            Exception: the first error of a `stop()`, after every sandbox was stopped.
        """
        boxes, self._boxes = list(self._boxes.values()), {}
        results = await on_loop(_gather_stops(boxes))
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]

    # ------------------------------------------------------------------ reward

    async def evaluate(
        self, handle: SandboxHandle, patch: str | None = None, *, timeout: float = 1800.0
    ) -> EvalResult:
        """Grade `patch` (default: the agent's changes in the sandbox's /testbed, read before
        `close`) for the sandbox's task in a fresh evaluation sandbox: `.reward` is 1.0 or 0.0.

        Raises:
            AgentEnvironmentError: a plain sandbox (no task), or no patch given after `close`.
        """
        ts = self._box(handle).ts
        return await on_loop(ts.evaluate(patch, timeout=timeout))


async def evaluate(
    task: str | Task,
    patch: str,
    *,
    dataset: str = DEFAULT_DATASET,
    envs_dir: str | None = None,
    cluster: str | None = None,
    builder: Builder | None = None,
    timeout: float = 1800.0,
) -> EvalResult:
    """Grade an episode's `patch` (e.g. mini_swe_agent_2's submission) for `task` (a task id
    of `dataset`, an instance id or an official SWE-bench image name) with minisandbox's
    evaluator, as `MiniSandboxProvider.evaluate` does.

    Raises:
        TaskNotFoundError: `task` is no task of `dataset`.
    """
    resolved = await resolve_task_async(task, dataset, envs_dir)

    async def grade() -> EvalResult:
        runtime = await task_runtime(cluster, builder=builder)
        return await runtime.evaluate(resolved, patch, timeout=timeout)

    return await on_loop(grade())


async def _gather_stops(boxes: list[_Box]) -> list[BaseException | None]:
    return await asyncio.gather(*(box.ts.stop() for box in boxes), return_exceptions=True)


def provider_config(block: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """`{"minisandbox": block}`: the single-key provider config NeMo Gym's `create_provider`
    and `Sandbox(...)` take, for Python callers."""
    return {PROVIDER_NAME: dict(block or {})}
