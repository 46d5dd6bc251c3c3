"""SWE-bench install specs: swebench 4.1.0's MAP_REPO_VERSION_TO_SPECS (its Python repositories),
per repository and version, turned into what a task needs when its record carries less.

The table ships with this package as data (`data/swebench_specs.json`, written from swebench
4.1.0 by scripts/swebench_specs.py; swebench 5.x dropped it), so a recipe does not depend on
which swebench is installed. From a spec come: a recipe when there is no conda export, the
`pre_install` and `install` commands, the variables its `eval_commands` export, and a test
command when the record has no eval script.

The recipe is what the harness's image had: the spec's Python; its conda `packages` as pip
requirements, or the repository's requirements file or conda environment file when `packages`
names one (read at the environment commit by the builder, `from_repository`); its
`pip_packages`; the pip, setuptools and wheel of the harness's conda environments (HARNESS_SEED:
a pip from 2026 no longer falls back to `setup.py develop`, a setuptools from 2026 has no
`pkg_resources`); and what does not pin resolved as of when the harness built its images
(HARNESS_AS_OF), not today. Invariant: commands that change the host system (package
managers, locales, writes under /etc) are never kept, only noted in the recipe's `skipped`.
"""

from __future__ import annotations

import functools
import json
import re
import shlex
from typing import Any

from pydantic import ValidationError

from minisandbox.envs.recipe import EnvRecipe, FromRepository, minor_version
from minisandbox.tasks.loaders.conda_exports import (
    CONDA_TO_PYPI,
    REQ_NAME,
    conda_only_packages,
    requirement_name,
)
from minisandbox.tasks.loaders.fields import Where, as_list
from minisandbox.tasks.specs import files_in_patch
from minisandbox.utils.resources import package_text

# pip, setuptools and wheel in the harness's conda environments, by Python version: the most
# common versions in the 500 SWE-bench Verified environment exports (swebench 4.1.0's), which
# conda picked as the newest for each Python when the images were built. Pythons the exports
# do not show get the newest line's (3.8 and later).
HARNESS_SEED: dict[str, tuple[str, str, str]] = {
    "3.5": ("10.0.1", "40.2.0", "0.37.1"),
    "3.6": ("21.2.2", "58.0.4", "0.37.1"),
    "3.7": ("22.3.1", "65.6.3", "0.38.4"),
}
_NEWEST_SEED = ("24.2", "75.1.0", "0.44.0")
# When the harness's images were built, near enough: the newest pip and setuptools in those
# exports (pip 24.2, 24.3.1 once; setuptools 75.1.0) were the newest on PyPI in October 2024.
HARNESS_AS_OF = "2024-11-01T00:00:00Z"

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
def _shipped() -> dict[str, Any]:
    data: dict[str, Any] = json.loads(
        package_text("minisandbox.tasks.loaders", "data", "swebench_specs.json")
    )
    return data


def swebench_specs_table() -> dict[str, dict[str, dict[str, Any]]]:
    """swebench 4.1.0's MAP_REPO_VERSION_TO_SPECS_PY: repository → version → spec."""
    specs: dict[str, dict[str, dict[str, Any]]] = _shipped()["specs"]
    return specs


def requirements_paths(repo: str) -> list[str]:
    """Where `repo` keeps the requirements file its specs' `packages: requirements.txt` means,
    in the order swebench tries them (MAP_REPO_TO_REQS_PATHS); empty when swebench names none."""
    return list(_shipped()["reqs_paths"].get(repo, []))


def environment_yml_paths(repo: str) -> list[str]:
    """Where `repo` keeps the conda environment file of `packages: environment.yml`
    (MAP_REPO_TO_ENV_YML_PATHS)."""
    return list(_shipped()["env_yml_paths"].get(repo, []))


def swebench_spec(repo: str, version: str | None) -> dict[str, Any] | None:
    """A copy of swebench's spec for `repo` at `version`; None when it has none."""
    if version is None:
        return None
    spec = swebench_specs_table().get(repo, {}).get(version)
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


def harness_seed(python: str) -> list[str]:
    """The pip, setuptools and wheel pins of the harness's environment for Python `python`."""
    pip, setuptools, wheel = HARNESS_SEED.get(minor_version(python), _NEWEST_SEED)
    return [f"pip=={pip}", f"setuptools=={setuptools}", f"wheel=={wheel}"]


def recipe_from_spec(spec: dict[str, Any], repo: str, where: Where) -> EnvRecipe:
    """The recipe of the harness's image for a swebench spec of `repo` (see the module's
    docstring); a requirements or environment file it names is left to the builder
    (`from_repository`), to read at the environment commit.

    Raises:
        TaskFormatError: the spec has no Python or gives values a recipe refuses.
    """
    skipped: list[str] = []
    packages = spec.get("packages") or ""
    conda_reqs: list[str] = []
    from_repository = None
    if packages in ("requirements.txt", "environment.yml"):
        paths = requirements_paths(repo) if packages == "requirements.txt" else []
        yml = environment_yml_paths(repo) if packages == "environment.yml" else []
        if paths or yml:
            from_repository = FromRepository(requirements_files=paths, environment_files=yml)
        else:
            skipped.append(f"packages: the repository's {packages} (swebench names no path)")
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
        python = str(spec["python"])
        given = [*conda_reqs, *pip_packages]
        names = {requirement_name(r) for r in given}
        seed = [r for r in harness_seed(python) if requirement_name(r) not in names]
        return EnvRecipe(
            python=python,
            requirements=[*given, *seed],
            skipped=skipped,
            as_of=HARNESS_AS_OF,
            from_repository=from_repository,
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
