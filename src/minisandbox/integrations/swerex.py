"""SWE-ReX on minisandbox: a deployment and a runtime that code written against SWE-ReX uses
unchanged, with sandboxes instead of containers.

    from minisandbox.integrations.swerex import MiniSandboxDeployment
    deployment = MiniSandboxDeployment(task="tablekit-001")   # or no task: a plain sandbox
    await deployment.start()
    await deployment.runtime.create_session(CreateBashSessionRequest())
    await deployment.runtime.run_in_session(BashAction(command="git status"))

Semantics follow swerex's LocalRuntime: its request and response models, its exceptions, the
`check` modes of BashAction and Command, interactive commands and `expect` patterns (regexes, as
pexpect reads them). Sessions are our ShellSessions (a bash on a real pty inside the sandbox):
outputs come without the pty's stray carriage returns that LocalRuntime leaves in.

As a config: `deployment_config(data)` validates a deployment's settings (a dict, e.g. from
YAML) through our config for `type: minisandbox` and SWE-ReX's union for its own types, and
refuses what SWE-ReX would silently take for a Daytona deployment (its config has no `type`:
any unknown `type`, e.g. `minisandbox` before `register()`, ends up there). `register()` makes
SWE-ReX's own union accept `type: minisandbox` for code that reads it afterwards.

Callers such as SWE-agent drive the runtime through `asyncio.run()`, a fresh event loop per
call, while a sandbox belongs to the loop that started it. Every sandbox therefore lives on one
background loop (a daemon thread) and the public methods hand their work to it.
"""

from __future__ import annotations

import asyncio
import logging
import typing
from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

try:
    from swerex.deployment import config as _swerex_config
    from swerex.deployment.abstract import AbstractDeployment
    from swerex.deployment.hooks.abstract import CombinedDeploymentHook, DeploymentHook
    from swerex.exceptions import DeploymentNotStartedError, DeploymentStartupError
    from swerex.runtime.abstract import IsAliveResponse
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        f"minisandbox.integrations.swerex needs SWE-ReX ({e}): "
        "install the `swerex` extra (in a checkout of swe-minisandbox: pip install -e '.[swerex]')"
    ) from e

from minisandbox import errors
from minisandbox.integrations.swerex_runtime import MiniSandboxRuntime, default_logger
from minisandbox.integrations.tasks import (
    DEFAULT_DATASET,
    TaskSandbox,
    resolve_task,
    task_runtime,
)
from minisandbox.sandbox.config import Limits
from minisandbox.sandbox.rootfs import DEFAULT_PATH
from minisandbox.sandbox.sync import on_loop

__all__ = [
    "MiniSandboxDeployment",
    "MiniSandboxDeploymentConfig",
    "MiniSandboxRuntime",
    "deployment_config",
    "register",
    "registered",
]

# A plain sandbox's directory on PATH for a `python` alias (tools' shebangs ask for one).
_ALIAS_DIR = "/root/.local/bin"


class MiniSandboxDeploymentConfig(BaseModel):
    """A minisandbox deployment: a task's environment (built on first use) or a plain sandbox
    (the host's system and Python, an empty writable /testbed)."""

    task: str | None = None
    """A task id of `dataset`, or an official SWE-bench image name. None: a plain sandbox."""
    image: str | None = None
    """An official SWE-bench image name (what SWE-agent's batch mode sets per instance); used
    when `task` is not given."""
    dataset: str = DEFAULT_DATASET
    """Where the tasks come from (a name `load_tasks` knows or a path)."""
    envs_dir: str | None = None
    """SWE-bench conda exports, for datasets that need them (default $MINISANDBOX_ENVS_DIR)."""
    build: bool = True
    """Build the task's layers on first use when they are missing."""
    network: bool = False
    """Network access (off: tasks are evaluated offline too)."""
    limits: Limits = Field(default_factory=Limits)
    env: dict[str, str] = Field(default_factory=dict)
    """Extra environment variables inside the sandbox."""
    startup_timeout: float = 1800.0
    """Seconds to wait for the sandbox, a build of the task included."""
    cluster: str | None = None
    """Run a task's sandbox on the sandbox pool of this Ray cluster ("auto": the cluster this
    process is part of; else a Ray address; docs/cluster.md)."""

    type: Literal["minisandbox"] = "minisandbox"
    """Discriminator for (de)serialization/CLI. Do not change."""

    model_config = ConfigDict(extra="forbid")

    def get_deployment(self) -> MiniSandboxDeployment:
        return MiniSandboxDeployment.from_config(self)


