"""SkyRL rollouts on minisandbox task sandboxes, scored by minisandbox's evaluator (no Docker).

Two pieces, both thin:

- `MiniSandboxSWEEnv`, a skyrl-gym text environment (registered as "minisandbox_swe"): one
  episode is one task sandbox, each model turn's last bash code block is run in it, and the
  episode ends when the agent submits (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` first) or
  runs out of turns; the final step's reward is the task's evaluation reward.
- `run_rollout`, a mini-swe-agent rollout on `MiniSandboxEnvironment` returning what SkyRL's
  mini-swe-agent generator consumes (the trajectory messages, the reward, an error), plus the
  patch. `evaluate_trajectory`/`get_sb_environment` mirror that example's helpers' signatures.
"""

from __future__ import annotations

import asyncio
import re
import subprocess
import time
from dataclasses import dataclass, field
from typing import Any

from minisandbox.evaluation.evaluator import EvalResult
from minisandbox.integrations.minisweagent import MiniSandboxEnvironment, submission
from minisandbox.integrations.tasks import DEFAULT_DATASET
from minisandbox.tasks.builder import Builder

try:
    from skyrl_gym.envs.base_text_env import BaseTextEnv, BaseTextEnvStepOutput
except ImportError:  # the rollout helpers below work without skyrl-gym
    BaseTextEnv = object  # type: ignore[assignment,misc]  # a stand-in class
    BaseTextEnvStepOutput = dict  # type: ignore[assignment,misc]  # a stand-in class

ENV_ID = "minisandbox_swe"
# mini-swe-agent's text format (2.x "mswea_bash_command", 1.x "bash") and plain blocks.
_BLOCK = re.compile(r"```(?:mswea_bash_command|bash|sh)?[ \t]*\n(.*?)\n?```", re.DOTALL)


def _get(cfg: Any, key: str, default: Any) -> Any:
    """A setting from a dict, an OmegaConf DictConfig or a dataclass."""
    if cfg is None:
        return default
    value = cfg.get(key, default) if hasattr(cfg, "get") else getattr(cfg, key, default)
    return default if value is None else value


def _task_name(extras: dict[str, Any]) -> str | None:
    instance = extras.get("instance") or {}
    return (
        extras.get("task")
        or extras.get("instance_id")
        or instance.get("instance_id")
        or instance.get("image_name")
    )


class MiniSandboxSWEEnv(BaseTextEnv):  # type: ignore[misc,valid-type]  # skyrl-gym is untyped
    """env_config: dataset, timeout, eval_timeout, max_turns, sandbox (SandboxConfig fields).
    extras: `task` (or `instance_id`, or SkyRL's `instance` record), optional `max_turns`."""

    def __init__(
        self,
        env_config: Any = None,
        extras: dict[str, Any] | None = None,
        *,
        builder: Builder | None = None,
    ) -> None:
        super().__init__()
        extras = dict(extras or {})
        task = _task_name(extras)
        if not task:
            raise ValueError("extras must name the task: task, instance_id or instance")
        self.max_turns = int(extras.get("max_turns") or _get(env_config, "max_turns", 50))
        self.env = MiniSandboxEnvironment(
            builder=builder,
            dataset=str(extras.get("dataset") or _get(env_config, "dataset", DEFAULT_DATASET)),
            timeout=int(_get(env_config, "timeout", 60)),
            eval_timeout=float(_get(env_config, "eval_timeout", 1800.0)),
            sandbox=dict(_get(env_config, "sandbox", {})),
            cluster=_get(env_config, "cluster", None),
        )
        self.env.bind_task(task)
        self.result: EvalResult | None = None
        self.submission: str | None = None
        self.timings: dict[str, float] = {}

    def init(self, prompt: list[dict[str, str]]) -> tuple[list[dict[str, str]], dict[str, Any]]:
        t = time.monotonic()
        self.env.start()
        self.timings["start_s"] = time.monotonic() - t
        return prompt, {"task_id": self.env.config.task}

    def step(self, action: str) -> BaseTextEnvStepOutput:
        self.turns += 1
        blocks = _BLOCK.findall(action)
        if not blocks:
            text = "No bash code block found: reply with exactly one ```bash block."
        else:
            command = blocks[-1]
            try:
                out = self.env.execute(command)
                output, code = out["output"], out["returncode"]
            except subprocess.TimeoutExpired as e:
                output = (e.output or b"").decode(errors="replace")
                text = f"The command timed out.\n<output>\n{output}</output>"
            else:
                found = submission(output, code)
                if found is not None:
                    self.submission = found
                    return self._finish(action, "submitted")
                text = f"<returncode>{code}</returncode>\n<output>\n{output}</output>"
        if self.turns >= self.max_turns:
            return self._finish(action, "max_turns")
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}],
            reward=0.0,
            done=False,
            metadata={},
            postprocessed_action=action,
        )

    def _finish(self, action: str, why: str) -> BaseTextEnvStepOutput:
        t = time.monotonic()
        self.env.cleanup()  # grading uses a fresh sandbox: free this one first
        self.result = self.env.evaluate(self.submission or "")
        self.timings["eval_s"] = time.monotonic() - t
        return BaseTextEnvStepOutput(
            observations=[],
            reward=self.result.reward,
            done=True,
            metadata={"exit": why, "status": self.result.status, "patch": self.submission or ""},
            postprocessed_action=action,
        )

    def get_metrics(self) -> dict[str, Any]:
        return {"resolved": float(bool(self.result and self.result.resolved)), **self.timings}

    def close(self) -> None:
        self.env.cleanup()


