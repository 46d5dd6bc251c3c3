"""Conda environment exports (`conda env export`) turned into pip recipes (`EnvRecipe`).

The `envs/` directory of a SWE-bench dataset holds one export per instance (`<instance_id>.yml`,
the exact environments swebench 4.1 built); SWE-smith records and our task files may name one.

Invariants: the recipe's Python is the export's `python=X.Y.Z`; every conda pin becomes
`name==version` under its PyPI name (`CONDA_TO_PYPI`) or is listed in `skipped` with the reason
(conda-only, not a pip version, a conflicting duplicate, overridden by the `pip:` list); the
`pip:` list is kept as is, in order, after the conda pins; `relax_pins` is set, since the pins
of an export were never resolved as one pip requirement set.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.envs.relax import normalise
from minisandbox.tasks.loaders.fields import Where
from minisandbox.tasks.loaders.formats import yaml_load

# Conda package names whose PyPI distribution is named differently. Conda splits and
# metapackages ("matplotlib-base", "numpy-base") map to the distribution that holds their code;
# duplicate pins that result are merged.
CONDA_TO_PYPI: dict[str, str] = {
    "antlr-python-runtime": "antlr4-python3-runtime",
    "brotli-python": "brotli",
    "iris": "scitools-iris",
    "matplotlib-base": "matplotlib",
    "msgpack-python": "msgpack",
    "nbconvert-core": "nbconvert",
    "numpy-base": "numpy",
    "pyarrow-core": "pyarrow",
    "pyqt": "pyqt5",
    "pytables": "tables",
    "python-eccodes": "eccodes",
    "python-fastjsonschema": "fastjsonschema",
    "python-tzdata": "tzdata",
    "python-xxhash": "xxhash",
    "pytorch": "torch",
    "seaborn-base": "seaborn",
}

# A permissive PEP 440 version: conda versions outside it ("2024b", "9e") cannot be pip pins.
_PEP440 = re.compile(
    r"^(\d+!)?\d+(\.\d+)*((a|b|rc)\d*)?(\.?post\d*)?(\.?dev\d*)?(\+[a-z0-9]+(\.[a-z0-9]+)*)?$",
    re.IGNORECASE,
)
# The distribution name at the start of a requirement line.
REQ_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@functools.cache
def conda_only_packages() -> frozenset[str]:
    """Conda package names that are not pip-installable (data/conda_only_packages.txt).

    Raises nothing of its own: the file is part of the package.
    """
    text = (resources.files("minisandbox") / "data" / "conda_only_packages.txt").read_text(
        encoding="utf-8"
    )
    names = (line.split("#", 1)[0].strip().lower() for line in text.splitlines())
    return frozenset(name for name in names if name)


def requirement_name(line: str) -> str | None:
    """The normalised distribution name a requirement line starts with, if any."""
    m = REQ_NAME.match(line)
    return normalise(m.group(1)) if m else None


@dataclass
class _Dependencies:
    """An export's `dependencies` list, sorted out entry by entry."""

    python: str | None = None
    pins: dict[str, str] = field(default_factory=dict)  # normalised name -> requirement
    versions: dict[str, str] = field(default_factory=dict)  # normalised name -> conda version
    skipped: list[str] = field(default_factory=list)
    pip_lines: list[str] = field(default_factory=list)

    def add(self, dep: Any, where: Where, conda_only: frozenset[str]) -> None:
        """Take one entry: a `pip:` sub-list, or a conda `[channel::]name=version=build`.

        Raises:
            TaskFormatError: the entry is neither.
        """
        if isinstance(dep, dict) and set(dep) == {"pip"}:
            self.pip_lines += [str(x) for x in dep["pip"] or []]
            return
        if not isinstance(dep, str):
            raise where.error(f"unexpected entry {dep!r}", "dependencies")
        spec = dep.split("::", 1)[-1].strip()  # drop a "channel::" prefix
        name, _, rest = spec.partition("=")
        name = name.strip().lower()
        version = rest.split("=", 1)[0].strip()
        if name == "python":
            self.python = version
        elif name in conda_only:
            self.skipped.append(f"{dep}: conda-only")
        elif version and not _PEP440.match(version.replace("*", "0")):
            self.skipped.append(f"{dep}: version is not a pip version")
        else:
            self._pin(dep, CONDA_TO_PYPI.get(name, name), version)

    def _pin(self, dep: str, pypi: str, version: str) -> None:
        key = normalise(pypi)
        if key in self.pins:  # a split or alias of a package already pinned ("matplotlib-base")
            if self.versions[key] != version:
                self.skipped.append(f"{dep}: conflicts with {self.pins[key]}")
            return
        self.pins[key] = f"{pypi}=={version}" if version else pypi
        self.versions[key] = version


def conda_env_to_recipe(path: str | Path) -> EnvRecipe:
    """Turn a conda environment export (`conda env export`) into a pip recipe.

    - the Python version comes from the `python=X.Y.Z` dependency;
    - `name=version=build` becomes `name==version`, after renaming by CONDA_TO_PYPI; names in
      data/conda_only_packages.txt and versions pip cannot read are dropped into `skipped`;
    - the `pip:` sub-list is kept as is and wins over a conda pin of the same package;
      entries starting with "-" become pip options;
    - the export's `variables:` become `env`.

    Raises:
        MissingDependencyError: PyYAML is not installed.
        TaskFormatError: the file is not YAML, not an export with a `dependencies` list, has
            no python dependency, or gives values the recipe refuses (naming the file and field).
    """
    path = Path(path)
    where = Where(str(path))
    data = yaml_load(path)
    if not isinstance(data, dict) or not isinstance(data.get("dependencies"), list):
        raise where.error("expected a conda export with a 'dependencies' list", "dependencies")
    deps = _Dependencies()
    conda_only = conda_only_packages()
    for dep in data["dependencies"]:
        deps.add(dep, where, conda_only)
    if not deps.python:
        raise where.error("no python=X.Y.Z dependency", "dependencies")
    options = [line for line in deps.pip_lines if line.startswith("-")]
    pip_reqs = [line for line in deps.pip_lines if not line.startswith("-")]
    for line in pip_reqs:
        key = requirement_name(line)
        if key is not None and key in deps.pins:
            deps.skipped.append(f"conda {deps.pins.pop(key)}: overridden by pip {line}")
    variables = data.get("variables") or {}
    if not isinstance(variables, dict):
        raise where.error("expected a mapping", "variables")
    try:
        return EnvRecipe(
            python=deps.python.rstrip(".*"),
            requirements=[*deps.pins.values(), *pip_reqs],
            pip_options=options,
            env={str(k): str(v) for k, v in variables.items()},
            skipped=deps.skipped,
            relax_pins=True,
        )
    except ValidationError as exc:
        raise where.from_validation(exc) from None
