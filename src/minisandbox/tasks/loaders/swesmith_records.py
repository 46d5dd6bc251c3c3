"""SWE-smith-style records turned into tasks.

A SWE-smith record has an image (`image_name`) or an `environment`, and no `test_patch`:
`instance_id`, `repo` ("swesmith/owner__name.commit", "owner__name.commit", or "owner/name"
with a `base_commit` field), `patch` (the **bug** patch), `FAIL_TO_PASS`, `PASS_TO_PASS`.
One environment serves a repository at one commit: the task's repo and base commit are the
original repository and that commit (a `base_commit` of another commit is the SWE-smith
mirror's, and ignored), and `patch` becomes `bug_patch`, applied on top; the gold patch is the
bug patch reversed (unless the record gives `gold_patch`). A record without an environment gets
its repository's SWE-smith profile (swesmith_profiles): install and test commands, and a venv of
its Python into which the install resolves dependencies as of the commit's date.

Invariants: the environment file a record names stays inside the data file's folder or
envs_dir unless the caller allows absolute paths, and the repo name must be usable as a file
name before `envs_dir/<owner__name.commit>.yml` is looked at.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.loaders.conda_exports import conda_env_to_recipe
from minisandbox.tasks.loaders.fields import (
    Where,
    as_list,
    record_path,
    required,
    string_list,
    text,
    validate_task,
)
from minisandbox.tasks.loaders.swesmith_profiles import SwesmithProfile, swesmith_profile
from minisandbox.tasks.patches import reverse_patch
from minisandbox.tasks.specs import Task, path_name_problem

# SWE-smith's default Python test command; records may carry their own `test_cmd`.
SWESMITH_TEST_CMD = "pytest --disable-warnings --color=no --tb=no --verbose"
SWESMITH_INSTALL = "python -m pip install -e ."

_SWESMITH_REPO = re.compile(r"(?P<owner>[A-Za-z0-9-]+)__(?P<name>.+)\.(?P<commit>[0-9a-f]{7,40})")


def swesmith_task(
    record: dict[str, Any],
    where: Where,
    source: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    allow_abs: bool = False,
) -> Task:
    """The task of one SWE-smith record. `base_dir` is the data file's folder (None for a
    Hugging Face dataset).

    Raises:
        TaskFormatError: a field is missing or malformed, a path reaches outside the dataset
            (without `allow_abs`), or no environment recipe is found.
        MissingDependencyError: PyYAML is not installed (a conda export is read).
    """
    iid = text(record, "instance_id", where) or required(record, "instance_id", where)
    raw_repo = text(record, "repo", where) or required(record, "repo", where)
    bug_patch = text(record, "patch", where) or required(record, "patch", where)
    if "FAIL_TO_PASS" not in record:
        raise where.error("missing", "FAIL_TO_PASS")
    repo, commit, env_name = split_swesmith_repo(raw_repo)
    given = text(record, "base_commit", where)
    if not given and not commit:
        raise where.error(
            "missing: give base_commit, or a SWE-smith repo name 'owner__name.<commit>'",
            "base_commit",
        )
    if env_name is not None and path_name_problem(env_name) is not None:
        raise where.error(f"{raw_repo!r} {path_name_problem(env_name)}", "repo")
    recipe = _swesmith_recipe(record, where, env_name, iid, base_dir, envs_dir, allow_abs)
    profile = _profile(where, env_name) if recipe is None else None
    base_commit = _base_commit(given, commit, profile)
    install = profile.install_commands() if profile else [SWESMITH_INSTALL]
    data = {
        "id": iid,
        "repo": repo,
        "base_commit": base_commit,
        "env": profile.recipe() if profile else recipe,
        "pre_install": _commands(record, "pre_install", where, None),
        "install": _commands(record, "install", where, install),
        # A profile's environment is its install, as of the commit (swesmith_profiles).
        "install_as_of": text(record, "install_as_of", where) or ("commit" if profile else None),
        "test_cmd": text(record, "test_cmd", where)
        or (profile.test_cmd if profile else SWESMITH_TEST_CMD),
        "test_files": string_list(record, "test_files", where),
        # SWE-smith's parser reads the `<test id> <STATUS>` lines of its `pytest --verbose`.
        "log_parser": text(record, "log_parser", where).removeprefix("parse_log_") or "swesmith",
        "bug_patch": bug_patch,
        # Undoing the bug is the reference fix (SWE-smith grades its gold the same way).
        "gold_patch": text(record, "gold_patch", where) or reverse_patch(bug_patch),
        "fail_to_pass": string_list(record, "FAIL_TO_PASS", where),
        "pass_to_pass": string_list(record, "PASS_TO_PASS", where),
        "problem_statement": text(record, "problem_statement", where),
        "image": text(record, "image_name", where) or None,
        "source": source,
    }
    return validate_task(data, where)


def _base_commit(given: str, named: str | None, profile: SwesmithProfile | None) -> str:
    """The record's base commit, unless its repo name gives another: the commit named (in
    full from its profile). A published record's base_commit, when it has one, is its SWE-smith
    mirror's, a copy of that tree with a history of its own."""
    if named is None or given.lower().startswith(named.lower()):
        return given
    return profile.commit if profile else named


