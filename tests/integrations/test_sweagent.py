"""SWE-agent, unmodified, on minisandbox: `deployment.type: minisandbox`, its batch mode with
SWE-bench image names, its tools in the sandbox, and the submitted patch scored by our
evaluator. The model is SWE-agent's own replay model (no LLM, no cost)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip(
    "swerex", reason="SWE-ReX is not installed (the `swerex` extra: pip install -e '.[swerex]')"
)
# Before SWE-agent loads: its modules bind the deployment union on import.
from minisandbox.integrations.sweagent import register

register()
sweagent = pytest.importorskip(
    "sweagent",
    reason="SWE-agent is not installed (not on PyPI: pip install -e <a clone of its repository>)",
)

from minisandbox.evaluation.evaluator import Evaluator  # noqa: E402
from minisandbox.integrations.swerex import MiniSandboxDeploymentConfig  # noqa: E402
from minisandbox.tasks.builder import Builder, BuildSettings  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402
from minisandbox.tasks.specs import Task  # noqa: E402

TASK = "examples__tablekit-1"
SOURCE = "/testbed/src/tablekit/__init__.py"
IMAGE = "docker.io/swebench/sweb.eval.x86_64.examples_1776_tablekit-1:latest"


@pytest.fixture(scope="module")
def task() -> Task:
    return {t.id: t for t in load_tasks("examples")}[TASK]


def test_deployment_type_accepted_by_sweagent_configs() -> None:
    from sweagent.environment.swe_env import EnvironmentConfig
    from sweagent.run.batch_instances import SimpleBatchInstance
    from swerex.deployment.config import DockerDeploymentConfig

    env = EnvironmentConfig.model_validate({"deployment": {"type": "minisandbox", "task": TASK}})
    assert isinstance(env.deployment, MiniSandboxDeploymentConfig)
    assert env.deployment.task == TASK
    assert isinstance(EnvironmentConfig().deployment, DockerDeploymentConfig)  # default unchanged
    # Batch mode writes the instance's image into the shared deployment config's copy.
    instance = SimpleBatchInstance(
        image_name=IMAGE, problem_statement="p", instance_id=TASK, repo_name="testbed"
    ).to_full_batch_instance(MiniSandboxDeploymentConfig())
    assert isinstance(instance.env.deployment, MiniSandboxDeploymentConfig)
    assert instance.env.deployment.image == IMAGE


def _tool_call(i: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {
        "message": f"step {i}",
        "tool_calls": [
            {
                "type": "function",
                "id": f"call_{i}",
                "function": {"name": name, "arguments": json.dumps(args)},
            }
        ],
    }


def _run_batch(
    tmp: Path, task: Task, actions: list[dict[str, Any]], settings: BuildSettings
) -> dict[str, Any]:
    """`python -m minisandbox.integrations.sweagent run-batch` on one SWE-bench-style instance
    (named by its official image), replaying `actions`; returns SWE-agent's preds.json."""
    replay = tmp / "replay.jsonl"
    replay.write_text(json.dumps({task.id: actions}) + "\n")
    instances = tmp / "instances.json"
    instances.write_text(
        json.dumps(
            [
                {
                    "image_name": IMAGE,
                    "problem_statement": task.problem_statement,
                    "instance_id": task.id,
                    "repo_name": "testbed",
                    "base_commit": task.base_commit,
                }
            ]
        )
    )
    out = tmp / "out"
    env = {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisandbox.integrations.sweagent",
            "run-batch",
            f"--config={Path(sweagent.CONFIG_DIR) / 'default.yaml'}",
            "--agent.model.name=replay",
            f"--agent.model.replay_path={replay}",
            "--instances.type=file",
            f"--instances.path={instances}",
            "--instances.deployment.type=minisandbox",
            f"--output_dir={out}",
            "--num_workers=1",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preds = out / "preds.json"
    assert preds.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(preds.read_text())


async def _reward(task: Task, patch: str, settings: BuildSettings) -> float:
    result = await Evaluator(Builder(settings)).evaluate(task, patch)
    return result.reward


async def test_sweagent_gold_patch_resolves(
    built: list, settings: BuildSettings, task: Task, tmp_path: Path
) -> None:
    """The replayed agent applies the gold patch with SWE-agent's bash tool, checks it with its
    str_replace_editor tool (Python tools run in the sandbox), submits twice (the review
    step of the default config); the evaluator resolves the submission."""
    apply = (
        "cd /testbed && cat > /tmp/fix.patch <<'EOF_FIX'\n"
        + task.gold_patch
        + "EOF_FIX\ngit apply /tmp/fix.patch && rm /tmp/fix.patch && git status --short"
    )
    actions = [
        _tool_call(1, "bash", {"command": apply}),
        _tool_call(2, "str_replace_editor", {"command": "view", "path": SOURCE}),
        _tool_call(3, "submit", {}),
        _tool_call(4, "submit", {}),
    ]
    preds = _run_batch(tmp_path, task, actions, settings)
    patch = preds[task.id]["model_patch"]
    assert patch.strip() == task.gold_patch.strip()
    traj = json.loads((tmp_path / "out" / task.id / f"{task.id}.traj").read_text())
    viewed = traj["trajectory"][1]["observation"]
    assert "row[-1]" in viewed, viewed  # the editor tool ran and saw the patched file
    assert await _reward(task, patch, settings) == 1.0


async def test_sweagent_empty_submission_scores_zero(
    built: list, settings: BuildSettings, task: Task, tmp_path: Path
) -> None:
    actions = [_tool_call(1, "submit", {}), _tool_call(2, "submit", {})]
    preds = _run_batch(tmp_path, task, actions, settings)
    patch = preds[task.id]["model_patch"] or ""
    assert patch.strip() == ""
    assert await _reward(task, patch, settings) == 0.0
