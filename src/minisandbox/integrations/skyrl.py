"""SkyRL rollouts on minisandbox task sandboxes, scored by minisandbox's evaluator (no Docker).

Two pieces, both thin:

- `MiniSandboxSWEEnv`, a skyrl-gym text environment (registered as "minisandbox_swe"): one
  episode is one task sandbox, each model turn's last bash code block is run in it, and the
  episode ends when the agent submits (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` first) or
  runs out of turns; the final step's reward is the task's evaluation reward. Its settings are
  `MiniSandboxSWEEnvConfig` (SkyRL's `environment.skyrl_gym.minisandbox_swe`, which SkyRL's
  trainer accepts through `minisandbox.integrations.skyrl_train`'s entrypoint).
- `run_rollout`, a mini-swe-agent rollout on `MiniSandboxEnvironment` returning what SkyRL's
  mini-swe-agent generator consumes (the trajectory messages, the reward, an error), plus the
  patch. `evaluate_trajectory`/`get_sb_environment` mirror that example's helpers' signatures.
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
import subprocess
import time
from collections.abc import Mapping
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


# Where SkyRL's config holds this environment's settings (skyrl_gym's generator passes them
# as `env_config`), for error messages that name the line to fix.
CONFIG_PATH = f"environment.skyrl_gym.{ENV_ID}"


@dataclass
class MiniSandboxSWEEnvConfig:
    """The settings of a `minisandbox_swe` episode: SkyRL's `environment.skyrl_gym.
    minisandbox_swe` section (also read by the mini-swe-agent generator in `skyrl_train`)."""

    dataset: str = DEFAULT_DATASET
    """Where tasks are looked up: "examples", a records/task file, or a Hugging Face dataset
    (see `load_tasks`); a row's `extras.dataset` overrides it."""
    timeout: int = 60
    """Seconds per command."""
    eval_timeout: float = 1800.0
    """Seconds for grading a submission (the task's tests in a fresh sandbox)."""
    max_turns: int = 50
    """Turns per episode when a row's extras have no `max_turns`. SkyRL's generators always
    set it (from `generator.max_turns`), so this applies to environments made by hand."""
    sandbox: dict[str, Any] = field(default_factory=dict)
    """`SandboxConfig` fields for the task sandboxes, e.g. `{network: false}`."""
    cluster: str | None = None
    """Run the sandboxes on the sandbox pool of this Ray cluster ("auto": the cluster this
    process is part of; docs/cluster.md); None: on this machine."""


def env_config_of(cfg: Any) -> MiniSandboxSWEEnvConfig:
    """`cfg` (None, a `MiniSandboxSWEEnvConfig`, another dataclass, a dict or an OmegaConf
    DictConfig) as a `MiniSandboxSWEEnvConfig`.

    Raises:
        ValueError: a key that is not a setting (a typo would silently fall back to a default).
    """
    if isinstance(cfg, MiniSandboxSWEEnvConfig):
        return cfg
    if cfg is None:
        return MiniSandboxSWEEnvConfig()
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        values = dataclasses.asdict(cfg)
    elif isinstance(cfg, Mapping):
        values = dict(cfg)
    elif hasattr(cfg, "items"):  # an OmegaConf DictConfig
        values = dict(cfg.items())
    else:
        raise ValueError(f"{CONFIG_PATH}: expected a mapping of settings, got {type(cfg).__name__}")
    known = {f.name for f in dataclasses.fields(MiniSandboxSWEEnvConfig)}
    if unknown := sorted(set(values) - known):
        raise ValueError(
            f"{CONFIG_PATH}: unknown settings {unknown}; the settings are {sorted(known)}"
        )
    values["sandbox"] = dict(values.get("sandbox") or {})
    return MiniSandboxSWEEnvConfig(**{k: v for k, v in values.items() if v is not None})


def turn_limit(extras: Mapping[str, Any], default: int) -> int:
    """The episode's turn limit: `extras["max_turns"]` (SkyRL's generators set it on every row
    from `generator.max_turns`), else `default`.

    Raises:
        ValueError: the limit is not a positive integer.
    """
    value = extras.get("max_turns")
    where = "generator.max_turns (extras.max_turns)"
    if value is None:
        value, where = default, f"{CONFIG_PATH}.max_turns"
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where} must be a positive number of turns, got {value!r}")
    return value


def _task_name(extras: dict[str, Any]) -> str | None:
    instance = extras.get("instance") or {}
    return (
        extras.get("task")
        or extras.get("instance_id")
        or instance.get("instance_id")
        or instance.get("image_name")
    )


class MiniSandboxSWEEnv(BaseTextEnv):  # type: ignore[misc,valid-type]  # skyrl-gym is untyped
    """env_config: a `MiniSandboxSWEEnvConfig` (or a mapping of its fields). extras: `task` (or
    `instance_id`, or SkyRL's `instance` record), `max_turns` (set by SkyRL's generator from
    `generator.max_turns`), optional `dataset`."""

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
        cfg = env_config_of(env_config)
        self.max_turns = turn_limit(extras, cfg.max_turns)
        self.env = MiniSandboxEnvironment(
            builder=builder,
            dataset=str(extras.get("dataset") or cfg.dataset),
            timeout=cfg.timeout,
            eval_timeout=cfg.eval_timeout,
            sandbox=dict(cfg.sandbox),
            cluster=cfg.cluster,
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
                    return self._finish("submitted")
                text = f"<returncode>{code}</returncode>\n<output>\n{output}</output>"
        if self.turns >= self.max_turns:
            return self._finish("max_turns")
        # No postprocessed_action: the model's text is kept as sampled (SkyRL's generator would
        # otherwise warn and re-tokenize it).
        return BaseTextEnvStepOutput(
            observations=[{"role": "user", "content": text}],
            reward=0.0,
            done=False,
            metadata={},
            postprocessed_action=None,
        )

    def _finish(self, why: str) -> BaseTextEnvStepOutput:
        t = time.monotonic()
        self.env.cleanup()  # grading uses a fresh sandbox: free this one first
        self.result = self.env.evaluate(self.submission or "")
        self.timings["eval_s"] = time.monotonic() - t
        return BaseTextEnvStepOutput(
            observations=[],
            reward=self.result.reward,
            done=True,
            metadata={"exit": why, "status": self.result.status, "patch": self.submission or ""},
            postprocessed_action=None,
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
