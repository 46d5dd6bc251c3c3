"""verl's uni-agent on minisandbox, with the real package (its own venv: `scripts/test-stack
verl`): the provider and the task found in uni-agent's registries and selected by config, the
provider contract on real task sandboxes (commands, files, native shells, lifecycle), and
episodes of uni-agent's react agent, driven by a deterministic OpenAI-compatible model, graded
by minisandbox (gold 1, empty 0)."""

from __future__ import annotations

import asyncio
import json
import re
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest

uni_agent = pytest.importorskip(
    "uni_agent.sandbox",
    reason="verl's uni-agent is not installed (not on PyPI): run `scripts/test-stack verl`",
)

import yaml  # noqa: E402
from aiohttp import web  # noqa: E402
from uni_agent.sandbox import LocalSandbox, SandboxConfig, build_sandbox  # noqa: E402
from uni_agent.sandbox.registry import get_sandbox_cls  # noqa: E402
from uni_agent.tasks import TaskConfigResolver, get_task  # noqa: E402
from uni_agent.tasks.registry import get_task_cls  # noqa: E402
from uni_agent.tools import Toolbox  # noqa: E402

from minisandbox.errors import SandboxNotRunningError, TaskNotBoundError  # noqa: E402
from minisandbox.integrations.verl import (  # noqa: E402
    MiniSandboxSandbox,
    MiniSandboxTask,
)
from minisandbox.sandbox.config import SandboxConfig as MiniSandboxConfig  # noqa: E402
from minisandbox.tasks.builder import Builder  # noqa: E402
from minisandbox.tasks.loaders import TaskNotFoundError, load_tasks  # noqa: E402

TASK = "examples__semverkit-1"
# What a user writes (docs/integrations/verl.md): the task family's defaults, by name.
TASK_CONFIG_YAML = """
- name: minisandbox
  sandbox:
    provider: minisandbox
    sandbox_kwargs:
      dataset: examples
  agent:
    name: react
    max_steps: 10
    tools:
      - name: str_replace_editor
      - name: stateful_shell
        command_timeout: 120
      - name: submit
"""


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


# ---------------------------------------------------------------- registration and config


def test_provider_and_task_registered_by_name() -> None:
    assert get_sandbox_cls("minisandbox") is MiniSandboxSandbox
    assert get_task_cls("minisandbox") is MiniSandboxTask
    sb = build_sandbox(SandboxConfig(provider="minisandbox", sandbox_kwargs={"task": TASK}))
    assert isinstance(sb, MiniSandboxSandbox) and sb.task.id == TASK
    assert sb.supports_shell


def test_task_from_a_swebench_image_name() -> None:
    # What uni-agent's SWE-bench preprocessing writes: `sandbox.image` per instance.
    cfg = SandboxConfig(
        provider="minisandbox", image="swebench/sweb.eval.x86_64.examples_1776_semverkit-1:latest"
    )
    sb = build_sandbox(cfg)
    assert isinstance(sb, MiniSandboxSandbox) and sb.task.id == TASK


def test_no_task_is_refused_with_the_line_to_add() -> None:
    with pytest.raises(TaskNotBoundError, match=r"task: <task id>.*sandbox\.sandbox_kwargs"):
        build_sandbox(SandboxConfig(provider="minisandbox"))  # the default image names none
    task = get_task({"name": "minisandbox", "sandbox": {"provider": "minisandbox"}})
    with pytest.raises(TaskNotBoundError, match=r"metadata\.instance_id"):
        task.build_sandbox()