def _profile(where: Where, env_name: str | None) -> SwesmithProfile:
    """The SWE-smith profile of a record that brings no environment.

    Raises:
        TaskFormatError: the repo names no profile (not "owner__repo.commit"), or SWE-smith
            has none by that name, or not a Python one.
        MissingDependencyError: the `swesmith` package is not installed.
    """
    if env_name is None:
        raise where.error(
            "no environment: give `environment` (a mapping with python/requirements, or a "
            "conda export file), or name a SWE-smith profile as repo 'owner__repo.<commit>'",
            "environment",
        )
    try:
        return swesmith_profile(env_name)
    except LookupError as e:
        raise where.error(str(e.args[0]), "repo") from None


def _commands(record: dict[str, Any], field: str, where: Where, default: Any) -> list[str]:
    """`record[field]` (else `default`): a command or a list of commands, as a list.

    Raises:
        TaskFormatError: the field is neither (a number, say).
    """
    try:
        return as_list(record.get(field, default))
    except TypeError:
        raise where.error("expected a command or a list of commands", field) from None


def split_swesmith_repo(repo: str) -> tuple[str, str | None, str | None]:
    """Split a SWE-smith repo name: "swesmith/owner__name.abc1234" or "owner__name.abc1234"
    gives ("owner/name", "abc1234", "owner__name.abc1234"); "owner/name" passes through."""
    tail = repo.rsplit("/", 1)[-1]
    m = _SWESMITH_REPO.fullmatch(tail)
    if m:
        return f"{m['owner']}/{m['name']}", m["commit"], tail
    return repo, None, None


def _swesmith_recipe(
    record: dict[str, Any],
    where: Where,
    env_name: str | None,
    iid: str,
    base_dir: Path | None,
    envs_dir: Path | None,
    allow_abs: bool = False,
) -> EnvRecipe | None:
    """`environment` is a recipe mapping, or names a conda export (a path relative to the data
    file, or `<name>.yml` in envs_dir); without it, envs_dir/<owner__name.commit>.yml, else
    None (the repository's SWE-smith profile gives it). An absolute path or one with `..` is
    refused unless `allow_abs`."""
    environment = record.get("environment")
    if isinstance(environment, dict):
        try:
            return EnvRecipe.model_validate(environment)
        except ValidationError as exc:
            raise where.from_validation(exc, prefix="environment.") from None
    candidates = _export_candidates(
        environment, where, [env_name, iid], base_dir, envs_dir, allow_abs
    )
    for candidate in candidates:
        if candidate.is_file():
            return conda_env_to_recipe(candidate)
    if environment is None:
        return None  # SWE-smith's profile then (_profile)
    looked = ", ".join(str(c) for c in candidates) or "nothing (no envs_dir)"
    raise where.error(
        "no environment recipe: give `environment` (a mapping with python/requirements, or a "
        f"conda export file) or put <owner__name.commit>.yml in envs_dir; looked at {looked}",
        "environment",
    )


def _export_candidates(
    environment: Any,
    where: Where,
    names: list[str | None],
    base_dir: Path | None,
    envs_dir: Path | None,
    allow_abs: bool,
) -> list[Path]:
    """Where the conda export may be, in the order to look: the named file relative to the data
    file's folder then envs_dir (as given, then with ".yml"); without a name, `<name>.yml` in
    envs_dir for each of `names` that is not None."""
    candidates: list[Path] = []
    if isinstance(environment, str) and environment:
        given = record_path(environment, where, "environment", allow_abs)
        for folder in (base_dir, envs_dir):
            if folder is not None and not given.is_absolute():
                candidates += [folder / given, folder / f"{environment}.yml"]
        if given.is_absolute():  # allowed explicitly
            candidates.append(given)
    elif environment is not None:
        raise where.error("expected a mapping or a file name", "environment")
    elif envs_dir is not None:
        candidates += [envs_dir / f"{name}.yml" for name in names if name]
    return candidates
