"""SkyRL on minisandbox with the real packages: the skyrl-gym environment made by name and
stepped with model text, and a mini-swe-agent rollout in the shape SkyRL's generator unpacks."""

from __future__ import annotations

import os
import time

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (extra: skyrl)")

from minisandbox.integrations.skyrl import (  # noqa: E402
    ENV_ID,
    MiniSandboxSWEEnv,
    MiniSandboxSWEEnvConfig,
    run_rollout,
)
from minisandbox.tasks.builder import Builder, BuildSettings  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402

TASK = "examples__datekit-1"
PROMPT = [{"role": "user", "content": "fix it"}]


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


def bash(command: str) -> str:
    return f"Let me run this.\n\n```bash\n{command}\n```"


def apply_gold() -> str:
    return bash(f"git apply <<'EOF_PATCH'\n{gold_patch()}\nEOF_PATCH")


SUBMIT = bash("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff")


def test_gym_env_gold_patch_reward_1(
    settings: BuildSettings, built: list, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Made by name as SkyRL does, so the store comes from the environment, not a Builder.
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_CACHE", str(settings.cache))
    monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))
    env = skyrl_gym.make(ENV_ID, env_config={"timeout": 60}, extras={"task": TASK})
    assert isinstance(env, MiniSandboxSWEEnv)
    t0 = time.monotonic()
    try:
        prompt, info = env.init(PROMPT)
        assert prompt == PROMPT and info == {"task_id": TASK}
        out = env.step("no code block here")
        assert not out["done"] and "No bash code block" in out["observations"][0]["content"]
        out = env.step(apply_gold())
        assert not out["done"] and out["reward"] == 0.0
        assert "<returncode>0</returncode>" in out["observations"][0]["content"]
        out = env.step(SUBMIT)
        assert out["done"] and out["reward"] == 1.0, out["metadata"]
        assert out["metadata"]["exit"] == "submitted" and "+++ b/" in out["metadata"]["patch"]
        metrics = env.get_metrics()
        assert metrics["resolved"] == 1.0
        print(f"\nper-episode overhead (gym env): {metrics} total {time.monotonic() - t0:.2f}s")
    finally:
        env.close()


def test_gym_env_max_turns_without_submission_reward_0(builder: Builder) -> None:
    env = MiniSandboxSWEEnv(
        {}, {"instance": {"instance_id": TASK}, "max_turns": 2}, builder=builder
    )
    try:
        env.init(PROMPT)
        assert not env.step(apply_gold())["done"]
        out = env.step(bash("git status --short"))
        # The edits are not a submission: nothing submitted grades as the empty patch.
        assert out["done"] and out["reward"] == 0.0 and out["metadata"]["exit"] == "max_turns"
        assert env.result is not None and env.result.empty_patch
    finally:
        env.close()


def test_gym_env_settings_and_turn_limit(builder: Builder) -> None:
    """The environment's settings are MiniSandboxSWEEnvConfig's: a dataclass, a dict or an
    OmegaConf node; a misspelt key or a turn limit below 1 is refused, naming the config line."""
    from omegaconf import OmegaConf

    with pytest.raises(
        ValueError, match=r"skyrl_gym\.minisandbox_swe: unknown settings \['timout'\]"
    ):
        MiniSandboxSWEEnv({"timout": 5}, {"task": TASK}, builder=builder)
    with pytest.raises(ValueError, match=r"generator\.max_turns \(extras\.max_turns\).* got 0"):
        MiniSandboxSWEEnv({}, {"task": TASK, "max_turns": 0}, builder=builder)
    with pytest.raises(ValueError, match=r"minisandbox_swe\.max_turns must be .* got -1"):
        MiniSandboxSWEEnv({"max_turns": -1}, {"task": TASK}, builder=builder)
    cases = [
        (MiniSandboxSWEEnvConfig(max_turns=4), {}, 4),
        (OmegaConf.create({"max_turns": 4, "sandbox": {"network": False}}), {}, 4),
        ({"max_turns": 4}, {"max_turns": 9}, 9),  # SkyRL's generator.max_turns wins
        (None, {}, MiniSandboxSWEEnvConfig().max_turns),
    ]
    for env_config, extras, want in cases:
        env = MiniSandboxSWEEnv(env_config, {"task": TASK, **extras}, builder=builder)
        try:
            assert env.max_turns == want
        finally:
            env.close()


def test_rollout_with_mini_swe_agent(builder: Builder) -> None:
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (extra: skyrl)")
    from minisweagent.models.test_models import DeterministicModel, make_output

    config = {
        "agent": {"system_template": "sys", "instance_template": "{{task}}", "step_limit": 5},
        "environment": {"timeout": 60},
    }

    def model(*commands: str) -> DeterministicModel:
        return DeterministicModel(outputs=[make_output("", [{"command": c}]) for c in commands])

    apply = f"git apply <<'EOF_PATCH'\n{gold_patch()}\nEOF_PATCH"
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
    instance = {"instance_id": TASK, "problem_statement": "fix datekit"}
    r = run_rollout(instance, model(apply, submit), config, builder=builder)
    messages, reward, error = r.as_tuple()
    assert reward == 1.0 and error is None and r.exit_status == "Submitted"
    assert [m["role"] for m in messages[:2]] == ["system", "user"]
    assert messages[1]["content"] == "fix datekit" and messages[-1]["role"] == "exit"
    assert "+++ b/" in r.patch
    assert r.result is not None and r.result.test_results, "graded by running the tests"
    print(f"\nper-episode overhead (rollout): {r.timings}, tests {r.result.duration_s:.2f}s")

    r = run_rollout(
        TASK, model("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"), config, builder=builder
    )
    assert r.reward == 0.0 and r.patch == "" and r.result is not None and r.result.empty_patch