def test_other_misconfigurations_error() -> None:
    # One error naming the key, where it is, and the keys there are.
    with pytest.raises(
        ValueError, match=r"sandbox_kwargs: unknown key 'taks' \(known: task, "
    ) as e:
        build_sandbox(SandboxConfig(provider="minisandbox", sandbox_kwargs={"taks": TASK}))
    assert str(e.value).count("\n") == 0, str(e.value)
    with pytest.raises(ValueError, match=r"sandbox_kwargs\.eval_timeout: .*number"):
        build_sandbox(
            SandboxConfig(
                provider="minisandbox", sandbox_kwargs={"task": TASK, "eval_timeout": "x"}
            )
        )
    # SandboxConfig fields are checked when the block is read, not at start() (which
    # uni-agent retries).
    bad_field = {"task": TASK, "sandbox": {"memory_mb": 4096}}
    with pytest.raises(
        ValueError, match=r"sandbox_kwargs\.sandbox: .*'memory_mb' \(known: .*limits"
    ):
        build_sandbox(SandboxConfig(provider="minisandbox", sandbox_kwargs=bad_field))
    with pytest.raises(TaskNotFoundError):
        build_sandbox(SandboxConfig(provider="minisandbox", sandbox_kwargs={"task": "nope-1"}))
    local = get_task(
        {"name": "minisandbox", "sandbox": {"provider": "local"}, "metadata": {"task": TASK}}
    )
    with pytest.raises(ValueError, match=r"needs `sandbox\.provider: minisandbox` \(got 'local'\)"):
        local.build_sandbox()
    no_agent = get_task(
        {"name": "minisandbox", "sandbox": {"provider": "minisandbox"}, "metadata": {"task": TASK}}
    )
    with pytest.raises(ValueError, match=r"no agent: set `agent\.name`"):
        asyncio.run(no_agent.run())


# ---------------------------------------------------------------- the provider contract


@pytest.fixture
async def sandbox(builder: Builder) -> AsyncIterator[MiniSandboxSandbox]:
    sb = MiniSandboxSandbox(TASK, builder=builder)
    async with sb:  # uni-agent's own lifecycle: start() with its retry and startup limits
        yield sb
    assert not await sb.is_alive()


async def test_exec_argv_shell_workdir_env_and_exit_codes(sandbox: MiniSandboxSandbox) -> None:
    r = await sandbox.exec(["git", "rev-parse", "--show-toplevel"], workdir="/testbed")
    assert (r.exit_code, r.stdout.strip()) == (0, "/testbed")
    r = await sandbox.exec_shell('echo "$GREETING" >&2; exit 3', env={"GREETING": "hi there"})
    assert (r.exit_code, r.stdout, r.stderr.strip()) == (3, "", "hi there")
    r = await sandbox.exec(["printf", "%s", "a b;c"])  # argv: no shell in between
    assert r.stdout == "a b;c"
    # uni-agent's error policy: a timeout is exit -1, the sandbox stays usable.
    r = await sandbox.exec_shell("sleep 30", timeout=1)
    assert r.exit_code == -1 and "timed out" in r.stderr
    r = await sandbox.exec(["no-such-command-x"])
    assert r.exit_code != 0
    assert (await sandbox.exec(["true"])).exit_code == 0


async def test_files_upload_download(sandbox: MiniSandboxSandbox, tmp_path: Path) -> None:
    blob = bytes(range(256)) * 4
    await sandbox.write_file("/tmp/x/blob.bin", blob)
    assert await sandbox.read_file("/tmp/x/blob.bin") == blob
    await sandbox.write_file("/testbed/NOTE.md", "héllo\n")
    r = await sandbox.exec(["cat", "NOTE.md"], workdir="/testbed")
    assert r.stdout == "héllo\n"
    with pytest.raises(OSError):
        await sandbox.read_file("/nope/missing")

    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "pkg" / "a.py").write_text("A = 1\n")
    (src / "run.sh").write_text("#!/bin/sh\necho ran\n")
    (src / "run.sh").chmod(0o755)
    await sandbox.upload(src, "/tmp/up")
    await sandbox.upload(src / "pkg" / "a.py", "/tmp/one.py")
    r = await sandbox.exec_shell("/tmp/up/run.sh && cat /tmp/up/pkg/a.py /tmp/one.py")
    assert (r.exit_code, r.stdout) == (0, "ran\nA = 1\nA = 1\n")

    await sandbox.download("/tmp/up", tmp_path / "down")  # a tree: tar in the sandbox
    assert (tmp_path / "down" / "pkg" / "a.py").read_text() == "A = 1\n"
    await sandbox.download("/tmp/x/blob.bin", tmp_path / "blob.bin")
    assert (tmp_path / "blob.bin").read_bytes() == blob


async def test_native_shell_keeps_state_and_survives_a_timeout(
    sandbox: MiniSandboxSandbox,
) -> None:
    # What uni-agent's `stateful_shell` tool opens (supports_shell: no tmux needed).
    shell = await sandbox.open_shell(cwd="/testbed", env={"PAGER": "cat"})
    try:
        r = await shell.run("export X=42; cd src && pwd")
        assert (r.exit_code, r.stdout.strip()) == (0, "/testbed/src")
        r = await shell.run('echo "$X $PAGER $(pwd)"; false')
        assert (r.exit_code, r.stdout.strip()) == (1, "42 cat /testbed/src")
        with pytest.raises(TimeoutError):
            await shell.run("sleep 30", timeout=1)
        r = await shell.run("echo $X")
        assert (r.exit_code, r.stdout.strip()) == (0, "42")
    finally:
        await shell.close()


