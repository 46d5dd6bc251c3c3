"""SWE-agent on minisandbox, without a fork of SWE-agent.

SWE-agent's `deployment` settings are SWE-ReX's `DeploymentConfig`, a union of config classes
told apart by their `type`. `register()` adds `MiniSandboxDeploymentConfig` to that union; it
must run before SWE-agent's modules are imported, because they bind the union when they load.
The runner below does that and then hands over to SWE-agent's own CLI:

    python -m minisandbox.integrations.sweagent run \\
        --agent.model.name=... --env.deployment.type=minisandbox \\
        --env.deployment.task=examples__tablekit-1
    python -m minisandbox.integrations.sweagent run-batch \\
        --instances.type=swe_bench --instances.deployment.type=minisandbox ...

In batch mode SWE-agent writes each instance's official image name into `deployment.image`;
our deployment maps it to the task (`resolve_task`), so SWE-bench's image names just work.

A task's repository is /testbed, which SWE-agent only knows through `repo_name: testbed`
(without it, its `submit` tool fails on every step). The runner fills in what a task
deployment implies (`complete_env`, `complete_single`) before anything starts: the repository,
and for `run` the task's problem statement and its id, so that predictions are keyed by the task
id; a `run` also leaves `preds.json` in its output directory, as `run-batch` does.
"""

from __future__ import annotations

import hashlib
import json
import sys
import typing
from pathlib import Path
from typing import TYPE_CHECKING, Any

from minisandbox import errors
from minisandbox.integrations import swerex as _swerex
from minisandbox.integrations.swerex import MiniSandboxDeploymentConfig
from minisandbox.integrations.tasks import resolve_task

if TYPE_CHECKING:  # SWE-agent is optional (and not on PyPI): without it these are Any to mypy
    from sweagent.environment.swe_env import EnvironmentConfig
    from sweagent.run.run_single import RunSingleConfig

__all__ = ["complete_env", "complete_single", "main", "register", "registered"]

# Modules of SWE-agent that bind swerex's DeploymentConfig when they are imported.
_BINDERS = (
    "sweagent.environment.swe_env",
    "sweagent.run.batch_instances",
    "sweagent.run.run_replay",
)
# Where a task's repository is (SWE-bench's layout): SWE-agent's `repo_name`.
REPO_NAME = "testbed"


def _bound(module: str) -> bool:
    union = getattr(sys.modules[module], "DeploymentConfig", None)
    return MiniSandboxDeploymentConfig in typing.get_args(union)


def registered() -> bool:
    """Whether SWE-ReX's deployment union, and each SWE-agent module already loaded that bound
    it, accept `type: minisandbox`."""
    return _swerex.registered() and all(_bound(m) for m in _BINDERS if m in sys.modules)


def register() -> None:
    """Make `type: minisandbox` a deployment SWE-agent (and anything reading swerex's
    DeploymentConfig afterwards) accepts. Idempotent.

    Raises:
        RuntimeError: SWE-agent's config modules were imported before, with the union
            without minisandbox (import minisandbox.integrations.sweagent first).
    """
    _swerex.register()
    stale = [m for m in _BINDERS if m in sys.modules and not _bound(m)]
    if stale:
        raise RuntimeError(
            "register() must run before SWE-agent is imported (already loaded: "
            f"{', '.join(stale)}); import minisandbox.integrations.sweagent first"
        )


def complete_env(env: EnvironmentConfig) -> None:
    """Fill in what a minisandbox deployment implies in SWE-agent's EnvironmentConfig `env`:
    a task's repository is /testbed (`repo_name: testbed`), unless `env.repo` names one.

    Raises:
        ValueError: a plain sandbox (no task, no image) without `env.repo`: SWE-agent's tools
            need a repository; the message names the setting to add.
    """
    from sweagent.environment.repo import PreExistingRepoConfig

    deployment = env.deployment
    if not isinstance(deployment, MiniSandboxDeploymentConfig) or env.repo is not None:
        return
    if not (deployment.task or deployment.image):
        raise ValueError(
            "a minisandbox deployment without a task has no repository, and SWE-agent's submit "
            "needs one: set env.deployment.task (a task id), or env.repo (e.g. "
            "--env.repo.path=<a local git repository>)"
        )
    env.repo = PreExistingRepoConfig(repo_name=REPO_NAME)


