"""NeMo Gym on minisandbox, with the real package (its own venv: `scripts/test-stack nemo_gym`):
the provider found through NeMo Gym's entry point group and selected by a `sandbox:` block,
the provider contract on real task sandboxes, and mini_swe_agent_2's environment driving an
episode of mini-swe-agent (its deterministic model) on a bundled task, graded by minisandbox."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")

nemo_gym = pytest.importorskip(
    "nemo_gym",
    reason="NeMo Gym is not installed (Python >=3.13): run `scripts/test-stack nemo_gym`",
)

import yaml  # noqa: E402
from nemo_gym.sandbox import (  # noqa: E402
    AsyncSandbox,
    SandboxSpec,
    SandboxStatus,
    create_provider,
    get_provider_class,
    list_providers,
    resolve_provider_config,
)
from omegaconf import OmegaConf  # noqa: E402
from pydantic import ValidationError  # noqa: E402

from minisandbox.errors import TaskNotBoundError  # noqa: E402
from minisandbox.integrations.nemo_gym import (  # noqa: E402
    SANDBOX_RUNTIME_RETURN_CODE,
    MiniSandboxProvider,
    evaluate,
)
from minisandbox.tasks.builder import Builder  # noqa: E402
from minisandbox.tasks.loaders import TaskNotFoundError, load_tasks  # noqa: E402

TASK = "examples__semverkit-1"

# What a user writes: the provider block (a file passed with --config) and the override of the
# agent's shipped config for sandboxes that have no conda (see docs/integrations/nemo-gym.md).
SANDBOX_YAML = """
sandbox:
  minisandbox:
    dataset: examples
"""
AGENT_OVERRIDE_YAML = """
mini_swe_agent_2:
  responses_api_agents:
    mini_swe_agent_2:
      sandbox_environment_kwargs:
        activate_conda: false
"""


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


# ---------------------------------------------------------------- registration and config


def test_entry_point_registers_the_provider() -> None:
    assert "minisandbox" in list_providers()
    assert get_provider_class("minisandbox") is MiniSandboxProvider


def agent_config_path() -> Path:
    import responses_api_agents.mini_swe_agent_2 as agent

    return Path(agent.__file__).parent / "configs" / "mini_swe_agent_2.yaml"


def merged_config(*yaml_texts: str) -> Any:
    """The agent's shipped config and ours merged in `config_paths` order, as NeMo Gym does."""
    configs = [OmegaConf.load(agent_config_path()), *map(OmegaConf.create, yaml_texts)]
    return OmegaConf.merge(*configs)


def test_sandbox_block_selects_the_provider() -> None:
    cfg = merged_config(SANDBOX_YAML)
    agent = cfg.mini_swe_agent_2.responses_api_agents.mini_swe_agent_2
    resolved = resolve_provider_config(agent.sandbox_provider, cfg)  # as mini_swe_agent_2 does
    assert resolved == {"minisandbox": {"dataset": "examples"}}
    provider = create_provider(resolved)
    assert isinstance(provider, MiniSandboxProvider)
    assert provider.config.dataset == "examples" and provider.config.task is None


def test_unknown_key_in_the_block_is_an_error() -> None:
    with pytest.raises(ValidationError, match="datset"):
        create_provider({"minisandbox": {"datset": "examples"}})


async def test_a_sandbox_without_a_task_is_an_error_naming_the_fix() -> None:
    sandbox = AsyncSandbox({"minisandbox": {"dataset": "examples"}})
    with pytest.raises(TaskNotBoundError) as e:
        await sandbox.start(SandboxSpec(workdir="/testbed"))
    assert "task: <task id>" in str(e.value) and "sandbox:" in str(e.value)
    await sandbox.stop()


async def test_an_instance_of_another_dataset_is_an_error_naming_dataset() -> None:
    sandbox = AsyncSandbox({"minisandbox": {}})
    spec = SandboxSpec(image="docker.io/swebench/sweb.eval.x86_64.nope_1776_nope-1:latest")
    with pytest.raises(TaskNotFoundError, match="set `dataset:`"):
        await sandbox.start(spec)
    await sandbox.stop()


# ---------------------------------------------------------------- the provider contract


