"""mini-swe-agent on minisandbox: an environment class for its `environment_class` setting.

    environment:
      environment_class: minisandbox.integrations.minisweagent.MiniSandboxEnvironment
      task: examples__semverkit-1        # or an official SWE-bench image name
      dataset: examples

Both protocols are served, told apart by the argument of each call: mini-swe-agent 2.x passes
an action dict (`{"command": ...}`) and expects the environment to raise `Submitted`; 1.x passes
the command string, expects `subprocess.TimeoutExpired` on timeouts and detects submission
itself. The SWE-bench batch runners only hand an image to environments they know by name, so
the task can also be bound by a first command `#minisandbox-task <instance id or image>` (a bash
comment, harmless elsewhere), e.g. `run.env_startup_command: "#minisandbox-task {{instance_id}}"`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any, Literal

from pydantic import ConfigDict
from pydantic.dataclasses import dataclass as pydantic_dataclass

from minisandbox.errors import (
    AgentEnvironmentError,
    CommandTimeoutError,
    NodeLostError,
    TaskNotBoundError,
)
from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.integrations.tasks import (
    DEFAULT_DATASET,
    TaskSandbox,
    resolve_task,
    task_runtime,
)
from minisandbox.sandbox.output import DEFAULT_MAX_OUTPUT
from minisandbox.sandbox.sync import background_loop, call_soon, run_sync
from minisandbox.tasks.builder import Builder

SUBMIT_MARKER = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
# Raw output kept per command for exact decoding; past it, the sandbox's capped head and tail.
_RAW_CAP = DEFAULT_MAX_OUTPUT
_TASK_DIRECTIVE = re.compile(r"^\s*#\s*minisandbox-task[\s:=]+(?P<task>\S+)\s*$")

logger = logging.getLogger("minisweagent.environment")


def as_text(data: bytes | str) -> str:
    """Command output as mini-swe-agent's environments read it (`subprocess` in text mode):
    UTF-8 with undecodable bytes replaced, and universal newlines (\\r\\n and \\r become \\n)."""
    text = data.decode("utf-8", errors="replace") if isinstance(data, bytes) else data
    return text.replace("\r\n", "\n").replace("\r", "\n")


def submission(output: str, returncode: int) -> str | None:
    """What a command submitted, by mini-swe-agent's rule (the marker as the first line of the
    output of a command that succeeded), else None."""
    lines = output.lstrip().splitlines(keepends=True)
    if returncode == 0 and lines and lines[0].strip() == SUBMIT_MARKER:
        return "".join(lines[1:])
    return None


@pydantic_dataclass(config=ConfigDict(extra="ignore"))
class MiniSandboxEnvironmentConfig:
    """Settings of `MiniSandboxEnvironment` (unknown keys, e.g. docker's `run_args`, are ignored
    so a docker config can be reused by changing only `environment_class`). A dataclass, as
    mini-swe-agent's own configs are: 1.x saves trajectories with `dataclasses.asdict`."""

    task: str | None = None
    """A task id of `dataset` or an official SWE-bench image name (or bound later by the
    `#minisandbox-task` directive); without one the environment refuses to run, unless
    `plain`."""
    plain: bool = False
    """Allow a plain sandbox without a task (the host's system and Python, an empty writable
    /testbed): otherwise a missing task is an error before the agent's first step."""
    dataset: str = DEFAULT_DATASET
    """`examples`, a task/records file, or a Hugging Face dataset name (see `load_tasks`)."""
    image: str | None = None
    """What a runner passes as docker's image; used as the task when `task` is unset."""
    envs_dir: str | None = None
    """SWE-bench conda exports (default $MINISANDBOX_ENVS_DIR)."""
    cwd: str = "/testbed"
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    forward_env: list[str] = dataclasses.field(default_factory=list)
    """Host variables copied into each command when set (as docker's `forward_env`)."""
    timeout: int = 30
    interpreter: list[str] = dataclasses.field(default_factory=lambda: ["bash", "-c"])
    sandbox: dict[str, Any] = dataclasses.field(default_factory=dict)
    """Sandbox settings (`SandboxConfig` fields such as `network`), passed through."""
    grade: Literal["submission", "diff"] = "submission"
    """What `evaluate()` scores: "submission" (what the agent submitted, as SWE-bench's
    predictions hold; "" if it never did) or "diff" (its changes in /testbed)."""
    eval_timeout: float = 1800.0
    cluster: str | None = None
    """Run the task's sandboxes and evaluations on the sandbox pool of this Ray cluster
    ("auto": the cluster this process is part of; else a Ray address; docs/cluster.md)."""