async def test_uni_agent_tools_over_the_provider(sandbox: MiniSandboxSandbox) -> None:
    # The react agent's default tools, bound to our sandbox as its loop binds them.
    toolbox = Toolbox.from_specs(
        [{"name": "str_replace_editor"}, {"name": "stateful_shell"}, {"name": "submit"}],
        sandbox=sandbox,
    )
    async with toolbox.entered(retry=1, timeout=60):
        view = await toolbox.call("str_replace_editor", {"command": "view", "path": "/testbed"})
        assert view.status == "ok" and "/testbed/src" in view.text
        out = await toolbox.call("shell", json.dumps({"command": "cd /testbed && git status"}))
        assert out.status == "ok" and "[exit code: 0]" in out.text
        slow = await toolbox.call("shell", {"command": "sleep 30"}, timeout=1)
        assert slow.status == "timeout"
        again = await toolbox.call("shell", {"command": "echo still-here"})
        assert again.status == "ok" and "still-here" in again.text


async def test_stopped_sandbox_raises(builder: Builder) -> None:
    sb = MiniSandboxSandbox(TASK, builder=builder)
    await sb.start()
    assert await sb.is_alive()
    await sb.stop()
    await sb.stop()  # idempotent
    with pytest.raises(SandboxNotRunningError):
        await sb.exec(["true"])


# ---------------------------------------------------------------- episodes