async def test_provider_contract(builder: Builder, tmp_path: Path) -> None:
    provider = MiniSandboxProvider(builder=builder, task=TASK)
    handle = await provider.create(SandboxSpec(workdir="/testbed", env={"X": "1"}))
    other = await provider.create(SandboxSpec())
    try:
        assert handle.provider_name == "minisandbox" and TASK in handle.sandbox_id
        r = await provider.exec(handle, "echo out; echo err >&2; echo $X $Y; pwd; exit 3")
        assert (r.stdout, r.stderr, r.return_code, r.error_type) == (
            "out\n1\n/testbed\n",
            "err\n",
            3,
            None,
        )
        r = await provider.exec(handle, "pwd; echo $Y", cwd="/tmp", env={"Y": "2"}, user="root")
        assert r.stdout == "/tmp\n2\n" and r.return_code == 0
        # The task's repository at its base commit is the working tree.
        r = await provider.exec(handle, "git status --porcelain; test -f src/semverkit/__init__.py")
        assert r.return_code == 0 and r.stdout == ""

        r = await provider.exec(handle, "echo started; sleep 60", timeout_s=1)
        assert r.return_code == SANDBOX_RUNTIME_RETURN_CODE and r.error_type == "timeout"
        assert r.stdout == "started\n" and "timed out" in (r.stderr or "")
        assert (await provider.exec(handle, "echo alive")).stdout == "alive\n"
        with pytest.raises(ValueError, match="root"):
            await provider.exec(handle, "id", user="nobody")

        src = tmp_path / "in.txt"
        src.write_text("hello\n")
        await provider.upload_file(handle, src, "notes/a.txt")  # relative: under the workdir
        await provider.upload_file(handle, src, "/tmp/b.txt")
        r = await provider.exec(handle, "cat /testbed/notes/a.txt /tmp/b.txt")
        assert r.stdout == "hello\nhello\n"
        await provider.exec(handle, "printf 'x\\0y' > out.bin")
        await provider.download_file(handle, "out.bin", tmp_path / "sub" / "out.bin")
        assert (tmp_path / "sub" / "out.bin").read_bytes() == b"x\0y"
        with pytest.raises(OSError):
            await provider.download_file(handle, "/nonexistent", tmp_path / "n")

        # Sandboxes are separate: the other one saw none of this.
        assert (await provider.exec(other, "ls notes 2>&1")).return_code != 0

        assert await provider.status(handle) == SandboxStatus.RUNNING
        await provider.close(handle)
        assert await provider.status(handle) == SandboxStatus.STOPPED
        await provider.close(handle)  # idempotent
        with pytest.raises(Exception, match="not started"):
            await provider.exec(handle, "true")
    finally:
        await provider.aclose()  # stops what is still open
    assert await provider.status(other) == SandboxStatus.STOPPED


async def test_aclose_stops_every_sandbox_then_raises_the_first_error(builder: Builder) -> None:
    provider = MiniSandboxProvider(builder=builder, task=TASK)
    failing = await provider.create(SandboxSpec())
    others = [await provider.create(SandboxSpec()) for _ in range(2)]
    box = failing.raw
    real_stop = box.ts.stop

    async def stop_then_fail() -> None:  # a stop that fails after stopping (e.g. cleanup)
        await real_stop()
        raise RuntimeError("cleanup failed")

    box.ts.stop = stop_then_fail
    with pytest.raises(RuntimeError, match="cleanup failed"):
        await provider.aclose()
    for handle in (failing, *others):
        assert await provider.status(handle) == SandboxStatus.STOPPED
    await provider.aclose()  # nothing left to stop


async def test_task_lookup_is_off_the_event_loop(
    builder: Builder, tmp_path: Path, dataset_loads: list[str]
) -> None:
    """The first lookup in a dataset loads all of it (a Hugging Face download for a hub
    dataset): `create` and `evaluate` do it outside the event loop."""
    # Fresh envs_dirs: datasets not yet loaded in this process.
    provider = MiniSandboxProvider(builder=builder, envs_dir=str(tmp_path / "a"))
    handle = await provider.create(SandboxSpec(metadata={"instance_id": TASK}))
    try:
        assert TASK in handle.sandbox_id
    finally:
        await provider.aclose()
    result = await evaluate(TASK, "", envs_dir=str(tmp_path / "b"), builder=builder)
    assert result.reward == 0.0
    assert dataset_loads == ["off the loop", "off the loop"]


def test_sync_sandbox_across_its_own_loops(use_settings: None) -> None:
    """NeMo Gym's sync Sandbox runs each sandbox on a loop thread of its own, closed at stop."""
    from nemo_gym.sandbox import Sandbox

    with Sandbox({"minisandbox": {"task": TASK}}).start(SandboxSpec(workdir="/testbed")) as a:
        b = Sandbox({"minisandbox": {"task": TASK}}).start(SandboxSpec(workdir="/testbed"))
        a.exec("echo a > mark")
        assert b.exec("cat mark").return_code != 0
        b.stop()
        assert b.status() == SandboxStatus.STOPPED
        assert a.exec("cat mark").stdout == "a\n"


# ---------------------------------------------------------------- a mini_swe_agent_2 episode