def register_env() -> None:
    """Register `MiniSandboxSWEEnv` with skyrl-gym as "minisandbox_swe" (idempotent)."""
    from skyrl_gym.envs.registration import register, registry

    if ENV_ID not in registry:
        register(id=ENV_ID, entry_point=f"{__name__}:MiniSandboxSWEEnv")


if BaseTextEnv is not object:
    register_env()


# ---------------------------------------------------------------------------- rollouts


@dataclass
class Rollout:
    messages: list[dict[str, Any]]
    reward: float
    error: str | None
    patch: str
    exit_status: str
    result: EvalResult | None = None
    timings: dict[str, float] = field(default_factory=dict)

    def as_tuple(self) -> tuple[list[dict[str, Any]], float, str | None]:
        """The `(messages, reward, error)` SkyRL's mini-swe-agent generator unpacks."""
        return self.messages, self.reward, self.error


def get_sb_environment(
    config: dict[str, Any],
    instance: dict[str, Any],
    data_source: str = DEFAULT_DATASET,
    *,
    builder: Builder | None = None,
) -> MiniSandboxEnvironment:
    """The example's environment factory, on a minisandbox task sandbox: `data_source` is the
    minisandbox dataset holding `instance` (by id, or its `image_name`)."""
    env_config = {
        k: v for k, v in config.get("environment", {}).items() if k != "environment_class"
    }
    env_config.setdefault("dataset", data_source)
    env_config["task"] = instance.get("image_name") or instance["instance_id"]
    return MiniSandboxEnvironment(builder=builder, **env_config)


def evaluate_trajectory(
    instance: dict[str, Any],
    model_patch: str,
    config: dict[str, Any],
    data_source: str = DEFAULT_DATASET,
    *,
    builder: Builder | None = None,
) -> dict[str, Any]:
    """The example's `{instance_id, resolved, eval_error}`, graded by minisandbox."""
    env = get_sb_environment(config, instance, data_source, builder=builder)
    try:
        r = env.evaluate(model_patch or "")
    finally:
        env.cleanup()
    err = None if r.resolved else f"{r.status}: {r.reason}\n{r.log[-1000:]}"
    return {"instance_id": instance["instance_id"], "resolved": r.resolved, "eval_error": err}


def run_rollout(
    instance: dict[str, Any] | str,
    model: Any,
    config: dict[str, Any],
    data_source: str = DEFAULT_DATASET,
    *,
    builder: Builder | None = None,
    agent_class: type | None = None,
) -> Rollout:
    """One mini-swe-agent episode on a task sandbox, graded by minisandbox. `instance` is a
    record with `instance_id` (and `problem_statement`) or a task id; `model` a mini-swe-agent
    model (None: built from `config["model"]`); `config` a mini-swe-agent config (agent,
    environment, model sections)."""
    from minisweagent.agents.default import DefaultAgent

    if isinstance(instance, str):
        instance = {"instance_id": instance}
    if model is None:
        from minisweagent.models import get_model

        model = get_model(config=config.get("model", {}))
    agent, env, patch, error, status = None, None, "", None, ""
    timings: dict[str, float] = {}
    t = time.monotonic()
    try:
        env = get_sb_environment(config, instance, data_source, builder=builder)
        timings["start_s"] = time.monotonic() - t
        task = env.task_sandbox.task
        statement = instance.get("problem_statement") or (task.problem_statement if task else "")
        agent = (agent_class or DefaultAgent)(model, env, **config.get("agent", {}))
        out = agent.run(statement)
        if isinstance(out, tuple):  # 1.x: (exit_status, submission)
            status, patch = out
        else:
            status, patch = out.get("exit_status", ""), out.get("submission", "") or ""
    except Exception as e:
        status, error = type(e).__name__, str(e)
    timings["agent_s"] = time.monotonic() - t - timings.get("start_s", 0.0)
    result, reward = None, 0.0
    if env is not None:
        t = time.monotonic()
        try:
            env.cleanup()
            result = env.evaluate(patch)
            reward = result.reward
            if result.status == "error" and error is None:
                error = result.reason or "evaluation error"
        except Exception as e:
            error = error or f"evaluation failed: {e}"
        timings["eval_s"] = time.monotonic() - t
    messages = list(agent.messages) if agent is not None else []
    return Rollout(messages, reward, error, patch, status, result, timings)


async def arun_rollout(*args: Any, **kwargs: Any) -> Rollout:
    """`run_rollout` off the event loop, for SkyRL's async generator."""
    return await asyncio.to_thread(run_rollout, *args, **kwargs)
