"""SWE-bench install specs: swebench 4.x's MAP_REPO_VERSION_TO_SPECS, per repository and
version, turned into what a task needs when its record carries less.

Used only when swebench 4.x is importable (5.x dropped the table; a broken install counts as
absent). From a spec come: a minimal recipe when there is no conda export (its `python`, its
conda `packages` when they are a list, its `pip_packages`), the `pre_install` and `install`
commands, the variables its `eval_commands` export, and a test command when the record has no
eval script. Invariant: commands that change the host system (package managers, locales,
writes under /etc) are never kept, only noted in the recipe's `skipped`.
"""

from __future__ import annotations

import functools
import importlib
import logging
import re
import shlex
from typing import Any

from pydantic import ValidationError

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.loaders.conda_exports import (
    CONDA_TO_PYPI,
    REQ_NAME,
    conda_only_packages,
    requirement_name,
)
from minisandbox.tasks.loaders.fields import Where, as_list
from minisandbox.tasks.specs import files_in_patch

log = logging.getLogger(__name__)

# Commands that change the host system (packages, locales): a sandboxed build cannot run them.
_SYSTEM_COMMAND = re.compile(r"^\s*(sudo\s+)?(apt-get|apt|yum|dnf|apk|locale-gen)\b|/etc/")
# Files in a test patch that are data, not test modules to pass to a runner (swebench's list).
_NON_TEST_SUFFIXES = (
    ".json",
    ".png",
    ".csv",
    ".txt",
    ".md",
    ".jpg",
    ".jpeg",
    ".pkl",
    ".yml",
    ".yaml",
    ".toml",
)


@functools.cache
def swebench_specs_table() -> dict[str, Any] | None:
    """swebench 4.x's MAP_REPO_VERSION_TO_SPECS, when swebench is installed (5.x dropped it)."""
    try:
        # imported by name: swebench ships no type stubs
        table = importlib.import_module("swebench.harness.constants").MAP_REPO_VERSION_TO_SPECS
    except Exception as exc:  # a broken install (missing deps) counts as absent
        log.debug("swebench spec table unavailable: %s", exc)
        return None
    return dict(table)


def swebench_spec(repo: str, version: str | None) -> dict[str, Any] | None:
    """A copy of swebench's spec for `repo` at `version`; None without swebench or a spec."""
    specs = swebench_specs_table()
    if specs is None or version is None:
        return None
    spec = specs.get(repo, {}).get(version)
    return dict(spec) if isinstance(spec, dict) else None


def sandboxable(commands: list[str], skipped: list[str], what: str) -> list[str]:
    """`commands` without those that change the host system, which are noted in `skipped`
    as "<what>: <command>"."""
    kept = []
    for cmd in commands:
        if _SYSTEM_COMMAND.search(cmd):
            skipped.append(f"{what}: {cmd}")
        else:
            kept.append(cmd)
    return kept


def recipe_from_spec(spec: dict[str, Any], where: Where) -> EnvRecipe:
    """A minimal recipe from a swebench spec: its Python, its conda `packages` when they are a
    list, and its pip_packages. Requirement files it points at are not resolved here.

    Raises:
        TaskFormatError: the spec has no Python or gives values a recipe refuses.
    """
    skipped: list[str] = []
    packages = spec.get("packages") or ""
    conda_reqs: list[str] = []
    if packages in ("requirements.txt", "environment.yml"):
        skipped.append(f"packages: the repository's {packages} (not resolved)")
    elif isinstance(packages, str):
        for item in shlex.split(packages):
            name = REQ_NAME.match(item)
            if name and name.group(1).lower() in conda_only_packages():
                skipped.append(f"packages: {item}: conda-only")
                continue
            conda_reqs.append(_conda_match_to_pip(item))
    pip_packages = as_list(spec.get("pip_packages"))
    pip_names = {requirement_name(p) for p in pip_packages}
    conda_reqs = [r for r in conda_reqs if requirement_name(r) not in pip_names]
    try:
        return EnvRecipe(
            python=str(spec["python"]),
            requirements=[*conda_reqs, *pip_packages],
            skipped=skipped,
        )
    except (KeyError, ValidationError) as exc:
        raise where.error(f"unusable swebench spec: {exc}", "env") from None


def _conda_match_to_pip(item: str) -> str:
    """Conda's "name=1.2" means 1.2.*; pip spells it "name==1.2.*"."""
    m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)=([^=<>!~]+)$", item)
    if not m:
        return item
    name, version = m.groups()
    name = CONDA_TO_PYPI.get(name.lower(), name)
    return f"{name}=={version}" if version.endswith("*") else f"{name}=={version}.*"


def spec_test_cmd(spec: dict[str, Any], repo: str, test_patch: str) -> str:
    """swebench's test command plus the test files of the test patch as arguments (Django's
    runner takes dotted module names relative to tests/)."""
    directives = [
        f for f in files_in_patch(test_patch) if not f.lower().endswith(_NON_TEST_SUFFIXES)
    ]
    if repo == "django/django":
        directives = [
            f.removesuffix(".py").removeprefix("tests/").replace("/", ".") for f in directives
        ]
    commands = as_list(spec["test_cmd"])
    args = " ".join(shlex.quote(d) for d in directives)
    return "\n".join(f"{cmd} {args}".strip() for cmd in commands)
