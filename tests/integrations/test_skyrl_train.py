"""SkyRL's trainer side on minisandbox, with SkyRL 0.4's real config loader and generators.

Needs `skyrl` (Python >= 3.12, torch): `scripts/test-stack skyrl` installs it. The policy is a
scripted inference client (SkyRL's `InferenceEngineInterface`, replying with fixed texts per
trajectory) and the tokenizer a real byte-level ChatML tokenizer built here (no model hub).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
pytest.importorskip(
    "skyrl.train.config",
    reason="SkyRL (the `skyrl` trainer package) is not installed: run scripts/test-stack skyrl",
)

import yaml
from skyrl.backends.skyrl_train.inference_servers.base import (
    InferenceEngineInterface,
)
from skyrl.train.config import SkyRLTrainConfig
from skyrl.train.generators.base import BatchMetadata, TrajectoryID
from skyrl.train.generators.skyrl_gym_generator import SkyRLGymGenerator

from minisandbox.integrations.skyrl import MiniSandboxSWEEnvConfig
from minisandbox.integrations.skyrl_config import MiniSandboxTrainConfig
from minisandbox.integrations.skyrl_train import (
    MiniSWEAgentGenerator,
    Turn,
    load_config,
    make_generator,
    trajectory_tokens,
)
from minisandbox.tasks.builder import BuildSettings
from minisandbox.tasks.loaders import load_tasks

ROOT = Path(__file__).resolve().parents[2]
TASK = "examples__datekit-1"
ENTRY = "trainer.override_entrypoint=minisandbox.integrations.skyrl_train"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
# One token per byte here: SkyRL's default input budget (512) would end episodes first.
LONG_INPUT = "generator.max_input_length=65536"
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


APPLY_GOLD = f"git apply <<'EOF_PATCH'\n{gold_patch()}\nEOF_PATCH"


def chatml_tokenizer() -> Any:
    """A real Hugging Face tokenizer: one token per byte, ChatML special tokens and template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = CHATML
    return fast


class ScriptedClient(InferenceEngineInterface):
    """SkyRL's inference client interface answering each trajectory (by its session id, named
    after the trajectory's instance id) with the next of its scripted texts, as token ids
    ending in EOS, with logprobs."""

    def __init__(self, tokenizer: Any, scripts: dict[str, list[str]]) -> None:
        self.tokenizer = tokenizer
        self.scripts = {k: list(v) for k, v in scripts.items()}
        self.calls: dict[str, int] = {k: 0 for k in scripts}
        self.prompts: dict[str, list[list[int]]] = {k: [] for k in scripts}
        self.finished: list[str] = []

    def model_name(self) -> str:
        return "scripted"

    async def generate(self, input_batch: Any, model: str | None = None) -> Any:
        (session,) = input_batch["session_ids"]
        (prompt,) = input_batch["prompt_token_ids"]
        name = session.removesuffix("_0")  # SkyRL's session id: <instance id>_<repetition>
        assert session not in self.finished, f"{session} was finished while its episode ran"
        self.calls[name] += 1
        self.prompts[name].append(list(prompt))
        text = self.scripts[name].pop(0)
        ids = [*self.tokenizer.encode(text, add_special_tokens=False), self.tokenizer.eos_token_id]
        return {
            "responses": [text],
            "response_ids": [ids],
            "stop_reasons": ["stop"],
            "response_logprobs": [[-0.5] * len(ids)],
        }

    async def finish_session(self, session_id: str) -> None:
        self.finished.append(session_id)

    def get_endpoint_url(self) -> str:
        raise NotImplementedError

    def get_world_size(self) -> int:
        raise NotImplementedError

    async def chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def render_chat_completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def completion(self, request_payload: dict[str, Any]) -> dict[str, Any]:
        raise NotImplementedError

    async def wake_up(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def sleep(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError

    async def update_named_weights(self, request: Any) -> None:
        raise NotImplementedError

    async def load_lora_adapter(self, lora_name: str, lora_path: str, *a: Any, **k: Any) -> None:
        raise NotImplementedError

    async def teardown(self) -> None:
        raise NotImplementedError

    async def reset_prefix_cache(self, reset_running_requests: bool = False) -> None:
        raise NotImplementedError

    async def pause_generation(self) -> None:
        raise NotImplementedError

    async def resume_generation(self) -> None:
        raise NotImplementedError


@pytest.fixture
def store_env(settings: BuildSettings, built: list, monkeypatch: pytest.MonkeyPatch) -> None:
    # Environments are made by name inside SkyRL's generator: the store comes from the
    # environment variables a training job would set, not from a Builder.
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_CACHE", str(settings.cache))
    if settings.git_mirror is not None:
        monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))