class ScriptedModel:
    """A deterministic OpenAI-compatible chat endpoint: each request gets the next scripted
    assistant message (tool calls), whatever the conversation. Records what it was sent."""

    def __init__(self, script: list[list[tuple[str, dict[str, Any]]]]) -> None:
        self.script = script
        self.requests: list[dict[str, Any]] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        turn = self.script[min(len(self.requests), len(self.script)) - 1]
        calls = [
            {
                "id": f"call-{len(self.requests)}-{i}",
                "type": "function",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
            for i, (name, args) in enumerate(turn)
        ]
        message = {"role": "assistant", "content": "", "tool_calls": calls}
        return web.json_response(
            {
                "choices": [{"message": message, "finish_reason": "tool_calls"}],
                "usage": {"prompt_tokens": 1, "completion_tokens": 1},
            }
        )


async def serve(model: ScriptedModel) -> tuple[web.AppRunner, str]:
    app = web.Application()
    app.router.add_post("/v1/chat/completions", model.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, f"http://127.0.0.1:{port}/v1"


async def episode(model: ScriptedModel, tmp_path: Path, **sample: Any) -> Any:
    """One episode the way uni-agent's runners run one (`run_task` in RL, the API inference
    example): the Task Config file's defaults, the sample's config, the live endpoint, then
    `get_task(...).run()`."""
    path = tmp_path / "task_config.yaml"
    path.write_text(TASK_CONFIG_YAML)
    runner, base_url = await serve(model)
    try:
        resolved = TaskConfigResolver.from_file(str(path)).resolve(
            {"name": "minisandbox", **sample},
            runtime_model={"base_url": base_url, "api_key": "EMPTY", "model_name": "scripted"},
        )
        return await get_task(resolved).run()
    finally:
        await runner.cleanup()


GOLD_SCRIPT = [
    [("str_replace_editor", {"command": "create", "path": "/tmp/fix.patch", "file_text": ""})],
    [("shell", {"command": "cd /testbed && git apply /tmp/fix.patch && git status --short"})],
    [("submit", {})],
]


async def test_episode_gold_patch_reward_1(use_settings: None, tmp_path: Path) -> None:
    script = [list(turn) for turn in GOLD_SCRIPT]
    script[0] = [("str_replace_editor", {**script[0][0][1], "file_text": gold_patch()})]
    model = ScriptedModel(script)
    t0 = time.monotonic()
    result = await episode(model, tmp_path, metadata={"instance_id": TASK})
    wall = time.monotonic() - t0
    assert result.reward == 1.0 and result.accuracy == 1.0, result.extra_info
    assert result.finished is True and result.extra_info["resolved"] is True
    assert "+++ b/" in result.extra_info["patch"]
    # The agent loop really went through the model and the tools: 3 turns, tool schemas sent,
    # the shell's observation (git status of the applied patch) in the last request.
    assert len(model.requests) == 3
    assert {t["function"]["name"] for t in model.requests[0]["tools"]} == {
        "str_replace_editor",
        "shell",
        "submit",
    }
    observation = model.requests[2]["messages"][-1]
    assert observation["role"] == "tool" and "[exit code: 0]" in observation["content"]
    assert " M " in observation["content"] or "M " in observation["content"]
    print(
        f"\nuni-agent gold episode: wall {wall:.2f}s, agent {result.extra_info['agent_time']:.2f}s"
        f", grading {result.extra_info['eval_execution_time']:.2f}s"
    )


async def test_episode_empty_patch_reward_0(use_settings: None, tmp_path: Path) -> None:
    model = ScriptedModel([[("submit", {})]])
    result = await episode(model, tmp_path, metadata={"instance_id": TASK})
    assert result.reward == 0.0 and result.accuracy == 0.0
    assert result.finished is True and result.extra_info["patch"] == ""
    assert result.extra_info["resolved"] is False
    assert len(model.requests) == 1


async def test_oracle_mode_gold_patch_reward_1(use_settings: None, tmp_path: Path) -> None:
    # No model: run_gold_patch as uni-agent's SWE-bench tasks have it.
    task = get_task(
        {
            "name": "minisandbox",
            "run_gold_patch": True,
            "sandbox": {"provider": "minisandbox", "sandbox_kwargs": {"task": TASK}},
        }
    )
    result = await task.run()
    assert result.reward == 1.0, result.extra_info


async def test_run_task_runner_with_the_framework(use_settings: None, tmp_path: Path) -> None:
    pytest.importorskip(
        "uni_agent.framework.task_runner",
        reason="uni-agent's RL framework needs verl, torch and Ray (not in the verl stack venv)",
    )
    from types import SimpleNamespace

    from minisandbox.integrations.verl import run_task

    path = tmp_path / "task_config.yaml"
    path.write_text(TASK_CONFIG_YAML)
    runner, base_url = await serve(ScriptedModel([[("submit", {})]]))
    try:
        session = SimpleNamespace(base_url=base_url, reward_info_url=None)
        result = await run_task(
            session=session,
            tools_kwargs={"task": {"name": "minisandbox", "metadata": {"instance_id": TASK}}},
            task_config_path=str(path),
        )
    finally:
        await runner.cleanup()
    assert result.reward == 0.0


# ---------------------------------------------------------------- event loops


def test_episodes_each_in_an_asyncio_run_of_their_own(use_settings: None) -> None:
    """uni-agent's framework runs each runner in an `asyncio.run` of its own (in a Ray worker):
    one process, a new event loop per episode, each closed after it."""

    def oracle() -> Any:
        return get_task(
            {
                "name": "minisandbox",
                "run_gold_patch": True,
                "sandbox": {"provider": "minisandbox"},
                "metadata": {"instance_id": TASK},
            }
        )

    first = asyncio.run(oracle().run())
    second = asyncio.run(oracle().run())
    assert (first.reward, second.reward) == (1.0, 1.0), (first.extra_info, second.extra_info)


def test_a_sandbox_outlives_the_loop_that_started_it(builder: Builder) -> None:
    """A sandbox (and its native shell) started under one `asyncio.run` is used and stopped
    under later ones, after the first loop is closed: it belongs to no caller's loop."""
    sb = MiniSandboxSandbox(TASK, builder=builder)
    asyncio.run(sb.start())
    try:
        r = asyncio.run(sb.exec(["git", "rev-parse", "--show-toplevel"], workdir="/testbed"))
        assert (r.exit_code, r.stdout.strip()) == (0, "/testbed"), r
        shell = asyncio.run(sb.open_shell(cwd="/testbed"))
        r = asyncio.run(shell.run("export X=7; cd src && pwd"))
        assert (r.exit_code, r.stdout.strip()) == (0, "/testbed/src"), r
        assert asyncio.run(shell.run("echo $X")).stdout.strip() == "7"
        asyncio.run(shell.close())
        asyncio.run(sb.write_file("/testbed/NOTE.md", "x\n"))
        assert asyncio.run(sb.read_file("/testbed/NOTE.md")) == b"x\n"
        assert "NOTE.md" in asyncio.run(sb.diff())
    finally:
        asyncio.run(sb.stop())
    assert not asyncio.run(sb.is_alive())


def test_task_lookup_is_off_the_event_loop(
    use_settings: None, tmp_path: Path, dataset_loads: list[str]
) -> None:
    """The first lookup in a dataset loads all of it (a Hugging Face download for a hub
    dataset): an episode does it outside its event loop."""
    task = get_task(
        {
            "name": "minisandbox",
            "run_gold_patch": True,
            # A fresh envs_dir: a dataset not yet loaded in this process.
            "sandbox": {"provider": "minisandbox", "sandbox_kwargs": {"envs_dir": str(tmp_path)}},
            "metadata": {"instance_id": TASK},
        }
    )
    assert asyncio.run(task.run()).reward == 1.0
    assert dataset_loads == ["off the loop"]


# ---------------------------------------------------------------- step time beside uni-agent's own


async def _step_times(sb: Any, command: str, n: int) -> list[float]:
    shell = await sb.open_shell() if sb.supports_shell else None
    times = []
    try:
        for _ in range(n):
            t = time.perf_counter()
            if shell is not None:
                r = await shell.run(command, timeout=60)
            else:
                r = await sb.exec_shell(command, timeout=60)
            times.append(time.perf_counter() - t)
            assert r.exit_code == 0, r
    finally:
        if shell is not None:
            await shell.close()
    return times


async def test_step_time_beside_uni_agent_local_sandbox(builder: Builder) -> None:
    """Measured, not asserted (a busy machine): one command step on our sandbox (exec, and the
    native shell the react agent uses) beside uni-agent's `local` provider (host subprocesses,
    no isolation). A git repo of the same task on both."""
    n = 20
    command = "git status --short >/dev/null && ls >/dev/null"
    ours = MiniSandboxSandbox(TASK, builder=builder)
    t = time.perf_counter()
    await ours.start()
    start_s = time.perf_counter() - t
    try:
        exec_ours = await _step_times(_NoShell(ours), f"cd /testbed && {command}", n)
        shell_ours = await _step_times(ours, f"cd /testbed && {command}", n)
    finally:
        await ours.stop()
    with tempfile.TemporaryDirectory() as d:
        local = LocalSandbox()
        async with local:
            r = await local.exec_shell(f"git init -q {d} && cd {d} && touch a && git add a")
            assert r.exit_code == 0, r
            exec_local = await _step_times(local, f"cd {d} && {command}", n)
    med: Callable[[list[float]], float] = statistics.median
    print(
        f"\nstep time (median of {n}, ms): minisandbox exec {med(exec_ours) * 1e3:.1f}, "
        f"minisandbox native shell {med(shell_ours) * 1e3:.1f}, "
        f"uni-agent local exec {med(exec_local) * 1e3:.1f}; minisandbox start {start_s:.2f}s"
    )


class _NoShell:
    """Our sandbox seen without its native shell (one-shot exec per step)."""

    supports_shell = False

    def __init__(self, sb: MiniSandboxSandbox) -> None:
        self.exec_shell = sb.exec_shell


def test_task_config_yaml_parses() -> None:
    entries = yaml.safe_load(TASK_CONFIG_YAML)
    assert entries[0]["sandbox"]["provider"] == "minisandbox"


def test_documented_sandbox_kwargs_are_valid() -> None:
    """The Task Config block of docs/integrations/verl.md with its commented-out options
    turned on: every `sandbox_kwargs` option it suggests is accepted."""
    doc = (Path(__file__).parents[2] / "docs" / "integrations" / "verl.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    block = next(b for b in blocks if "sandbox_kwargs:" in b and "- name: minisandbox" in b)
    enabled = re.sub(r"(?m)^(\s+)# (\w+: )", r"\1\2", block)
    assert enabled != block  # it has options to try
    kwargs = yaml.safe_load(enabled)[0]["sandbox"]["sandbox_kwargs"]
    assert "sandbox" in kwargs, kwargs
    sb = build_sandbox(SandboxConfig(provider="minisandbox", sandbox_kwargs=kwargs))
    assert isinstance(sb, MiniSandboxSandbox) and sb.task.id == TASK
    MiniSandboxConfig(**sb.overrides)  # the SandboxConfig settings themselves are valid
