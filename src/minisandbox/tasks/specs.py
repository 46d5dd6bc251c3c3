"""What a task is: a repository at a commit, its environment recipe (envs.recipe, shared between
tasks), how to install it and how to test it.

The builder turns a task into two layers: an environment layer (a venv with the recipe's pinned
requirements, keyed by `EnvRecipe.key`, so tasks with the same recipe share it) and a task layer
(the repository at `base_commit` in /testbed, plus what `pre_install` and `install` change).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisandbox.envs.asof import as_of_date
from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.patches import patched_files

# GitHub: owners are letters, digits and single hyphens; names may also hold "." and "_".
_REPO = re.compile(r"[A-Za-z0-9][A-Za-z0-9-]*/[A-Za-z0-9._-]+")
_COMMIT = re.compile(r"[0-9a-f]{7,40}")
# Ids name directories and layers: no slashes, no leading dot.
_TASK_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")
# A name used as one path component (a task id, a model's report directory, an environment
# file's name): bounded so that "<name>.<suffix>" still fits the 255 bytes of a file name.
MAX_NAME_BYTES = 200
_DIFF_GIT = re.compile(r"^diff --git a/\S+ b/(\S+)$")
_HUNK = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")


def path_name_problem(name: str) -> str | None:
    """Why `name` cannot be one component of a path (None when it can): empty, too long, "."
    or "..", a "/", or a control character (a newline would split every line-based record)."""
    if not name:
        return "is empty"
    if len(name.encode(errors="surrogatepass")) > MAX_NAME_BYTES:
        return f"is longer than {MAX_NAME_BYTES} bytes"
    if name in (".", ".."):
        return f"is {name!r}, which names a directory, not a file in it"
    if "/" in name:
        return "contains '/'"
    # Cc: ASCII and C1 controls (newline, NUL, ESC...); Zl/Zp: line breaks to str.splitlines.
    bad = next((c for c in name if unicodedata.category(c) in ("Cc", "Zl", "Zp")), None)
    if bad is not None:
        return f"contains the control character {bad!r}"
    return None


def task_id_problem(value: str) -> str | None:
    """Why `value` cannot be a task id (None when it can): ids name directories and layers."""
    problem = path_name_problem(value)
    if problem is not None:
        return problem
    if not _TASK_ID.fullmatch(value):
        return "has a character other than letters, digits and . _ + - (or starts with one)"
    return None


def files_of_tests(test_ids: list[str]) -> set[str]:
    """The files of pytest test ids (`path::name` gives `path`); an id of another form
    (unittest's `test_x (module.Class)`) names no file."""
    return {t.split("::", 1)[0] for t in test_ids if "::" in t}


def hidden_tests(task: Task) -> list[str]:
    """The test files a bug task hides from the agent, as SWE-smith's harness does: those of its
    FAIL_TO_PASS tests (none for other tasks)."""
    return sorted(files_of_tests(task.fail_to_pass)) if task.bug_patch else []


def shown_tests(task: Task) -> list[str]:
    """The PASS_TO_PASS tests' files a bug task does not hide: in its sandbox, and reset to
    its commit at evaluation."""
    return sorted(files_of_tests(task.pass_to_pass) - set(hidden_tests(task)))


def files_in_patch(patch: str) -> list[str]:
    """Paths a unified diff touches (the new path; the old one for a deleted file), in order.

    Hunks are skipped by their line counts, so a removed line that itself starts with "-- "
    is never taken for a file header.
    """
    return list(dict.fromkeys(f.path for f in patched_files(patch) if f.path))


def _strip_prefix(path: str, prefix: str) -> str:
    path = path.split("\t")[0].strip()
    return path[len(prefix) :] if path.startswith(prefix) else path


class Task(BaseModel):
    """One task: a repository at a commit, its environment, how to install and test it."""

    model_config = ConfigDict(extra="forbid")

    id: str
    repo: str = Field(description='"owner/name" on GitHub')
    base_commit: str = Field(description="commit the task starts from (7-40 hex digits)")
    env: EnvRecipe
    pre_install: list[str] = Field(
        default_factory=list, description="shell commands run in /testbed before `install`"
    )
    install: list[str] = Field(
        default_factory=list, description='shell commands run in /testbed, e.g. "pip install -e ."'
    )
    install_as_of: str | None = Field(
        None,
        description="resolve what `install` pip-installs as of this date (uv --exclude-newer): "
        'an ISO 8601 date or time, or "commit" for base_commit\'s committer date; recorded in '
        "the repository layer's metadata with what was installed",
    )
    test_cmd: str = Field(description="shell command that runs the tests, in /testbed")
    test_files: list[str] = Field(
        default_factory=list, description="files the test patch touches (derived when empty)"
    )
    log_parser: str = Field("pytest", description='swebench log parser name, e.g. "pytest"')
    eval_type: Literal["pass_and_fail", "fail_only"] = Field(
        "pass_and_fail",
        description="swebench's grading: FAIL_TO_PASS/PASS_TO_PASS must pass, or must not fail",
    )
    services: list[str] = Field(
        default_factory=list,
        description='test-time services served on loopback inside the sandbox, e.g. "httpbin"',
    )
    gold_patch: str = ""
    test_patch: str = ""
    bug_patch: str = Field(
        "", description="SWE-smith style: applied on top of base_commit to make the task"
    )
    fail_to_pass: list[str] = Field(default_factory=list)
    pass_to_pass: list[str] = Field(default_factory=list)
    eval_script: str | None = None
    problem_statement: str = ""
    hints_text: str = ""
    version: str | None = None
    image: str | None = Field(None, description="official Docker image of the task, if any")
    environment_setup_commit: str | None = None
    source: str = Field("", description="where the task was loaded from")

    @field_validator("id")
    @classmethod
    def _check_id(cls, value: str) -> str:
        problem = task_id_problem(value)
        if problem is not None:
            raise ValueError(
                f"{value!r} {problem}: use letters, digits and . _ + - (no slashes), at most "
                f"{MAX_NAME_BYTES} bytes"
            )
        return value

    @field_validator("repo")
    @classmethod
    def _check_repo(cls, value: str) -> str:
        if not _REPO.fullmatch(value):
            raise ValueError(f'{value!r} is not a GitHub repository like "owner/name"')
        return value

    @field_validator("base_commit", "environment_setup_commit")
    @classmethod
    def _check_commit(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip().lower()
        if not _COMMIT.fullmatch(value):
            raise ValueError(f"{value!r} is not a commit hash (7 to 40 hex digits)")
        return value

    @field_validator("install_as_of")
    @classmethod
    def _check_as_of(cls, value: str | None) -> str | None:
        if value is None or value == "commit":
            return value
        return as_of_date(value)

    @field_validator("test_cmd")
    @classmethod
    def _check_test_cmd(cls, value: str) -> str:
        if not value.strip():
            raise ValueError("test_cmd is empty")
        return value

    @model_validator(mode="after")
    def _derive_test_files(self) -> Task:
        if not self.test_files and self.test_patch:
            self.test_files = files_in_patch(self.test_patch)
        return self

    def environment_key(self, interpreter_version: str) -> str:
        """Key of this task's environment layer, built with a `interpreter_version` Python: the
        recipe's key, and the repository at its environment commit when there is one (a recipe
        whose pins conflict is relaxed by what the repository imports there, relax.py)."""
        key = self.env.key(interpreter_version)
        if not self.environment_setup_commit:
            return key
        origin = f"{key}\0{self.repo}@{self.environment_setup_commit}"
        return hashlib.sha256(origin.encode()).hexdigest()
