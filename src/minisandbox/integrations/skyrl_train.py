"""SkyRL's trainer on minisandbox task sandboxes, chosen by config (needs `skyrl`).

    python -m skyrl.train.entrypoints.main_base \\
        trainer.override_entrypoint=minisandbox.integrations.skyrl_train \\
        environment.skyrl_gym.minisandbox_swe.dataset=examples generator.max_turns=30 ...

`trainer.override_entrypoint` is SkyRL's switch for plugging in a generator and config fields:
its `main_base` hands the command line to this module's `main()`, which parses it with
`MiniSandboxTrainConfig` (so `environment.skyrl_gym.minisandbox_swe.*` and
`generator.mini_swe_agent.*` are accepted) and trains with

- SkyRL's own `SkyRLGymGenerator` stepping `minisandbox_swe` environments (the default), or
- `MiniSWEAgentGenerator` (`generator.mini_swe_agent.enabled=true`): each row is one
  mini-swe-agent 2.x episode on the row's task sandbox, the policy sampled through SkyRL's
  inference client (token ids in, token ids and logprobs out), graded by minisandbox.

Both end an episode after `generator.max_turns` model turns.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skyrl.train.generators.base import GeneratorInput, GeneratorInterface, GeneratorOutput

from minisandbox.integrations.skyrl import (
    CONFIG_PATH,
    ENV_ID,
    MiniSandboxSWEEnvConfig,
    Rollout,
    env_config_of,
    run_rollout,
)
from minisandbox.integrations.skyrl_config import MiniSandboxTrainConfig, MiniSWEAgentConfig
from minisandbox.tasks.builder import Builder

logger = logging.getLogger(__name__)

ENTRYPOINT_ARG = "trainer.override_entrypoint="
# mini-swe-agent 2.x's text format (its swebench_backticks config).
DEFAULT_ACTION_REGEX = r"```mswea_bash_command\s*\n(.*?)\n```"
DEFAULT_OBSERVATION_TEMPLATE = (
    "{% if output.exception_info %}<exception>{{output.exception_info}}</exception>\n{% endif %}"
    "<returncode>{{output.returncode}}</returncode>\n<output>\n{{output.output}}</output>"
)
DEFAULT_FORMAT_ERROR_TEMPLATE = (
    "Please always provide EXACTLY ONE action in triple backticks, "
    "found {{actions|length}} actions."
)


@dataclass
class Turn:
    """One model call of an episode, as the inference engine saw and answered it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float] | None
    stop_reason: str