def episode(commands: list[str]) -> tuple[dict[str, Any], float]:
    """One episode as mini_swe_agent_2's runner (`_run_mini_swe_v2`) sets it up: its shipped
    agent config merged with the `sandbox:` block, mini-swe-agent's swebench.yaml, the image it
    derives from the row, its sandbox environment class; the model scripted. Returns the run's
    info and the mean time of an exec step."""
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.config import get_config_path
    from minisweagent.environments import get_environment
    from minisweagent.models.test_models import DeterministicModel, make_output
    from responses_api_agents.mini_swe_agent_2 import app

    cfg = merged_config(SANDBOX_YAML, AGENT_OVERRIDE_YAML)
    agent = OmegaConf.to_container(cfg.mini_swe_agent_2.responses_api_agents.mini_swe_agent_2)
    assert isinstance(agent, dict)
    config = yaml.safe_load(get_config_path(app._swebench_config_path()).read_text())
    env_config = config.setdefault("environment", {})
    env_config.update(agent["sandbox_environment_kwargs"])
    env_config["provider"] = resolve_provider_config(agent["sandbox_provider"], cfg)
    env_config["spec"] = dict(agent["sandbox_spec"])
    instance = {"instance_id": TASK, "problem_statement": "fix semverkit"}
    env_config["image"] = app._swebench_image_name(instance, "verified")
    env_config["instance_id"] = TASK
    env_config["step_timeout"] = agent["step_timeout"]
    env_config["environment_class"] = (
        "responses_api_agents.mini_swe_agent_2.sandbox_environment.MiniSWESandboxEnvironment"
    )
    agent_config = dict(config["agent"], step_limit=10)
    env = get_environment(env_config)
    try:
        model = DeterministicModel(
            outputs=[
                make_output(f"step {i}", [{"command": c}], 0.0) for i, c in enumerate(commands)
            ]
        )
        t0 = time.monotonic()
        info = DefaultAgent(model, env, **agent_config).run(instance["problem_statement"])
        return info, (time.monotonic() - t0) / len(commands)
    finally:
        env.cleanup()


def apply_cmd(patch: str) -> str:
    return f"git apply <<'MSB_PATCH_EOF'\n{patch}\nMSB_PATCH_EOF"


SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


def test_mini_swe_agent_2_episode_gold_patch_reward_1(use_settings: None) -> None:
    info, step = episode([apply_cmd(gold_patch()), "git status --short", SUBMIT])
    assert info["exit_status"] == "Submitted", info
    assert "+from packaging.version import Version" in info["submission"]
    result = evaluate_sync(info["submission"])
    assert result.resolved and result.reward == 1.0, result.reason
    print(f"\nmini_swe_agent_2 episode on minisandbox: {step:.3f}s per step")


def test_mini_swe_agent_2_episode_empty_patch_reward_0(use_settings: None) -> None:
    info, _ = episode(["echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"])
    assert info["exit_status"] == "Submitted" and info["submission"] == ""
    result = evaluate_sync(info["submission"])
    assert result.empty_patch and result.reward == 0.0


def evaluate_sync(patch: str) -> Any:
    import asyncio

    return asyncio.run(evaluate(TASK, patch, timeout=600))


async def test_provider_evaluates_the_agents_changes(builder: Builder) -> None:
    """Without a submission: the sandbox's own /testbed changes, read before close."""
    provider = MiniSandboxProvider(builder=builder)
    image = "docker.io/swebench/sweb.eval.x86_64.examples_1776_semverkit-1:latest"
    handle = await provider.create(SandboxSpec(image=image, workdir="/testbed"))
    try:
        r = await provider.exec(handle, apply_cmd(gold_patch()))
        assert r.return_code == 0, r.stderr
        result = await provider.evaluate(handle)
        assert result.resolved and result.reward == 1.0, result.reason
    finally:
        await provider.aclose()


def test_step_time_side_by_side_with_local(use_settings: None, tmp_path: Path) -> None:
    """The time of an exec step on a task sandbox and on NeMo Gym's `local` provider (host
    processes, no isolation), reported, not asserted (a shared machine's timings vary)."""
    from nemo_gym.sandbox import Sandbox

    n = 20
    times = {}
    for name, cfg, spec in (
        ("minisandbox", {"minisandbox": {"task": TASK}}, SandboxSpec(workdir="/testbed")),
        ("local", {"local": {}}, SandboxSpec(workdir=str(tmp_path))),
    ):
        with Sandbox(cfg).start(spec) as sb:
            assert sb.exec("echo ok").stdout == "ok\n"
            t0 = time.monotonic()
            for _ in range(n):
                assert sb.exec("ls >/dev/null && echo ok").return_code == 0
            times[name] = (time.monotonic() - t0) / n
    print(
        "\nexec step: "
        + ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in times.items())
        + f" (mean of {n}, {os.cpu_count()} cpus)"
    )
