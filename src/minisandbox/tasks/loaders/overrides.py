"""Recipe overrides: fixes to the recipes of one repository (at some versions) that the
datasets' environments need here (data/recipe_overrides.yaml, docs/recipes.md).

An override may add test services, pin or drop requirements and set variables. The SWE-bench
loader applies every matching override, in file order, last. Invariants: what an override
changed is noted in the recipe's `skipped` (documentation, not part of the environment key);
a version spec is checked when the file is read, so matching never fails on the bundled file.
"""

from __future__ import annotations

import functools
import operator
import re
from collections.abc import Callable, Iterable, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.relax import normalise
from minisandbox.tasks.loaders.conda_exports import requirement_name
from minisandbox.tasks.loaders.errors import TaskFormatError, VersionSpecError
from minisandbox.tasks.loaders.fields import Where
from minisandbox.tasks.loaders.formats import yaml_load, yaml_module


class RecipeOverride(BaseModel):
    """One entry of data/recipe_overrides.yaml (docs/recipes.md)."""

    model_config = ConfigDict(extra="forbid")

    repo: str
    version: str | None = None  # "2.0", or comparisons joined by commas: ">=1.0,<2.9"
    services: list[str] = []
    pins: dict[str, str] = {}
    drop: list[str] = []
    env: dict[str, str] = {}
    note: str = ""

    def matches(self, repo: str, version: str | None) -> bool:
        """Whether this override applies to `repo` at dataset version `version`.

        Raises:
            VersionSpecError: this override's `version` is not a valid spec.
        """
        if repo != self.repo:
            return False
        if self.version is None:
            return True
        return version is not None and version_matches(version, self.version)


_VERSION_CLAUSE = re.compile(r"^\s*(==|!=|<=|>=|<|>)?\s*(\d+(?:\.\d+)*)\s*$")
_COMPARE: dict[str, Callable[[tuple[int, ...], tuple[int, ...]], bool]] = {
    "==": operator.eq,
    "!=": operator.ne,
    "<": operator.lt,
    "<=": operator.le,
    ">": operator.gt,
    ">=": operator.ge,
}


def _numbers(dotted: str) -> tuple[int, ...]:
    """ "2.3.0" -> (2, 3): trailing zeros dropped, so 2.0 == 2."""
    parts = [int(p) for p in dotted.split(".")]
    while len(parts) > 1 and parts[-1] == 0:
        parts.pop()
    return tuple(parts)


def _version_tuple(version: str) -> tuple[int, ...] | None:
    m = re.match(r"^\s*(\d+(?:\.\d+)*)", version)
    return _numbers(m.group(1)) if m else None


def version_matches(version: str, spec: str) -> bool:
    """Whether a dataset version ("2.3") satisfies `spec`: "2.3", or clauses like ">=1.0,<2.9"
    that must all hold. Versions compare numerically, part by part.

    Raises:
        VersionSpecError: a clause of `spec` is not a comparison like '<2.9' (checked only
            when `version` is a version: a version that is not one matches nothing).
    """
    have = _version_tuple(version)
    if have is None:
        return False
    for clause in spec.split(","):
        m = _VERSION_CLAUSE.match(clause)
        if not m:
            raise VersionSpecError(f"{spec!r}: {clause!r} is not a version comparison like '<2.9'")
        if not _COMPARE[m.group(1) or "=="](have, _numbers(m.group(2))):
            return False
    return True


def load_recipe_overrides(path: str | Path) -> tuple[RecipeOverride, ...]:
    """Read and check an overrides file (a mapping with an `overrides` list).

    Raises:
        MissingDependencyError: PyYAML is not installed.
        TaskFormatError: the file is not YAML, or an entry is malformed (naming it and the
            field).
    """
    path = Path(path)
    return _parse_overrides(yaml_load(path), str(path))


@functools.cache
def recipe_overrides() -> tuple[RecipeOverride, ...]:
    """The bundled overrides (data/recipe_overrides.yaml).

    Raises:
        MissingDependencyError: PyYAML is not installed.
        TaskFormatError: the bundled file is malformed.
    """
    text = (resources.files("minisandbox") / "data" / "recipe_overrides.yaml").read_text(
        encoding="utf-8"
    )
    yaml = yaml_module()
    return _parse_overrides(yaml.safe_load(text), "data/recipe_overrides.yaml")


def _parse_overrides(data: Any, name: str) -> tuple[RecipeOverride, ...]:
    if not isinstance(data, dict) or set(data) != {"overrides"}:
        raise TaskFormatError(f"{name}: expected a mapping with only an 'overrides' list")
    entries = data["overrides"] or []
    if not isinstance(entries, list):
        raise TaskFormatError(f"{name}: field 'overrides': expected a list", field="overrides")
    out = []
    for index, entry in enumerate(entries):
        where = Where(name, index)
        try:
            override = RecipeOverride.model_validate(entry)
            if override.version is not None:
                version_matches("0", override.version)  # a malformed spec fails here
        except ValidationError as exc:
            raise where.from_validation(exc) from None
        except VersionSpecError as exc:
            raise where.error(str(exc), "version") from None
        out.append(override)
    return tuple(out)


def _apply_pin(requirements: list[str], requirement: str, label: str, notes: list[str]) -> None:
    """Replace the first pin of `requirement`'s distribution by it (dropping any later ones),
    or add it; note what changed."""
    key = requirement_name(requirement)
    at = [i for i, r in enumerate(requirements) if requirement_name(r) == key]
    if at:
        notes.append(f"{label}: {requirements[at[0]]} -> {requirement}")
        requirements[at[0]] = requirement
        requirements[:] = [r for i, r in enumerate(requirements) if i not in at[1:]]
    else:
        notes.append(f"{label}: added {requirement}")
        requirements.append(requirement)


def apply_recipe_overrides(
    repo: str,
    version: str | None,
    recipe: EnvRecipe,
    overrides: Iterable[RecipeOverride],
    services: Sequence[str] = (),
) -> tuple[EnvRecipe, list[str]]:
    """The recipe and service list with every matching override applied, in order. What an
    override changed is noted in the recipe's `skipped` (documentation, not part of its key).

    Raises:
        TaskFormatError: an override pins a requirement under another distribution's name,
            or the recipe it makes is not valid (e.g. a bad variable name).
        VersionSpecError: an override's `version` is not a valid spec.
    """
    requirements = list(recipe.requirements)
    env = dict(recipe.env)
    notes = list(recipe.skipped)
    out_services = list(services)
    for o in overrides:
        if not o.matches(repo, version):
            continue
        label = f"override ({o.repo}{' ' + o.version if o.version else ''})"
        for name in o.drop:
            key = normalise(name)
            notes += [f"{label}: dropped {r}" for r in requirements if requirement_name(r) == key]
            requirements = [r for r in requirements if requirement_name(r) != key]
        for name, requirement in o.pins.items():
            if requirement_name(requirement) != normalise(name):
                raise TaskFormatError(f"{label}: pin {name!r} is {requirement!r}, another name")
            _apply_pin(requirements, requirement, label, notes)
        env.update(o.env)
        out_services += [s for s in o.services if s not in out_services]
        if o.services:
            notes.append(f"{label}: services {', '.join(o.services)}")
    recipe = recipe.model_copy(update={"requirements": requirements, "env": env, "skipped": notes})
    try:
        return EnvRecipe.model_validate(recipe.model_dump()), out_services
    except ValidationError as exc:
        raise TaskFormatError(
            f"recipe overrides for {repo} {version or '(no version)'} make an invalid recipe: {exc}"
        ) from None