def _merge(*dicts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for d in dicts:
        out.update(d)
    return out


class MiniSandboxEnvironment:
    """A mini-swe-agent environment whose commands run in a minisandbox task sandbox."""

    def __init__(
        self,
        *,
        config_class: type = MiniSandboxEnvironmentConfig,
        logger: logging.Logger | None = None,
        builder: Builder | None = None,
        **kwargs: Any,
    ) -> None:
        self.logger = logger or globals()["logger"]
        self.config = config_class(**kwargs)
        self.builder = builder
        self.submission: str | None = None
        self._ts: TaskSandbox | None = None
        self._drop_env: set[str] = set()
        task = self.config.task or self.config.image
        if task:
            # Started at once, as docker's environment does: a task that cannot be built fails
            # the instance before the agent spends model calls on it.
            self.bind_task(task)
            self.start()

    # ------------------------------------------------------------------ lifecycle

    @property
    def task_sandbox(self) -> TaskSandbox:
        if self._ts is None:
            self._ts = TaskSandbox(None, **self.config.sandbox)
        return self._ts

    def bind_task(self, task: str) -> None:
        """Make `task` this environment's task (before its sandbox has started)."""
        if self._ts is not None and self._ts.running:
            raise AgentEnvironmentError(
                "the sandbox is already started; a task must be bound first"
            )
        resolved = resolve_task(task, self.config.dataset, self.config.envs_dir)
        runtime = run_sync(task_runtime(self.config.cluster, builder=self.builder))
        self._ts = TaskSandbox(resolved, runtime=runtime, **self.config.sandbox)
        self.config.task = resolved.id

    def start(self) -> None:
        ts = self.task_sandbox
        if ts.running:
            return
        if ts.task is None:
            self._require_task()
            self.logger.info("minisandbox: no task bound, a plain sandbox with an empty /testbed")
        sb = run_sync(ts.start())
        # A docker config's BASH_ENV names the image's ~/.bashrc (conda activation); a task
        # sandbox is activated without it, and bash would complain on every command.
        for key, value in self.config.env.items():
            if key == "BASH_ENV" and run_sync(sb.execute(["test", "-f", value])).exit_code != 0:
                self._drop_env.add(key)

    def cleanup(self) -> None:
        """Stop the sandbox (the task stays bound: `evaluate()` still works)."""
        ts = self._ts
        if ts is not None and ts.running:
            call_soon(ts.stop())

    close = stop = cleanup

    def __del__(self) -> None:
        # Runners drop environments without closing them (docker's relies on __del__ too).
        # Never wait here: a collection on the loop thread, or at interpreter exit, would hang.
        ts = getattr(self, "_ts", None)
        if ts is None or not ts.running or sys.is_finalizing():
            return
        try:
            asyncio.run_coroutine_threadsafe(ts.stop(), background_loop())
        except Exception:
            pass

    def _require_task(self) -> None:
        """Refuse to run without a task, unless `plain`.

        Raises:
            TaskNotBoundError: no task is bound and `plain` is not set.
        """
        if self.config.plain or (self._ts is not None and self._ts.task is not None):
            return
        raise TaskNotBoundError(
            "MiniSandboxEnvironment has no task, so the agent would work on an empty sandbox: "
            "set `environment.task: <task id>` for one task; for `mini-extra swebench` add "
            '`run.env_startup_command: "#minisandbox-task {{instance_id}}"` (and '
            "`environment.dataset`); `environment.plain: true` asks for a plain sandbox"
        )

    # ------------------------------------------------------------------ commands

    def _env(self) -> dict[str, str]:
        env = {k: v for k in self.config.forward_env if (v := os.environ.get(k)) is not None}
        env.update({k: v for k, v in self.config.env.items() if k not in self._drop_env})
        return env

    def _run(self, command: str, cwd: str, timeout: int | None) -> tuple[str, int]:
        """Run `command`; its output read as mini-swe-agent's environments read theirs.

        Raises:
            subprocess.TimeoutExpired: the command ran past its timeout (it was killed with
                everything it started); `output` holds the bytes it printed until then, as
                `subprocess.run` gives them (what 1.x agents decode, and 2.x environments
                report as `TimeoutExpired`).
        """
        self.start()
        sb = self.task_sandbox.sandbox
        limit = timeout or self.config.timeout
        # The bytes as they come: upstream decodes them itself (replacing what is not UTF-8),
        # where the sandbox's text escapes it. Past the cap the sandbox's head+tail is used.
        raw = bytearray()
        overflow = False

        def collect(fd: int, chunk: bytes) -> None:
            nonlocal overflow
            if len(raw) + len(chunk) > _RAW_CAP:
                overflow = True
            elif not overflow:
                raw.extend(chunk)

        try:
            r = run_sync(
                sb.execute(
                    [*self.config.interpreter, command],
                    cwd=cwd or self.config.cwd,
                    env=self._env(),
                    timeout=limit,
                    merge_stderr=True,
                    on_output=collect,
                )
            )
        except CommandTimeoutError as e:
            partial = bytes(raw) if not overflow else e.output.encode()
            raise subprocess.TimeoutExpired(command, limit, output=partial) from e
        return (as_text(bytes(raw)) if not overflow else as_text(r.stdout)), r.exit_code

    def _directive(self, command: str) -> dict[str, Any] | None:
        m = _TASK_DIRECTIVE.match(command)
        if m is None:
            return None
        if self._ts is not None and self._ts.task is not None:
            # Already bound (task/image given): the directive must name the same task.
            want = resolve_task(m["task"], self.config.dataset, self.config.envs_dir).id
            if want != self._ts.task.id:
                raise AgentEnvironmentError(f"bound to {self._ts.task.id}, not {want}")
        else:
            self.bind_task(m["task"])
        self.start()
        return {"output": f"minisandbox task {self.config.task}\n", "returncode": 0}

    def execute(
        self, action: dict[str, Any] | str, cwd: str = "", *, timeout: int | None = None
    ) -> dict[str, Any]:
        """2.x: `action` is a dict; the result has `exception_info` and a submission raises
        `Submitted`. 1.x: `action` is the command; a timeout raises `TimeoutExpired`."""
        if isinstance(action, dict):
            return self._execute_v2(action, cwd, timeout)
        command = action
        if (out := self._directive(command)) is not None:
            return out
        output, code = self._run(command, cwd, timeout)
        return {"output": output, "returncode": code}

    def _execute_v2(self, action: dict[str, Any], cwd: str, timeout: int | None) -> dict[str, Any]:
        command = str(action.get("command", ""))
        try:
            if (out := self._directive(command)) is not None:
                return out | {"exception_info": ""}
            output, code = self._run(command, cwd, timeout)
            result: dict[str, Any] = {"output": output, "returncode": code, "exception_info": ""}
        except (NodeLostError, TaskNotBoundError):
            raise  # the sandbox is gone with its node, or there is none: the episode ends
        except Exception as e:
            # As mini-swe-agent's own environments: the model sees the failure and goes on (a
            # timeout is `TimeoutExpired`, its message and partial output as LocalEnvironment's).
            raw = getattr(e, "output", None)
            result = {
                "output": as_text(raw) if isinstance(raw, bytes) else (raw or ""),
                "returncode": -1,
                "exception_info": f"An error occurred while executing the command: {e}",
                "extra": {"exception_type": type(e).__name__, "exception": str(e)},
            }
        self._check_finished(result)
        return result

    def _check_finished(self, output: dict[str, Any]) -> None:
        found = submission(output.get("output", ""), output["returncode"])
        if found is not None:
            from minisweagent.exceptions import Submitted

            self.submission = found
            raise Submitted(
                {
                    "role": "exit",
                    "content": self.submission,
                    "extra": {"exit_status": "Submitted", "submission": self.submission},
                }
            )

    # ------------------------------------------------------------------ reward

    def diff(self) -> str:
        """The agent's changes in /testbed as a patch against the task's base commit."""
        self.start()
        return run_sync(self.task_sandbox.diff())

    def evaluate(self, patch: str | None = None) -> EvalResult:
        """Grade `patch` (default: per `grade`, the submission or the diff) in a fresh sandbox."""
        ts = self.task_sandbox
        if ts.task is None:
            raise AgentEnvironmentError("a plain sandbox has no task to evaluate")
        if patch is None:
            patch = self.diff() if self.config.grade == "diff" else self.submission or ""
        return run_sync(ts.evaluate(patch, timeout=self.config.eval_timeout))

    # ------------------------------------------------------------------ mini-swe-agent

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        """The config, `platform.uname()` and `kwargs`, merged (as the docker environment's).

        Raises:
            TaskNotBoundError: no task (agents ask for these before their first model call).
        """
        self._require_task()
        merge: Callable[..., dict[str, Any]]
        try:
            from minisweagent.utils.serialize import recursive_merge as merge
        except ImportError:  # 1.x
            merge = _merge
        # The task is `task_id` here: agents pass the problem statement as `task`, and 1.x
        # renders with both as keyword arguments (a duplicate is an error).
        config = dataclasses.asdict(self.config)
        config["task_id"] = config.pop("task")
        return merge(config, platform.uname()._asdict(), kwargs)

    def serialize(self) -> dict[str, Any]:
        return {
            "info": {
                "config": {
                    "environment": dataclasses.asdict(self.config),
                    "environment_type": f"{type(self).__module__}.{type(self).__name__}",
                }
            }
        }
