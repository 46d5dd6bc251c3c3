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
    reason="SWE-agent is not installed (not on PyPI): scripts/test-stack sweagent",
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


def _doc_yaml() -> str:
    """The batch config docs/integrations/sweagent.md shows (its first YAML block)."""
    doc = (
        Path(__file__).resolve().parents[2] / "docs" / "integrations" / "sweagent.md"
    ).read_text()
    return doc.split("```yaml\n", 1)[1].split("```", 1)[0]


def _env(settings: BuildSettings) -> dict[str, str]:
    return {
        **os.environ,
        "MINISANDBOX_STORE": str(settings.store),
        "MINISANDBOX_CACHE": str(settings.cache),
        "MINISANDBOX_GIT_MIRROR": str(settings.git_mirror),
    }


# SWE-agent 1.1.0's default tools, less edit_anthropic: its install.sh fails without network
# (`pip install tree-sitter`; SWE-agent ignores that failure from its next release on). The
# sandboxes here are offline; `deployment.network: true` would let the default tools install.
OFFLINE_TOOLS = """\
agent:
  tools:
    bundles:
      - path: tools/registry
      - path: tools/windowed
      - path: tools/review_on_submit_m
    env_variables:
      WINDOW: 100
      OVERLAP: 2
"""


def _sweagent(tmp: Path, settings: BuildSettings, *args: str) -> subprocess.CompletedProcess:
    (tmp / "offline.yaml").write_text(OFFLINE_TOOLS)
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "minisandbox.integrations.sweagent",
            *args,
            f"--config={Path(sweagent.CONFIG_DIR) / 'default.yaml'}",
            f"--config={tmp / 'offline.yaml'}",
            "--agent.model.name=replay",
            f"--agent.model.replay_path={tmp / 'replay.jsonl'}",
            f"--output_dir={tmp / 'out'}",
        ],
        cwd=tmp,
        env=_env(settings),
        capture_output=True,
        text=True,
        timeout=300,
    )


def _run_batch(
    tmp: Path, task: Task, actions: list[dict[str, Any]], settings: BuildSettings
) -> dict[str, Any]:
    """`python -m minisandbox.integrations.sweagent run-batch` with the documented YAML config
    on one SWE-bench-style instance (named by its official image, without `repo_name`),
    replaying `actions`; returns SWE-agent's preds.json."""
    (tmp / "replay.jsonl").write_text(json.dumps({task.id: actions}) + "\n")
    (tmp / "batch.yaml").write_text(_doc_yaml())
    instance = {
        "image_name": IMAGE,
        "problem_statement": task.problem_statement,
        "instance_id": task.id,
    }
    (tmp / "instances.json").write_text(json.dumps([instance]))
    proc = _sweagent(tmp, settings, "run-batch", "--config=batch.yaml", "--num_workers=1")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preds = tmp / "out" / "preds.json"
    assert preds.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    traj = json.loads((tmp / "out" / task.id / f"{task.id}.traj").read_text())
    # Each replayed action is one step: none failed and was retried (SWE-agent's submit
    # asserted on every step when it did not know the repository).
    assert len(traj["trajectory"]) == len(actions), [s["observation"] for s in traj["trajectory"]]
    return json.loads(preds.read_text())


async def _reward(task: Task, patch: str, settings: BuildSettings) -> float:
    result = await Evaluator(Builder(settings)).evaluate(task, patch)
    return result.reward


async def test_sweagent_gold_patch_resolves(
    built: list, settings: BuildSettings, task: Task, tmp_path: Path
) -> None:
    """The replayed agent applies the gold patch with SWE-agent's bash tool, checks it with its
    `open` tool (Python tools run in the sandbox), submits twice (the review
    step of the default config); the evaluator resolves the submission."""
    apply = (
        "cd /testbed && cat > /tmp/fix.patch <<'EOF_FIX'\n"
        + task.gold_patch
        + "EOF_FIX\ngit apply /tmp/fix.patch && rm /tmp/fix.patch && git status --short"
    )
    actions = [
        _tool_call(1, "bash", {"command": apply}),
        _tool_call(2, "open", {"path": SOURCE}),
        _tool_call(3, "submit", {}),
        _tool_call(4, "submit", {}),
    ]
    preds = _run_batch(tmp_path, task, actions, settings)
    patch = preds[task.id]["model_patch"]
    assert patch.strip() == task.gold_patch.strip()
    traj = json.loads((tmp_path / "out" / task.id / f"{task.id}.traj").read_text())
    viewed = traj["trajectory"][1]["observation"]
    assert "row[-1]" in viewed, viewed  # the `open` tool ran and saw the patched file
    assert await _reward(task, patch, settings) == 1.0


