"""mini-swe-agent 1.x (the supported range 1.17 up to 2) on minisandbox: its own agent and its
SWE-bench batch runner, unmodified, with the environment class set by config. Run in the
stack's venv (`scripts/test-stack minisweagent1`); the dev venv holds 2.x, where this skips."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
mswea = pytest.importorskip(
    "minisweagent", reason="mini-swe-agent is not installed: scripts/test-stack minisweagent1"
)
if int(mswea.__version__.split(".")[0]) != 1:
    pytest.skip(
        f"needs mini-swe-agent 1.x ({mswea.__version__} is installed): "
        "scripts/test-stack minisweagent1",
        allow_module_level=True,
    )

from minisweagent.agents.default import DefaultAgent  # noqa: E402
from minisweagent.models.test_models import DeterministicModel  # noqa: E402
from minisweagent.run.extra import swebench  # noqa: E402
from minisweagent.run.extra.utils.batch_progress import RunBatchProgressManager  # noqa: E402

from minisandbox.errors import TaskNotBoundError  # noqa: E402
from minisandbox.integrations.minisweagent import MiniSandboxEnvironment  # noqa: E402
from minisandbox.tasks.builder import Builder  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402

TASK = "examples__semverkit-1"
ENV_CLASS = "minisandbox.integrations.minisweagent.MiniSandboxEnvironment"
SUBMIT = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"


def gold_patch() -> str:
    return next(t for t in load_tasks("examples") if t.id == TASK).gold_patch


def bash(*commands: str) -> list[str]:
    """1.x model outputs: one bash block each."""
    return [f"```bash\n{c}\n```" for c in commands]


def apply_gold() -> str:
    return f"git apply <<'MSB_PATCH_EOF'\n{gold_patch()}\nMSB_PATCH_EOF"


def test_v1_agent_applies_gold_patch_and_submits_reward_1(builder: Builder) -> None:
    """1.x's DefaultAgent: string commands, a timeout raised as TimeoutExpired (the agent tells
    the model and goes on), submission detected by the agent."""
    env = MiniSandboxEnvironment(builder=builder, task=TASK, timeout=2)
    try:
        outputs = bash(apply_gold(), "echo partial; sleep 30", SUBMIT)
        agent = DefaultAgent(DeterministicModel(outputs=outputs), env, step_limit=10)
        status, submission = agent.run("fix semverkit")
        assert status == "Submitted", submission
        timed_out = [m["content"] for m in agent.messages if "timed out" in m["content"]]
        assert len(timed_out) == 1 and "partial" in timed_out[0]
        assert "+from packaging.version import Version" in submission
        assert env.evaluate(submission).reward == 1.0
        assert env.evaluate("").reward == 0.0
    finally:
        env.cleanup()


DIRECTIVE = {"env_startup_command": "#minisandbox-task {{instance_id}}"}


def _batch(out: Path, outputs: list[str], run: dict | None = None) -> dict:
    """mini-swe-agent's SWE-bench batch runner on one instance: the trajectory's info."""
    model = {"model_class": "deterministic", "model_name": "deterministic", "outputs": outputs}
    config = {
        "agent": {"step_limit": 10, "cost_limit": 100.0},
        "environment": {"environment_class": ENV_CLASS, "timeout": 60, "run_args": ["--rm"]},
        "run": DIRECTIVE if run is None else run,
        "model": model,
    }
    instance = {"instance_id": TASK, "problem_statement": "fix semverkit"}
    progress = RunBatchProgressManager(1, out / "exit_statuses.yaml")
    swebench.process_instance(instance, out, config, progress)
    return json.loads((out / TASK / f"{TASK}.traj.json").read_text())["info"]


@pytest.mark.timeout(900)
def test_v1_batch_runner_writes_predictions_gold_1_empty_0(
    use_settings: None, tmp_path: Path
) -> None:
    """The batch runner saves the environment's config (`dataclasses.asdict`) and writes
    preds.json; the gold run's patch resolves the task, the empty run's does not."""
    rewards = {}
    for name, outputs in {"gold": bash(apply_gold(), SUBMIT), "empty": bash(SUBMIT)}.items():
        info = _batch(tmp_path / name, outputs)
        assert info["exit_status"] == "Submitted", info
        assert info["config"]["environment"]["task"] == TASK
        patch = json.loads((tmp_path / name / "preds.json").read_text())[TASK]["model_patch"]
        grader = MiniSandboxEnvironment(task=TASK)
        try:
            rewards[name] = grader.evaluate(patch).reward
        finally:
            grader.cleanup()
    assert rewards == {"gold": 1.0, "empty": 0.0}


def test_v1_batch_runner_without_the_directive_fails_before_any_model_call(
    use_settings: None, tmp_path: Path
) -> None:
    info = _batch(tmp_path, bash("ls", SUBMIT), run={})
    assert info["exit_status"] == TaskNotBoundError.__name__, info
    assert "env_startup_command" in info["submission"]  # the line to add
    assert info["model_stats"]["api_calls"] == 0
