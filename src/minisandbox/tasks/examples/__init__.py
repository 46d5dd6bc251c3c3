"""The bundled example tasks: small but real, each a repository with a bug, a gold patch, and
pytest tests that need a package from PyPI.

The repositories ship as plain files and become git repositories when first needed: committed
with a fixed author, date and message, so the base commit is the same on every machine.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

from minisandbox.errors import ExampleTaskError

if TYPE_CHECKING:
    from minisandbox.tasks.specs import Task

EXAMPLES_DIR = Path(__file__).parent
NAMES = ("semverkit", "datekit", "tablekit")
_IDENTITY = {
    "GIT_AUTHOR_NAME": "minisandbox",
    "GIT_AUTHOR_EMAIL": "examples@minisandbox.invalid",
    "GIT_COMMITTER_NAME": "minisandbox",
    "GIT_COMMITTER_EMAIL": "examples@minisandbox.invalid",
    "GIT_AUTHOR_DATE": "2024-01-01T00:00:00+00:00",
    "GIT_COMMITTER_DATE": "2024-01-01T00:00:00+00:00",
}


def _meta(name: str) -> dict:
    return json.loads((EXAMPLES_DIR / name / "task.json").read_text())


def _git(cwd: Path, *args: str) -> str:
    env = {**os.environ, **_IDENTITY, "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(cwd)}
    return subprocess.run(
        ["git", "-c", "commit.gpgsign=false", "-c", "core.autocrlf=false", *args],
        cwd=cwd,
        env=env,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def materialize_mirror(mirror: Path) -> Path:
    """Make `mirror/<owner>__<name>` a git repository of every example (the layout of
    `--git-mirror`), at its recorded base commit. Returns `mirror`."""
    mirror.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        meta = _meta(name)
        target = mirror / meta["repo"].replace("/", "__")
        if (target / ".git").is_dir():
            continue
        staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=mirror))
        try:
            shutil.copytree(EXAMPLES_DIR / name / "repo", staging, dirs_exist_ok=True)
            for dirpath, _dirs, files in os.walk(staging):  # modes as committed: 644
                for f in files:
                    os.chmod(os.path.join(dirpath, f), 0o644)
            _git(staging, "init", "-q")
            _git(staging, "symbolic-ref", "HEAD", "refs/heads/main")
            _git(staging, "add", "-A")
            _git(staging, "commit", "-q", "-m", "Initial commit")
            commit = _git(staging, "rev-parse", "HEAD")
            if commit != meta["base_commit"]:
                raise ExampleTaskError(
                    f"example {name}: its repository was committed as {commit}, not the recorded "
                    f"base commit {meta['base_commit']} (were its files changed?)"
                )
            try:
                os.rename(staging, target)
            except OSError:
                if not (target / ".git").is_dir():  # not another builder winning the race
                    raise
        finally:
            if staging.exists():
                shutil.rmtree(staging)
    return mirror


def load_examples() -> list[Task]:
    """The bundled tasks. Their environment uses the Python minor version running this code,
    so the examples build wherever minisandbox runs."""
    from minisandbox.envs.recipe import EnvRecipe
    from minisandbox.tasks.specs import Task

    python = f"{sys.version_info.major}.{sys.version_info.minor}"
    tasks = []
    for name in NAMES:
        meta = _meta(name)
        here = EXAMPLES_DIR / name
        tasks.append(
            Task(
                id=meta["id"],
                repo=meta["repo"],
                base_commit=meta["base_commit"],
                env=EnvRecipe(python=python, requirements=meta["requirements"]),
                install=["python -m pip install --no-deps --no-build-isolation -e ."],
                test_cmd="pytest -rA " + " ".join(meta["test_files"]),
                test_files=meta["test_files"],
                log_parser="pytest",
                gold_patch=(here / "gold.patch").read_text(),
                test_patch=(here / "test.patch").read_text(),
                fail_to_pass=meta["FAIL_TO_PASS"],
                pass_to_pass=meta["PASS_TO_PASS"],
                problem_statement=meta["problem_statement"],
                source="examples",
            )
        )
    return tasks