class MiniSandboxDeployment(AbstractDeployment):
    """swerex's AbstractDeployment: `start()` opens the sandbox, `stop()` removes it."""

    def __init__(self, *, logger: logging.Logger | None = None, **kwargs: Any) -> None:
        self._config = MiniSandboxDeploymentConfig(**kwargs)
        self.logger = logger or default_logger()
        self._hooks = CombinedDeploymentHook()
        self._box: TaskSandbox | None = None
        self._runtime: MiniSandboxRuntime | None = None

    @classmethod
    def from_config(cls, config: MiniSandboxDeploymentConfig) -> MiniSandboxDeployment:
        return cls(**config.model_dump())

    @property
    def config(self) -> MiniSandboxDeploymentConfig:
        return self._config

    @property
    def task_sandbox(self) -> TaskSandbox:
        """The started TaskSandbox (for `diff()` and `evaluate()`)."""
        if self._box is None:
            raise DeploymentNotStartedError()
        return self._box

    def add_hook(self, hook: DeploymentHook) -> None:
        self._hooks.add_hook(hook)

    async def is_alive(self, *, timeout: float | None = None) -> IsAliveResponse:
        if self._runtime is None:
            return IsAliveResponse(is_alive=False, message="Runtime is None.")
        return await self._runtime.is_alive(timeout=timeout)

    async def start(self) -> None:
        if self._runtime is not None:
            return
        await on_loop(self._start())

    async def _start(self) -> None:
        cfg = self._config
        name = cfg.task or cfg.image
        task = None
        if name:
            self._hooks.on_custom_step("Resolving task")
            try:
                task = resolve_task(name, cfg.dataset, cfg.envs_dir)
            except errors.MiniSandboxError as e:
                raise DeploymentStartupError(str(e)) from e
        self._hooks.on_custom_step("Starting sandbox")
        overrides: dict[str, Any] = {"network": cfg.network, "limits": cfg.limits}
        # Offline, pip's retries only add a minute per install (SWE-agent's tool bundles try
        # `pip install`): fail at once, with the same outcome.
        env = dict(cfg.env) if cfg.network else {"PIP_RETRIES": "0", **cfg.env}
        if task is None:
            # The host may have python3 but no `python`, which tools' shebangs (SWE-agent's)
            # ask for: a plain sandbox gets an alias in a directory of its own on PATH.
            overrides["env"] = {"PATH": f"{_ALIAS_DIR}:{DEFAULT_PATH}", **env}
        else:
            overrides["build"] = cfg.build
            overrides["extra_env"] = env
            overrides["runtime"] = await task_runtime(cfg.cluster)
        box = TaskSandbox(task, **overrides)
        try:
            sandbox = await asyncio.wait_for(box.start(), cfg.startup_timeout)
        except asyncio.TimeoutError:
            await box.stop()
            raise DeploymentStartupError(
                f"the sandbox did not start within {cfg.startup_timeout} s"
            ) from None
        except errors.MiniSandboxError as e:
            await box.stop()
            raise DeploymentStartupError(str(e)) from e
        if task is None:
            await sandbox.execute(
                f"command -v python >/dev/null || {{ mkdir -p {_ALIAS_DIR} && "
                f'ln -sf "$(command -v python3)" {_ALIAS_DIR}/python; }}'
            )
        self._box = box
        self._runtime = MiniSandboxRuntime(sandbox, logger=self.logger)
        self.logger.debug(
            "minisandbox %s started (%s)", sandbox.id, f"task {task.id}" if task else "plain"
        )

    async def stop(self) -> None:
        runtime, box, self._runtime, self._box = self._runtime, self._box, None, None
        if box is None:
            return

        async def stop() -> None:
            if runtime is not None and box.running:
                await runtime._close()
            await box.stop()

        await on_loop(stop())

    @property
    def runtime(self) -> MiniSandboxRuntime:
        if self._runtime is None:
            raise DeploymentNotStartedError()
        return self._runtime

    # Helpers for training loops: the agent's diff and its reward, without leaving swerex.
    async def diff(self) -> str:
        return await on_loop(self.task_sandbox.diff())

    async def evaluate(self, patch: str | None = None, *, timeout: float = 1800.0) -> Any:
        return await on_loop(self.task_sandbox.evaluate(patch, timeout=timeout))


# ---------------------------------------------------------------- configs


def registered() -> bool:
    """Whether SWE-ReX's DeploymentConfig union accepts `type: minisandbox`."""
    return MiniSandboxDeploymentConfig in typing.get_args(_swerex_config.DeploymentConfig)


def register() -> None:
    """Add `type: minisandbox` to SWE-ReX's DeploymentConfig union, for code that reads the
    union afterwards (`swerex.deployment.config.DeploymentConfig`; a module that imported the
    name before keeps the old union: for SWE-agent use integrations.sweagent.register()).
    Idempotent."""
    if not registered():
        # The union, widened at run time (a type alias to mypy).
        _swerex_config.DeploymentConfig = (  # type: ignore[assignment,misc]
            _swerex_config.DeploymentConfig | MiniSandboxDeploymentConfig
        )


def _types() -> dict[str, type[BaseModel]]:
    """The config classes of SWE-ReX's union (and ours) by their `type`."""
    found: dict[str, type[BaseModel]] = {"minisandbox": MiniSandboxDeploymentConfig}
    for cls in typing.get_args(_swerex_config.DeploymentConfig):
        field = cls.model_fields.get("type")
        if field is not None and isinstance(field.default, str):
            found[field.default] = cls
    return found


def deployment_config(data: Mapping[str, Any]) -> BaseModel:
    """A deployment's settings (`deployment:` of a YAML config, as a dict) as a config object
    whose `get_deployment()` makes the deployment: ours for `type: minisandbox`, else SWE-ReX's.
    Unlike validating with SWE-ReX's union, an unknown or missing `type` is an error (there it
    silently becomes a Daytona deployment, the one config without a `type`; a Daytona config
    is accepted when its keys are all Daytona's).

    Raises:
        ValueError: no or an unknown `type`, or settings the type's config does not accept
            (pydantic's ValidationError, a ValueError).
    """
    kinds = _types()
    kind = data.get("type")
    if kind is None:
        daytona = getattr(_swerex_config, "DaytonaDeploymentConfig", None)
        if daytona is not None and data and set(data) <= set(daytona.model_fields):
            return TypeAdapter(daytona).validate_python(dict(data))
        raise ValueError(
            "deployment: no `type`: add `type: minisandbox` (or one of "
            f"{', '.join(sorted(kinds))}); without it SWE-ReX takes the settings for a Daytona "
            "deployment"
        )
    if kind not in kinds:
        raise ValueError(
            f"deployment: unknown type {kind!r}: one of {', '.join(sorted(kinds))} "
            "(SWE-ReX would take it for a Daytona deployment)"
        )
    return kinds[kind].model_validate(dict(data))