async def test_single_run_takes_the_task_and_keys_predictions_by_its_id(
    built: list, settings: BuildSettings, task: Task, tmp_path: Path
) -> None:
    """`run` with only `--env.deployment.task`: the task's problem statement, its repository,
    and preds.json keyed by the task id, which `minisandbox eval` reads."""
    apply = f"cd /testbed && git apply <<'EOF_FIX'\n{task.gold_patch}EOF_FIX"
    actions = [_tool_call(1, "bash", {"command": apply}), _tool_call(2, "submit", {})]
    actions.append(_tool_call(3, "submit", {}))
    (tmp_path / "replay.jsonl").write_text(json.dumps({task.id: actions}) + "\n")
    proc = _sweagent(
        tmp_path,
        settings,
        "run",
        "--env.deployment.type=minisandbox",
        f"--env.deployment.task={TASK}",
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    preds_path = tmp_path / "out" / "preds.json"
    preds = json.loads(preds_path.read_text())
    assert list(preds) == [task.id]
    traj = json.loads((tmp_path / "out" / task.id / f"{task.id}.traj").read_text())
    assert task.problem_statement.strip()[:60] in json.dumps(traj["history"])
    eval_proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "minisandbox.cli",
            "eval",
            "examples",
            "--predictions",
            str(preds_path),
        ],
        env=_env(settings),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert eval_proc.returncode == 0, eval_proc.stdout[-2000:] + eval_proc.stderr[-2000:]
    assert await _reward(task, preds[task.id]["model_patch"], settings) == 1.0


def test_plain_deployment_without_a_repository_fails_before_the_model(
    settings: BuildSettings, tmp_path: Path
) -> None:
    (tmp_path / "replay.jsonl").write_text(json.dumps({"x": [_tool_call(1, "submit", {})]}) + "\n")
    proc = _sweagent(
        tmp_path, settings, "run", "--env.deployment.type=minisandbox", "--problem_statement.text=x"
    )
    assert proc.returncode != 0
    assert "minisandbox: " in proc.stderr and "env.repo" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").rglob("*.traj"))


def test_single_config_ids_by_task_and_never_fetches_an_issue(tmp_path: Path) -> None:
    """`complete_single` replaces the id SWE-agent hashed from a text or a file by the task id,
    keeps an id that was given, and leaves a GitHub issue's id alone without reading the issue
    (that would fetch it from GitHub: any name lookup or connection here fails the test)."""
    import threading

    from sweagent.agent.problem_statement import (
        FileProblemStatement,
        GithubIssue,
        TextProblemStatement,
    )
    from sweagent.run.run_single import RunSingleConfig

    from minisandbox.integrations.sweagent import complete_single

    issue_file = tmp_path / "issue.md"
    issue_file.write_text("Fix the table.")
    cases = [
        (TextProblemStatement(text="Fix the table."), TASK),
        (FileProblemStatement(path=issue_file), TASK),
        (TextProblemStatement(text="Fix the table.", id="given"), "given"),
        (
            GithubIssue(github_url="https://github.com/no-owner/no-repo/issues/7"),
            "no-owner__no-repo-i7",
        ),
    ]
    network: list[str] = []
    watched = threading.get_ident()

    def hook(event: str, args: tuple[Any, ...]) -> None:
        if event in ("socket.getaddrinfo", "socket.connect") and threading.get_ident() == watched:
            network.append(f"{event}{args[:2]}")

    sys.addaudithook(hook)  # audit hooks stay for the process: `watched` is reset below
    try:
        for statement, want in cases:
            config = RunSingleConfig(
                agent={"model": {"name": "instant_empty_submit"}},
                env={"deployment": {"type": "minisandbox", "task": TASK}},
                problem_statement=statement,
            )
            complete_single(config)
            assert config.problem_statement.id == want, statement
            assert config.env.repo is not None and config.env.repo.repo_name == "testbed"
    finally:
        watched = -1
    assert network == [], "the GitHub issue was fetched"


async def test_sweagent_empty_submission_scores_zero(
    built: list, settings: BuildSettings, task: Task, tmp_path: Path
) -> None:
    actions = [_tool_call(1, "submit", {}), _tool_call(2, "submit", {})]
    preds = _run_batch(tmp_path, task, actions, settings)
    patch = preds[task.id]["model_patch"] or ""
    assert patch.strip() == ""
    assert await _reward(task, patch, settings) == 0.0