def batch(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """A GeneratorInput whose trajectory ids make the session ids `<name>_0`."""
    return {
        "prompts": [[{"role": "user", "content": "Fix the bug in /testbed."}] for _ in rows],
        "env_classes": ["minisandbox_swe"] * len(rows),
        "env_extras": list(rows.values()),
        "sampling_params": None,
        "trajectory_ids": [TrajectoryID(instance_id=name, repetition_id=0) for name in rows],
        "batch_metadata": BatchMetadata(global_step=3, training_phase="train"),
    }


# ---------------------------------------------------------------------------- config


def test_config_takes_the_environment_section_skyrl_rejects() -> None:
    overrides = [
        "environment.skyrl_gym.minisandbox_swe.timeout=90",
        "environment.skyrl_gym.minisandbox_swe.sandbox={hostname: trainbox}",
        "generator.max_turns=7",
    ]
    with pytest.raises(ValueError, match=r"Invalid fields \{'minisandbox_swe'\}"):
        SkyRLTrainConfig.from_cli_overrides(overrides)  # why the subclasses exist
    cfg = load_config([ENTRY, *overrides])  # main_base's dispatch argument is not a field
    env = cfg.environment.skyrl_gym.minisandbox_swe
    assert isinstance(cfg, MiniSandboxTrainConfig) and isinstance(env, MiniSandboxSWEEnvConfig)
    assert (env.timeout, env.sandbox, env.dataset) == (90, {"hostname": "trainbox"}, "examples")
    assert cfg.generator.max_turns == 7 and cfg.environment.env_class == "minisandbox_swe"
    assert cfg.environment.skyrl_gym.text2sql is not None  # SkyRL's own envs keep theirs
    with pytest.raises(ValueError, match=r"Invalid fields \{'timeot'\}.*MiniSandboxSWEEnvConfig"):
        load_config(["environment.skyrl_gym.minisandbox_swe.timeot=90"])
    with pytest.raises(ValueError, match=r"Invalid fields \{'enabeld'\}"):
        load_config(["generator.mini_swe_agent.enabeld=true"])


def test_skyrls_entrypoint_dispatches_to_this_module(monkeypatch: pytest.MonkeyPatch) -> None:
    """SkyRL's own `main_base` with `trainer.override_entrypoint` runs this module's `main()`,
    which parses with minisandbox's config: a misspelt setting there fails in our loader,
    before Ray starts (a correct one would go on to train, which needs GPUs)."""
    from skyrl.train.entrypoints import main_base

    from minisandbox.integrations.skyrl_train import experiment_class

    argv = ["main_base", ENTRY, "environment.skyrl_gym.minisandbox_swe.timout=9"]
    monkeypatch.setattr("sys.argv", argv)
    with pytest.raises(ValueError, match=r"Invalid fields \{'timout'\} for MiniSandboxSWEEnv"):
        main_base.main()
    # The experiment the entrypoint trains with builds its generator from the config.
    exp = experiment_class()
    assert issubclass(exp, main_base.BasePPOExp)
    tok = chatml_tokenizer()
    client = ScriptedClient(tok, {})
    for enabled, want in [("false", SkyRLGymGenerator), ("true", MiniSWEAgentGenerator)]:
        cfg = load_config([ENTRY, f"generator.mini_swe_agent.enabled={enabled}"])
        assert type(exp.get_generator(None, cfg, tok, client)) is want


def test_docs_config_blocks_load_with_skyrls_loader() -> None:
    """Every ```yaml block of the SkyRL page is a SkyRL config fragment this entrypoint's
    loader accepts; every ```json block is a data row for `minisandbox_swe`."""
    text = (ROOT / "docs" / "integrations" / "skyrl.md").read_text()
    blocks = re.findall(r"^```(yaml|json)\n(.*?)^```", text, re.DOTALL | re.MULTILINE)
    assert {k for k, _ in blocks} == {"yaml", "json"}, "the page shows a config and a row"

    def dotted(node: Any, prefix: str = "") -> dict[str, Any]:
        if isinstance(node, dict) and node:
            out: dict[str, Any] = {}
            for k, v in node.items():
                out.update(dotted(v, f"{prefix}{k}."))
            return out
        return {prefix[:-1]: node}

    for kind, body in blocks:
        if kind == "json":
            row = json.loads(body)
            assert row["env_class"] == "minisandbox_swe" and row["extras"]["task"]
            continue
        fragment = yaml.safe_load(body)
        cfg = MiniSandboxTrainConfig.from_cli_overrides(dotted(fragment))
        for key, value in dotted(fragment).items():
            node: Any = cfg
            for part in key.split("."):
                node = node[part] if isinstance(node, dict) else getattr(node, part)
            assert node == value, key


# ---------------------------------------------------------------------------- SkyRL's generator


async def test_skyrl_gym_generator_per_env_config_and_max_turns(store_env: None) -> None:
    """SkyRL's own generator, built as its trainer builds it, from the loaded config: the
    environment gets `environment.skyrl_gym.minisandbox_swe` and ends at generator.max_turns."""
    tok = chatml_tokenizer()
    cfg = load_config(
        [
            ENTRY,
            "generator.max_turns=3",
            LONG_INPUT,
            "environment.skyrl_gym.minisandbox_swe.sandbox={hostname: from-config}",
        ]
    )

    def bash(command: str) -> str:
        return f"Running it.\n```bash\n{command}\n```"

    client = ScriptedClient(
        tok,
        {
            "gold": [bash(APPLY_GOLD), bash(SUBMIT)],
            "empty": [bash("uname -n"), bash(SUBMIT)],
            "limit": [bash(APPLY_GOLD), bash("git status --short"), bash("true"), bash(SUBMIT)],
        },
    )
    generator = make_generator(cfg, tok, client)
    assert type(generator) is SkyRLGymGenerator
    rows = {
        "gold": {"task": TASK},
        "empty": {"instance": {"instance_id": TASK}},
        "limit": {"task": TASK, "max_turns": 50},  # SkyRL replaces it with generator.max_turns
    }
    out = await generator.generate(batch(rows), disable_tqdm=True)
    # SkyRL spreads a trajectory's reward over its tokens (on the last one).
    totals = [sum(r) if isinstance(r, list) else r for r in out["rewards"]]
    assert totals == [1.0, 0.0, 0.0]
    assert client.calls == {"gold": 2, "empty": 2, "limit": 3}, "the limit row stops at 3"
    # The configured hostname is the sandbox's: the section reached the environment.
    assert "from-config" in tok.decode(out["response_ids"][1])
    for ids, mask in zip(out["response_ids"], out["loss_masks"], strict=True):
        assert len(ids) == len(mask) and 0 < sum(mask) < len(mask)
    env_s = sum(out["trajectory_time_splits"]["env"])
    grading = sum(m.get("eval_s", 0.0) for m in out.get("env_metrics") or [])
    steps = sum(client.calls.values())
    print(
        f"\nSkyRLGymGenerator: rewards {totals}, {steps} env steps in {env_s:.2f}s, of which "
        f"grading {grading:.2f}s: {(env_s - grading) / steps:.3f}s per step without grading"
    )


# ---------------------------------------------------------------------------- mini-swe-agent


def mswea(command: str) -> str:
    return f"THOUGHT: next step.\n\n```mswea_bash_command\n{command}\n```"


async def test_mini_swe_agent_generator_gold_1_empty_0_max_turns(
    store_env: None, tmp_path: Path
) -> None:
    tok = chatml_tokenizer()
    cfg = load_config(
        [
            ENTRY,
            "generator.mini_swe_agent.enabled=true",
            f"generator.mini_swe_agent.traj_dir={tmp_path}",
            "generator.max_turns=3",
            LONG_INPUT,
            "environment.skyrl_gym.minisandbox_swe.sandbox={hostname: from-config}",
        ]
    )
    client = ScriptedClient(
        tok,
        {
            "gold": [mswea(APPLY_GOLD), mswea(SUBMIT)],
            # a reply without an action (a format error), then the hostname, then submitting
            "empty": ["I am not sure.", mswea("uname -n"), mswea(SUBMIT)],
            "limit": [mswea(APPLY_GOLD), mswea("git status"), mswea("git diff"), mswea(SUBMIT)],
        },
    )
    generator = make_generator(cfg, tok, client)
    assert isinstance(generator, MiniSWEAgentGenerator)
    rows = {
        "gold": {"instance": {"instance_id": TASK, "problem_statement": "fix datekit's bug"}},
        "empty": {"task": TASK},
        "limit": {"task": TASK},
    }
    inputs = batch(rows)
    out = await generator.generate(inputs)

    assert out["rewards"] == [1.0, 0.0, 0.0]
    assert client.calls == {"gold": 2, "empty": 3, "limit": 3}, "max_turns=3 ends 'limit'"
    assert sorted(client.finished) == ["empty_0", "gold_0", "limit_0"]
    assert [extras["max_turns"] for extras in inputs["env_extras"]] == [3, 3, 3]
    assert "fix datekit's bug" in tok.decode(out["prompt_token_ids"][0])
    assert "from-config" in tok.decode(out["response_ids"][1])
    assert out["stop_reasons"] == ["stop"] * 3
    # Token in, token out: each sampled reply is in the response with loss 1 and its logprobs.
    assert out["rollout_logprobs"] is not None
    for name, ids, mask, lps in zip(
        rows, out["response_ids"], out["loss_masks"], out["rollout_logprobs"], strict=True
    ):
        assert len(ids) == len(mask) == len(lps)
        assert lps.count(-0.5) == sum(mask) > 0
        # Each prompt the engine saw is the episode so far: the prompt and a response prefix.
        full = out["prompt_token_ids"][list(rows).index(name)] + ids
        for prompt in client.prompts[name]:
            assert full[: len(prompt)] == prompt
    assert "I am not sure." in tok.decode(out["response_ids"][1])
    trajs = sorted(p.name for p in tmp_path.rglob("*.traj.json"))
    assert trajs == ["empty_0.traj.json", "gold_0.traj.json", "limit_0.traj.json"]
    saved = json.loads(next(tmp_path.rglob("limit_0.traj.json")).read_text())
    assert saved["info"]["exit_status"] == "LimitsExceeded"
    m = out["env_metrics"]
    print(
        f"\nMiniSWEAgentGenerator: rewards {out['rewards']}, turns "
        f"{[x['turns'] for x in m]}, start {[round(x['start_s'], 3) for x in m]}s, "
        f"agent {[round(x['agent_s'], 3) for x in m]}s, eval {[round(x['eval_s'], 2) for x in m]}s"
    )


async def test_mini_swe_agent_generator_a_failed_row_does_not_fail_the_batch(
    store_env: None, caplog: pytest.LogCaptureFixture
) -> None:
    """A row whose task does not exist (its sandbox never starts) and one whose extras name no
    task (its episode raises) come back as reward 0 with a fully masked response, beside a gold
    row that still runs to its end (its session is not finished under it: the client checks)."""
    from skyrl.train.utils.trainer_utils import validate_generator_output

    tok = chatml_tokenizer()
    cfg = load_config(
        [ENTRY, "generator.mini_swe_agent.enabled=true", "generator.max_turns=3", LONG_INPUT]
    )
    client = ScriptedClient(
        tok, {"gold": [mswea(APPLY_GOLD), mswea(SUBMIT)], "missing": [], "untasked": []}
    )
    generator = make_generator(cfg, tok, client)
    rows = {
        "missing": {"task": "examples__no-such-task-1"},
        "untasked": {"problem_statement": "no task named"},
        "gold": {"task": TASK},
    }
    with caplog.at_level("WARNING", logger="minisandbox.integrations.skyrl_train"):
        out = await generator.generate(batch(rows))

    assert out["rewards"] == [0.0, 0.0, 1.0]
    assert client.calls == {"gold": 2, "missing": 0, "untasked": 0}
    assert sorted(client.finished) == ["gold_0", "missing_0", "untasked_0"]
    validate_generator_output(3, out)  # SkyRL's own check of a batch it trains on
    for k in (0, 1):
        assert out["response_ids"][k] == [tok.eos_token_id] and out["loss_masks"][k] == [0]
        assert out["stop_reasons"][k] == "error" and out["env_metrics"][k]["failed"] == 1.0
        assert "Fix the bug in /testbed." in tok.decode(out["prompt_token_ids"][k])
    assert sum(out["loss_masks"][2]) > 0 and out["env_metrics"][2]["failed"] == 0.0
    assert "no-such-task" in out["env_metrics"][0]["error"]
    assert "must name its task" in out["env_metrics"][1]["error"]
    assert out["rollout_metrics"]["environment/failed"] == pytest.approx(2 / 3)
    logged = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    for k, name in enumerate(["missing_0", "untasked_0"]):
        assert any(f"row {k} (session {name}" in m for m in logged), logged


def test_mini_swe_agent_generator_refuses_bad_settings() -> None:
    tok = chatml_tokenizer()
    client = ScriptedClient(tok, {})
    for overrides, match in [
        (["generator.max_turns=0"], "generator.max_turns must be at least 1"),
        (["generator.mini_swe_agent.config=no-such-config"], "generator.mini_swe_agent.config"),
        (["generator.step_wise_trajectories=true"], "generator.step_wise_trajectories"),
    ]:
        cfg = load_config(["generator.mini_swe_agent.enabled=true", *overrides])
        with pytest.raises(ValueError, match=match):
            make_generator(cfg, tok, client)


def test_trajectory_tokens_falls_back_to_retokenizing() -> None:
    """A template that rewrites history (so a later prompt does not extend the earlier reply)
    gets SkyRL's per-message tokenization, without logprobs."""
    tok = chatml_tokenizer()
    head = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    chat = [*head, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "o1"}]

    def ids(messages: list[dict[str, str]]) -> list[int]:
        return list(
            tok.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )

    reply = [*tok.encode("a1", add_special_tokens=False), tok.eos_token_id]
    turns = [
        Turn(ids(head), reply, [-1.0] * len(reply), "stop"),
        Turn(ids(chat), reply, [-1.0] * len(reply), "stop"),
    ]
    prompt, response, mask, lps = trajectory_tokens(turns, [*chat, chat[2]], tok)
    assert prompt == ids(head) and lps is not None and len(lps) == len(response)
    assert [i for i, m in zip(response, mask, strict=True) if m] == reply + reply
    turns[1] = Turn(ids([*head, {"role": "assistant", "content": "rewritten"}]), reply, None, "")
    prompt, response, mask, lps = trajectory_tokens(turns, [*chat, chat[2]], tok)
    assert lps is None and len(response) == len(mask) and sum(mask) > 0
    assert tok.decode([i for i, m in zip(response, mask, strict=True) if m]).count("a1") == 2
