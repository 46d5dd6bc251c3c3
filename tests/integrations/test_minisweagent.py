"""mini-swe-agent on minisandbox, end to end with the real package: its DefaultAgent, driven by
its deterministic model, solves (or does not) a bundled task; minisandbox grades the result."""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
mswea = pytest.importorskip(
    "minisweagent", reason="mini-swe-agent is not installed (extra: minisweagent)"
)

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.environments import get_environment  # noqa: E402
from minisweagent.models.test_models import DeterministicModel  # noqa: E402

from minisandbox.errors import TaskNotBoundError  # noqa: E402
from minisandbox.integrations.minisweagent import MiniSandboxEnvironment  # noqa: E402
from minisandbox.tasks.builder import Builder  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402

V2 = int(mswea.__version__.split(".")[0]) >= 2
v2_only = pytest.mark.skipif(not V2, reason="needs mini-swe-agent 2.x (1.x is installed)")

TASK = "examples__semverkit-1"
ENV_CLASS = "minisandbox.integrations.minisweagent.MiniSandboxEnvironment"
AGENT = {
    "system_template": "You are a helpful assistant.",
    "instance_template": "Solve this issue in {{cwd}}: {{task}}",
    "step_limit": 10,
    "cost_limit": 100.0,
}


def gold_patch(task_id: str = TASK) -> str:
    return next(t for t in load_tasks("examples") if t.id == task_id).gold_patch


def apply_cmd(patch: str) -> str:
    return f"git apply <<'MSB_PATCH_EOF'\n{patch}\nMSB_PATCH_EOF"


SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


def turns(*commands: str) -> list[dict[str, Any]]:
    from minisweagent.models.test_models import make_output  # 2.x

    return [make_output(f"step {i}", [{"command": c}]) for i, c in enumerate(commands)]


@v2_only
def test_v2_agent_applies_gold_patch_and_submits_reward_1(builder: Builder) -> None:
    t0 = time.monotonic()
    env = MiniSandboxEnvironment(builder=builder, task=TASK, env={"PAGER": "cat"})
    started = time.monotonic() - t0
    try:
        model = DeterministicModel(outputs=turns(apply_cmd(gold_patch()), "git status", SUBMIT))
        info = DefaultAgent(model, env, **AGENT).run("fix semverkit")
        assert info["exit_status"] == "Submitted"
        assert "+from packaging.version import Version" in info["submission"]
        assert env.submission == info["submission"]
        t1 = time.monotonic()
        env.cleanup()
        result = env.evaluate()
        evaluated = time.monotonic() - t1
        assert result.resolved and result.reward == 1.0, result.reason
        print(f"\nper-episode overhead: start {started:.2f}s, evaluate {evaluated:.2f}s")
    finally:
        env.cleanup()


@v2_only
def test_v2_empty_submission_reward_0(builder: Builder) -> None:
    env = MiniSandboxEnvironment(builder=builder, task=TASK)
    try:
        model = DeterministicModel(outputs=turns("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"))
        info = DefaultAgent(model, env, **AGENT).run("fix semverkit")
        assert info["exit_status"] == "Submitted" and info["submission"] == ""
        result = env.evaluate()
        assert result.empty_patch and result.reward == 0.0
    finally:
        env.cleanup()


@v2_only
def test_v2_execute_contract(builder: Builder) -> None:
    """What 2.x environments return: output merged with stderr, returncode, exception_info,
    a timeout reported (not raised) with the output so far; cwd and env honoured."""
    env = MiniSandboxEnvironment(builder=builder, task=TASK, env={"X": "1"}, timeout=5)
    try:
        r = env.execute({"command": "echo out; echo err >&2; echo $X; pwd; exit 3"})
        assert r == {"output": "out\nerr\n1\n/testbed\n", "returncode": 3, "exception_info": ""}
        assert env.execute({"command": "pwd"}, cwd="/tmp")["output"] == "/tmp\n"
        r = env.execute({"command": "echo started; sleep 30"}, timeout=1)
        assert r["returncode"] == -1 and r["output"] == "started\n"
        # As every upstream environment reports it (LocalEnvironment's message, field for field).
        assert r["extra"] == {
            "exception_type": "TimeoutExpired",
            "exception": "Command 'echo started; sleep 30' timed out after 1 seconds",
        }
        assert (
            r["exception_info"]
            == f"An error occurred while executing the command: {r['extra']['exception']}"
        )
        # Not a submission: the marker must come first and the command must succeed.
        assert env.execute({"command": "echo x; echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"})
        r = env.execute({"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT; false"})
        assert r["returncode"] == 1
        vars_ = env.get_template_vars(extra=1)
        assert (
            vars_["task_id"] == TASK
            and "task" not in vars_
            and vars_["cwd"] == "/testbed"
            and vars_["extra"] == 1
        )
        ser = env.serialize()["info"]["config"]
        assert ser["environment_type"] == ENV_CLASS and ser["environment"]["task"] == TASK
        json.dumps(ser)
    finally:
        env.cleanup()