def _hashed_id(problem_statement: object) -> bool:
    """Whether SWE-agent gave `problem_statement` its default id: for a text or a file given
    without an id, a hash of the text. Other statements (a GitHub issue: reading its text is a
    network fetch) have ids of their own and are not read."""
    from sweagent.agent.problem_statement import FileProblemStatement, TextProblemStatement

    if not isinstance(problem_statement, TextProblemStatement | FileProblemStatement):
        return False
    try:
        text = problem_statement.get_problem_statement()
    except OSError:  # a file that went away: SWE-agent reports that itself
        return False
    return bool(problem_statement.id == hashlib.sha256(text.encode()).hexdigest()[:6])


def complete_single(config: RunSingleConfig) -> None:
    """Complete SWE-agent's RunSingleConfig for a task deployment: its repository
    (`complete_env`), the task's problem statement when none is given, and the task id as the
    problem statement's id unless one was given (SWE-agent's would be a hash or a uuid, and its
    predictions are keyed by it).

    Raises:
        ValueError: as complete_env, or the deployment's task is not in its dataset.
    """
    from sweagent.agent.problem_statement import EmptyProblemStatement, TextProblemStatement

    complete_env(config.env)
    deployment = config.env.deployment
    if not isinstance(deployment, MiniSandboxDeploymentConfig):
        return
    name = deployment.task or deployment.image
    if not name:
        return
    try:
        task = resolve_task(name, deployment.dataset, deployment.envs_dir)
    except errors.MiniSandboxError as e:
        raise ValueError(f"env.deployment.task: {e}") from None
    statement = config.problem_statement
    if isinstance(statement, EmptyProblemStatement):
        config.problem_statement = TextProblemStatement(text=task.problem_statement, id=task.id)
    elif _hashed_id(statement):
        statement.id = task.id


def _write_preds(output_dir: Path, instance_id: str) -> None:
    """`run` leaves `<output_dir>/<id>/<id>.pred`; `preds.json` beside it (keyed by id, as
    `run-batch` writes it) is what `minisandbox eval --predictions` reads."""
    pred = output_dir / instance_id / f"{instance_id}.pred"
    if pred.is_file():
        data = json.loads(pred.read_text())
        (output_dir / "preds.json").write_text(json.dumps({instance_id: data}, indent=4))


def _install_run_hooks() -> None:
    """SWE-agent's `run` and `run-batch` read their config, then call their module's
    `run_from_config`: ours completes the config first, in the same place."""
    from sweagent.run import run_batch, run_single

    def single(config: Any) -> None:
        try:
            complete_single(config)
        except ValueError as e:
            raise SystemExit(f"minisandbox: {e}") from None
        run_single.RunSingle.from_config(config).run()
        _write_preds(Path(config.output_dir), config.problem_statement.id)

    def batch(config: Any) -> None:
        runner = run_batch.RunBatch.from_config(config)
        try:
            for instance in runner.instances:
                complete_env(instance.env)
        except ValueError as e:
            raise SystemExit(f"minisandbox: {e}") from None
        runner.main()

    run_single.run_from_config = single
    run_batch.run_from_config = batch


def main(argv: list[str] | None = None) -> Any:
    """SWE-agent's CLI (`sweagent run|run-batch|run-replay|...`) with minisandbox deployments."""
    register()
    try:
        from sweagent.run.run import main as sweagent_main
    except ImportError as e:
        raise SystemExit(
            f"SWE-agent is not installed ({e}). It is not on PyPI: install it from its "
            "repository (git clone https://github.com/SWE-agent/SWE-agent && pip install -e "
            "SWE-agent)"
        ) from None
    _install_run_hooks()
    return sweagent_main(sys.argv[1:] if argv is None else argv)


if __name__ == "__main__":
    main()