class PolicyModel:
    """A mini-swe-agent 2.x model (text actions, one code block per reply) whose replies are
    sampled from the policy through SkyRL's inference client. Called from an episode's thread;
    the client's coroutines run on the generator's event loop. Each call is kept in `turns`."""

    def __init__(
        self,
        client: Any,
        tokenizer: Any,
        loop: asyncio.AbstractEventLoop,
        *,
        settings: dict[str, Any] | None = None,
        sampling_params: dict[str, Any] | None = None,
        session_id: str | None = None,
        model_name: str | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        max_input_length: int | None = None,
    ) -> None:
        settings = settings or {}
        self.action_regex = str(settings.get("action_regex") or DEFAULT_ACTION_REGEX)
        self.observation_template = str(
            settings.get("observation_template") or DEFAULT_OBSERVATION_TEMPLATE
        )
        self.format_error_template = str(
            settings.get("format_error_template") or DEFAULT_FORMAT_ERROR_TEMPLATE
        )
        self.client, self.tokenizer, self.loop = client, tokenizer, loop
        self.sampling_params = sampling_params
        self.session_id = session_id
        self.model_name = model_name
        self.chat_template_kwargs = chat_template_kwargs or {}
        self.max_input_length = max_input_length
        self.turns: list[Turn] = []
        self.context_exceeded = False

    def _prompt_ids(self, messages: list[dict[str, Any]]) -> list[int]:
        """`messages` as the policy's prompt token ids.

        Raises:
            LimitsExceeded: they no longer fit `generator.max_input_length`.
        """
        from minisweagent.exceptions import LimitsExceeded

        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids = list(
            self.tokenizer.apply_chat_template(
                chat,
                add_generation_prompt=True,
                tokenize=True,
                return_dict=False,
                **self.chat_template_kwargs,
            )
        )
        if self.max_input_length is not None and len(ids) > self.max_input_length:
            self.context_exceeded = True
            raise LimitsExceeded(
                {
                    "role": "exit",
                    "content": "ContextLengthExceeded",
                    "extra": {"exit_status": "ContextLengthExceeded", "submission": ""},
                }
            )
        return ids

    def query(self, messages: list[dict[str, Any]], **kwargs: Any) -> dict[str, Any]:
        """The policy's next reply, with its parsed action.

        Raises:
            LimitsExceeded: the conversation no longer fits `generator.max_input_length`.
            FormatError: the reply has no single action (it stays in the history, followed by
                the format reminder, so the episode remains one token sequence).
        """
        from minisweagent.exceptions import FormatError
        from minisweagent.models.utils.actions_text import parse_regex_actions

        ids = self._prompt_ids(messages)
        request = {
            "prompt_token_ids": [ids],
            "sampling_params": self.sampling_params,
            "session_ids": [self.session_id] if self.session_id is not None else None,
        }
        out = asyncio.run_coroutine_threadsafe(
            self.client.generate(request, model=self.model_name), self.loop
        ).result()
        text = out["responses"][0]
        logprobs = out.get("response_logprobs")
        stop_reason = out["stop_reasons"][0]
        self.turns.append(
            Turn(
                ids,
                list(out["response_ids"][0]),
                list(logprobs[0]) if logprobs else None,
                stop_reason,
            )
        )
        message: dict[str, Any] = {
            "role": "assistant",
            "content": text,
            "extra": {"cost": 0.0, "timestamp": time.time()},
        }
        try:
            actions = parse_regex_actions(
                text,
                action_regex=self.action_regex,
                format_error_template=self.format_error_template,
                template_kwargs={"finish_reason": stop_reason},
            )
        except FormatError as e:
            raise FormatError(message, *e.messages) from None
        message["extra"]["actions"] = actions
        return message

    def format_message(self, **kwargs: Any) -> dict[str, Any]:
        return dict(kwargs)

    def format_observation_messages(
        self,
        message: dict[str, Any],
        outputs: list[dict[str, Any]],
        template_vars: dict[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        from minisweagent.models.utils.actions_text import format_observation_messages

        return format_observation_messages(  # type: ignore[no-any-return]  # untyped upstream
            outputs, observation_template=self.observation_template, template_vars=template_vars
        )

    def get_template_vars(self, **kwargs: Any) -> dict[str, Any]:
        return {"model_name": self.model_name or "policy"}

    def serialize(self) -> dict[str, Any]:
        return {"info": {"config": {"model": {"model_name": self.model_name or "policy"}}}}


def trajectory_tokens(
    turns: Sequence[Turn],
    messages: Sequence[dict[str, Any]],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> tuple[list[int], list[int], list[int], list[float] | None]:
    """An episode as SkyRL trains on it: (prompt ids, response ids, loss mask, logprobs).

    The response is each turn's sampled tokens (loss 1, the engine's logprobs) with what the
    chat template put between them (observations; loss 0), when every turn's prompt extends
    the previous prompt and reply, as chat templates that keep history verbatim do. Otherwise
    the messages are re-tokenized one by one (SkyRL's helper; no logprobs).
    """
    prompt = list(turns[0].prompt_ids)
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    for k, turn in enumerate(turns):
        if k:
            done = prompt + response
            if turn.prompt_ids[: len(done)] != done:
                return _retokenized(messages, tokenizer, chat_template_kwargs)
            between = turn.prompt_ids[len(done) :]
            response += between
            mask += [0] * len(between)
            logprobs += [0.0] * len(between)
        response += turn.output_ids
        mask += [1] * len(turn.output_ids)
        logprobs += turn.logprobs or [0.0] * len(turn.output_ids)
    with_logprobs = all(t.logprobs is not None for t in turns)
    return prompt, response, mask, logprobs if with_logprobs else None


def _retokenized(
    messages: Sequence[dict[str, Any]],
    tokenizer: Any,
    chat_template_kwargs: dict[str, Any] | None,
) -> tuple[list[int], list[int], list[int], None]:
    from skyrl.train.generators.utils import get_response_ids_and_loss_mask_from_messages

    chat = [{"role": m["role"], "content": m["content"]} for m in messages]
    head, rest = chat[:2], [m for m in chat[2:] if m["role"] in ("user", "assistant")]
    while rest and rest[-1]["role"] != "assistant":
        rest.pop()  # what follows the last reply (its output, the exit) was not generated
    prompt = list(
        tokenizer.apply_chat_template(
            head,
            add_generation_prompt=False,
            tokenize=True,
            return_dict=False,
            **(chat_template_kwargs or {}),
        )
    )
    ids, mask, _ = get_response_ids_and_loss_mask_from_messages(
        rest, tokenizer, None, tokenizer_kwargs=chat_template_kwargs or None
    )
    return prompt, list(ids), list(mask), None


@dataclass
class _Episode:
    rollout: Rollout
    model: PolicyModel
    seconds: float


class MiniSWEAgentGenerator(GeneratorInterface):  # type: ignore[misc]  # skyrl is untyped
    """A SkyRL generator running one mini-swe-agent 2.x episode per row on the row's task
    sandbox, graded by minisandbox's evaluator (reward 1.0 resolved, else 0.0).

    Rows are `minisandbox_swe` rows: `env_extras` name the task (`task`, `instance_id` or an
    `instance` record, whose `problem_statement` the agent gets; else the task's own) and may
    set `dataset`. The prompt column is not used: the agent's templates make the prompt.
    Sandbox settings come from `environment.skyrl_gym.minisandbox_swe`, the agent's from
    `generator.mini_swe_agent`; `generator.max_turns` caps the agent's model calls. A row whose
    episode fails (its sandbox does not start, its extras name no task) does not fail the batch:
    it is logged and trained as reward 0 with its response masked, its error in `env_metrics`."""

    def __init__(
        self,
        generator_cfg: Any,
        skyrl_gym_cfg: Any,
        inference_engine_client: Any,
        tokenizer: Any,
        policy_model_name: str | None = None,
        *,
        builder: Builder | None = None,
    ) -> None:
        """
        Raises:
            ValueError: a setting this generator cannot honour, naming the config line.
        """
        settings = getattr(generator_cfg, "mini_swe_agent", None) or MiniSWEAgentConfig()
        if isinstance(settings, dict):
            settings = MiniSWEAgentConfig(**settings)
        self.settings: MiniSWEAgentConfig = settings
        self.generator_cfg = generator_cfg
        self.env_cfg: MiniSandboxSWEEnvConfig = env_config_of(getattr(skyrl_gym_cfg, ENV_ID, None))
        self.client = inference_engine_client
        self.tokenizer = tokenizer
        self.policy_model_name = policy_model_name
        self.builder = builder
        self.max_turns = generator_cfg.max_turns
        if isinstance(self.max_turns, bool) or not isinstance(self.max_turns, int):
            raise ValueError(f"generator.max_turns must be an integer, got {self.max_turns!r}")
        if self.max_turns < 1:
            raise ValueError(f"generator.max_turns must be at least 1, got {self.max_turns}")
        if getattr(generator_cfg, "step_wise_trajectories", False):
            raise ValueError(
                "generator.step_wise_trajectories=true is not supported by the mini-swe-agent "
                "generator: set it to false"
            )
        if getattr(generator_cfg.chat_template, "name_or_path", None):
            raise ValueError(
                "generator.chat_template.name_or_path is not supported by the mini-swe-agent "
                "generator (the tokenizer's own template renders the episode): unset it"
            )
        self.agent_config = self._load_agent_config()
        workers = getattr(skyrl_gym_cfg, "max_env_workers", 0) or 32
        self.executor = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="msb-episode-")

    def _load_agent_config(self) -> dict[str, Any]:
        """The mini-swe-agent config named by `generator.mini_swe_agent.config`.

        Raises:
            ValueError: the file is missing or is not a mini-swe-agent config.
        """
        import yaml
        from minisweagent.config import get_config_path

        try:
            path = get_config_path(self.settings.config)
        except FileNotFoundError as e:
            raise ValueError(
                f"generator.mini_swe_agent.config={self.settings.config!r}: no such "
                f"mini-swe-agent config ({e})"
            ) from None
        config = yaml.safe_load(path.read_text()) or {}
        agent = config.get("agent") if isinstance(config, dict) else None
        if not isinstance(agent, dict) or "system_template" not in agent:
            raise ValueError(
                f"generator.mini_swe_agent.config={self.settings.config!r} ({path}) has no "
                "`agent.system_template`: name a mini-swe-agent config such as "
                "swebench_backticks"
            )
        return config

    # ------------------------------------------------------------------ one episode

    def _episode(
        self,
        extras: dict[str, Any],
        session_id: str,
        sampling_params: dict[str, Any] | None,
        traj_path: Path | None,
        loop: asyncio.AbstractEventLoop,
    ) -> _Episode:
        t = time.monotonic()
        model = PolicyModel(
            self.client,
            self.tokenizer,
            loop,
            settings=self.agent_config.get("model") or {},
            sampling_params=sampling_params,
            session_id=session_id,
            model_name=self.policy_model_name,
            chat_template_kwargs=dict(self.generator_cfg.chat_template_kwargs or {}),
            max_input_length=self.generator_cfg.max_input_length,
        )
        agent = dict(self.agent_config["agent"])
        agent.update(step_limit=self.max_turns, cost_limit=0.0, output_path=traj_path)
        env = {k: v for k, v in (self.agent_config.get("environment") or {}).items()}
        env.update(
            timeout=self.env_cfg.timeout,
            eval_timeout=self.env_cfg.eval_timeout,
            sandbox=dict(self.env_cfg.sandbox),
            cluster=self.env_cfg.cluster,
        )
        record = dict(extras.get("instance") or {})
        task = extras.get("task") or extras.get("instance_id")
        if task:
            record.setdefault("instance_id", task)
        if "problem_statement" in extras:
            record.setdefault("problem_statement", extras["problem_statement"])
        if not (record.get("instance_id") or record.get("image_name")):
            raise ValueError(
                f"a {ENV_ID} row's extras must name its task: task, instance_id or instance"
            )
        record.setdefault("instance_id", record.get("image_name"))
        dataset = str(extras.get("dataset") or self.env_cfg.dataset)
        rollout = run_rollout(
            record,
            model,
            {"agent": agent, "environment": env},
            dataset,
            builder=self.builder,
        )
        return _Episode(rollout, model, time.monotonic() - t)

    def _output_of(self, episode: _Episode) -> tuple[list[int], list[int], list[int], Any, str]:
        """(prompt ids, response ids, loss mask, logprobs, stop reason) of an episode that
        reached the model."""
        model, rollout = episode.model, episode.rollout
        kwargs = dict(self.generator_cfg.chat_template_kwargs or {})
        prompt, response, mask, logprobs = trajectory_tokens(
            model.turns, rollout.messages, self.tokenizer, kwargs
        )
        stop_reason = "length" if model.context_exceeded else model.turns[-1].stop_reason
        budget = (
            self.generator_cfg.sampling_params.max_generate_length
            + (self.generator_cfg.max_input_length or 0)
            - len(prompt)
        )
        if self.generator_cfg.max_input_length is not None and len(response) > budget:
            response, mask = response[:budget], mask[:budget]
            logprobs = logprobs[:budget] if logprobs is not None else None
            stop_reason = "length"
        return prompt, response, mask, logprobs, stop_reason

    def _failed_output(self, prompt: Any) -> tuple[list[int], list[int], list[int], Any, str]:
        """The output of a row whose episode failed (its sandbox did not start, its extras name
        no task, ...): the row's prompt column as the prompt and a lone EOS with loss 0 as the
        response, so the batch stays trainable and this row teaches nothing."""
        ids = self.tokenizer.apply_chat_template(
            prompt,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **dict(self.generator_cfg.chat_template_kwargs or {}),
        )
        return list(ids), [self.tokenizer.eos_token_id], [0], [0.0], "error"

    def _row(
        self,
        index: int,
        result: _Episode | BaseException,
        session: str,
        extras: dict[str, Any],
        prompt: Any,
    ) -> tuple[tuple[list[int], list[int], list[int], Any, str], float, dict[str, Any], float]:
        """A row's (output, reward, env metrics, seconds). A failed row (its episode raised,
        never reached the model, or gave no tokens) is logged and trained as reward 0 with its
        response masked; its error is in its env metrics (`failed` is 1.0).

        Raises:
            BaseException: `result` is an interrupt (not an `Exception`), re-raised.
        """
        if isinstance(result, BaseException) and not isinstance(result, Exception):
            raise result
        metrics: dict[str, Any] = {"resolved": 0.0, "turns": 0.0}

        def failed(error: str) -> tuple[Any, float, dict[str, Any], float]:
            logger.warning(
                "%s row %d (session %s, extras %r) failed; trained as reward 0 with its "
                "response masked: %s (check the row's task and %s.dataset)",
                ENV_ID,
                index,
                session,
                extras,
                error,
                CONFIG_PATH,
            )
            metrics.update(error=error, failed=1.0)
            return self._failed_output(prompt), 0.0, metrics, 0.0

        if isinstance(result, Exception):
            return failed(f"{type(result).__name__}: {result}")
        rollout = result.rollout
        metrics.update(
            resolved=float(bool(rollout.result and rollout.result.resolved)),
            turns=float(len(result.model.turns)),
            failed=0.0,
            **rollout.timings,
        )
        if rollout.error:
            metrics["error"] = rollout.error  # per row; SkyRL aggregates the numbers only
        if not result.model.turns:
            return failed(f"failed before the model's first turn: {rollout.error}")
        try:
            output = self._output_of(result)
        except Exception as e:
            logger.exception("%s row %d (session %s): no tokens", ENV_ID, index, session)
            return failed(f"{type(e).__name__}: {e}")
        return output, float(rollout.reward), metrics, result.seconds

    # ------------------------------------------------------------------ SkyRL's interface

    def _traj_path(self, meta: Any, session: str) -> Path | None:
        """Where the episode's trajectory is saved (`traj_dir`, per step and phase), or None."""
        if not self.settings.traj_dir:
            return None
        step = f"step_{meta.global_step}" if meta else "step_0"
        phase = str(meta.training_phase) if meta else "train"
        name = re.sub(r"[^\w.-]", "_", session)
        return Path(self.settings.traj_dir) / step / phase / f"{name}.traj.json"

    async def generate(self, input_batch: GeneratorInput, **kwargs: Any) -> GeneratorOutput:
        """One episode per row, in parallel (up to `environment.skyrl_gym.max_env_workers`)."""
        from skyrl.train.generators.utils import get_rollout_metrics

        loop = asyncio.get_running_loop()
        extras = input_batch.get("env_extras") or [{} for _ in input_batch["prompts"]]
        ids = input_batch.get("trajectory_ids")
        meta = input_batch.get("batch_metadata")
        sampling_params = input_batch.get("sampling_params")
        jobs, sessions = [], []
        for i, row in enumerate(extras):
            row["max_turns"] = self.max_turns  # as SkyRL's generator: one limit for every row
            session = ids[i].to_string() if ids else f"row{i}-{time.monotonic_ns()}"
            sessions.append(session)
            traj_path = self._traj_path(meta, session)
            jobs.append(
                loop.run_in_executor(
                    self.executor,
                    self._episode,
                    row,
                    session,
                    sampling_params,
                    traj_path,
                    loop,
                )
            )
        try:
            # Every episode is waited for, failed or not, before its session is finished: a
            # failure must neither end the batch nor leave other rows running in their threads.
            results = await asyncio.gather(*jobs, return_exceptions=True)
        finally:
            for session in sessions:  # frees what session-aware routing holds for them
                await self.client.finish_session(session)
        rows = [
            self._row(i, result, sessions[i], extras[i], input_batch["prompts"][i])
            for i, result in enumerate(results)
        ]
        outputs = [r[0] for r in rows]
        rewards = [r[1] for r in rows]
        env_metrics = [r[2] for r in rows]
        seconds = [r[3] for r in rows]
        responses = [o[1] for o in outputs]
        logprobs = [o[3] for o in outputs]
        return {
            "prompt_token_ids": [o[0] for o in outputs],
            "response_ids": responses,
            "rewards": rewards,
            "loss_masks": [o[2] for o in outputs],
            "stop_reasons": [o[4] for o in outputs],
            "rollout_metrics": get_rollout_metrics(
                responses, rewards, env_metrics, [ENV_ID] * len(outputs)
            ),
            "rollout_logprobs": None if any(lp is None for lp in logprobs) else logprobs,
            "trajectory_ids": ids,
            "trajectory_generation_times": seconds,
            "env_metrics": env_metrics,
        }


# ---------------------------------------------------------------------------- entrypoint


def load_config(argv: Sequence[str]) -> MiniSandboxTrainConfig:
    """SkyRL's config from command-line overrides (`key.path=value`), with minisandbox's
    sections; `trainer.override_entrypoint=...` (main_base's dispatch switch, not a config
    field) is dropped.

    Raises:
        ValueError: an unknown key (SkyRL names it and the valid ones) or an invalid value.
    """
    args = [a for a in argv if not a.startswith(ENTRYPOINT_ARG)]
    return MiniSandboxTrainConfig.from_cli_overrides(args)  # type: ignore[no-any-return]  # skyrl untyped


def make_generator(cfg: Any, tokenizer: Any, inference_engine_client: Any) -> Any:
    """The generator `cfg` asks for: `MiniSWEAgentGenerator` when
    `generator.mini_swe_agent.enabled`, else SkyRL's `SkyRLGymGenerator` (given the
    `environment.skyrl_gym` section, `minisandbox_swe`'s settings included)."""
    from skyrl.backends.skyrl_train.inference_servers.utils import resolve_policy_model_name

    kwargs = {
        "generator_cfg": cfg.generator,
        "skyrl_gym_cfg": cfg.environment.skyrl_gym,
        "inference_engine_client": inference_engine_client,
        "tokenizer": tokenizer,
        "policy_model_name": resolve_policy_model_name(cfg),
    }
    if cfg.generator.mini_swe_agent.enabled:
        return MiniSWEAgentGenerator(**kwargs)
    from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

    return SkyRLGymGenerator(**kwargs)


def experiment_class() -> type:
    """SkyRL's `BasePPOExp` with `make_generator`. Imported on use: SkyRL's experiment module
    brings its whole training stack (Ray placement, trainer, inference servers), which the
    generators and the config do not need."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    class MiniSandboxPPOExp(BasePPOExp):  # type: ignore[misc,valid-type]  # skyrl is untyped
        def get_generator(self, cfg: Any, tokenizer: Any, inference_engine_client: Any) -> Any:
            return make_generator(cfg, tokenizer, inference_engine_client)

    return MiniSandboxPPOExp


def _train(cfg: MiniSandboxTrainConfig) -> None:
    experiment_class()(cfg).run()


def main() -> None:
    """Train with SkyRL (its `main_base` calls this for
    `trainer.override_entrypoint=minisandbox.integrations.skyrl_train`)."""
    import ray
    from skyrl.train.utils import initialize_ray, validate_cfg

    cfg = load_config(sys.argv[1:])
    validate_cfg(cfg)
    initialize_ray(cfg)
    # As SkyRL's own entrypoint: the training loop runs in a Ray task, not on the head process.
    ray.get(ray.remote(num_cpus=1)(_train).remote(cfg))


if __name__ == "__main__":
    main()