def test_v1_string_protocol(builder: Builder) -> None:
    """1.x passes the command string, detects submission itself and expects TimeoutExpired."""
    env = MiniSandboxEnvironment(builder=builder, task=TASK, grade="diff")
    try:
        r = env.execute(apply_cmd(gold_patch()))
        assert r == {"output": "", "returncode": 0}
        r = env.execute("echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff --stat")
        assert r["returncode"] == 0 and r["output"].startswith("COMPLETE_TASK_AND_SUBMIT")
        with pytest.raises(subprocess.TimeoutExpired) as e:
            env.execute("echo partial; sleep 30", timeout=1)
        assert e.value.output == b"partial\n"
        assert env.evaluate().reward == 1.0  # grade="diff": the changes in /testbed
    finally:
        env.cleanup()


def test_an_environment_without_a_task_is_an_error_naming_the_fix() -> None:
    """Only `environment_class` set (how users switch to docker): no silent empty sandbox."""
    env = get_environment({"environment_class": ENV_CLASS})
    try:
        with pytest.raises(TaskNotBoundError, match="env_startup_command"):
            env.get_template_vars()
        with pytest.raises(TaskNotBoundError, match=r"environment\.task"):
            env.execute({"command": "ls"})
        with pytest.raises(TaskNotBoundError):
            env.execute("ls")  # the 1.x protocol too
    finally:
        env.cleanup()


def test_plain_sandbox_without_task() -> None:
    env = get_environment({"environment_class": ENV_CLASS, "plain": True})
    try:
        assert isinstance(env, MiniSandboxEnvironment)
        r = env.execute({"command": "ls -A /testbed | wc -l; touch /testbed/f && echo ok"})
        assert r["output"] == "0\nok\n"
    finally:
        env.cleanup()


@v2_only
def test_swebench_batch_runner(use_settings: None, tmp_path: Path) -> None:
    """mini-swe-agent's SWE-bench runner, unmodified, with only `environment_class` changed:
    the task comes from the startup directive (the runner hands images only to environments
    it knows by name), a docker-only key is ignored; preds.json holds a resolving patch."""
    from minisweagent.run.benchmarks import swebench
    from minisweagent.run.benchmarks.utils.batch_progress import RunBatchProgressManager

    from minisandbox.integrations.tasks import resolve_task

    config = {
        "agent": AGENT,
        "environment": {
            "environment_class": ENV_CLASS,
            "cwd": "/testbed",
            "timeout": 60,
            "interpreter": ["bash", "-c"],
            "env": {"PAGER": "cat", "BASH_ENV": "/root/.bashrc"},
            "run_args": ["--rm"],
        },
        "run": {"env_startup_command": "#minisandbox-task {{instance_id}}"},
        "model": {
            "model_class": "deterministic",
            "model_name": "deterministic",
            "outputs": turns(apply_cmd(gold_patch()), SUBMIT),
        },
    }
    instance = {"instance_id": TASK, "problem_statement": "fix semverkit"}
    progress = RunBatchProgressManager(1, tmp_path / "exit_statuses.yaml")
    swebench.process_instance(instance, tmp_path, config, progress)
    traj = json.loads((tmp_path / TASK / f"{TASK}.traj.json").read_text())
    assert traj["info"]["exit_status"] == "Submitted", traj["info"]
    # BASH_ENV names a file the task sandbox does not have: dropped, no bash complaint.
    assert "No such file" not in json.dumps(traj["messages"])
    preds = json.loads((tmp_path / "preds.json").read_text())
    patch = preds[TASK]["model_patch"]

    env = MiniSandboxEnvironment(task=swebench.get_swebench_docker_image_name(instance))
    try:
        assert env.config.task == TASK == resolve_task(env.config.task).id
        assert env.evaluate(patch).reward == 1.0
    finally:
        env.cleanup()


@v2_only
def test_swebench_batch_runner_without_the_directive_fails_before_any_model_call(
    use_settings: None, tmp_path: Path
) -> None:
    from minisweagent.run.benchmarks import swebench
    from minisweagent.run.benchmarks.utils.batch_progress import RunBatchProgressManager

    config = {
        "agent": AGENT,
        "environment": {"environment_class": ENV_CLASS},
        "model": {
            "model_class": "deterministic",
            "model_name": "deterministic",
            "outputs": turns("ls", SUBMIT),
        },
    }
    instance = {"instance_id": TASK, "problem_statement": "fix semverkit"}
    progress = RunBatchProgressManager(1, tmp_path / "exit_statuses.yaml")
    swebench.process_instance(instance, tmp_path, config, progress)
    traj = json.loads((tmp_path / TASK / f"{TASK}.traj.json").read_text())
    assert traj["info"]["exit_status"] == "TaskNotBoundError", traj["info"]
    assert "env_startup_command" in json.dumps(traj["info"])  # the line to add
    assert traj["info"]["model_stats"]["api_calls"] == 0
