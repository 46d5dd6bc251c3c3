"""How to build a Python environment: an interpreter version, pinned requirements, options.

A recipe is shared between tasks: its `key` (with the interpreter actually used) names the
environment layer, so tasks with the same recipe share one layer. A recipe may leave part of
itself to its repository (`from_repository`: a requirements file there, or everything inferred
from it); the builder resolves that at the environment commit first (tasks.repo_recipes), and
only a resolved recipe has a key.
"""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisandbox.envs.asof import as_of_date
from minisandbox.utils.hashing import content_digest

# Bump when the meaning of a recipe field changes, so that old environment layers stop matching.
_KEY_FORMAT = 1
_PYTHON_VERSION = re.compile(r"\d+\.\d+(\.\d+)?")
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
_PACKAGE_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


def one_line(value: str) -> str:
    """Collapse runs of whitespace so that cosmetic differences do not split layers."""
    return " ".join(value.split())


def minor_version(version: str) -> str:
    """'3.9.18' -> '3.9'."""
    return ".".join(version.split(".")[:2])


class FromRepository(BaseModel):
    """What a recipe takes from its repository at the environment commit."""

    model_config = ConfigDict(extra="forbid")

    requirements_files: list[str] = Field(
        default_factory=list,
        description="requirements files, in order: the first one present is installed (its "
        "`-r` includes followed within the repository), before the recipe's own requirements",
    )
    environment_files: list[str] = Field(
        default_factory=list,
        description="conda environment files, in order: the first one present gives its pip "
        "section and its conda packages (as pip requirements)",
    )
    infer: bool = Field(
        default=False,
        description="infer the Python version and the requirements from the repository "
        "(setup.py, setup.cfg, pyproject.toml, requirements files, tox.ini, CI files)",
    )
    runner: list[str] = Field(
        default_factory=list,
        description="what the task's test command needs of its runner (`pytest>=4.5` for "
        "`-rA`): it replaces a repository line of the same package that does not allow it, "
        "and is resolved no earlier than its release (tasks.repo_recipes.RUNNER_RELEASES)",
    )


class EnvRecipe(BaseModel):
    """How to build a task's Python environment: a venv of `python` with `requirements`."""

    model_config = ConfigDict(extra="forbid")

    python: str | None = Field(
        description='requested Python version: "3.9" or "3.9.18"; None only with '
        "from_repository.infer (the repository says)"
    )
    requirements: list[str] = Field(
        default_factory=list, description='pinned pip requirement lines, e.g. "numpy==1.26.4"'
    )
    pip_options: list[str] = Field(
        default_factory=list, description='extra pip options, e.g. "--no-build-isolation"'
    )
    env: dict[str, str] = Field(
        default_factory=dict, description="variables set during the build and in sandboxes"
    )
    skipped: list[str] = Field(
        default_factory=list,
        description="what a conversion dropped, for the record; not part of the key",
    )
    as_of: str | None = Field(
        default=None,
        description="resolve the requirements as of this UTC time (uv --exclude-newer): "
        "what was current then, for requirements that do not pin",
    )
    as_of_packages: dict[str, str] = Field(
        default_factory=dict,
        description="packages resolved as of a later time than `as_of` (name -> time): the "
        "test runner a task's command needs, and what it depends on",
    )
    from_repository: FromRepository | None = Field(
        default=None, description="what to read from the repository before building"
    )
    inferred: dict[str, str] = Field(
        default_factory=dict,
        description="what resolving `from_repository` decided, and from which file; "
        "for the record, not part of the key",
    )
    relax_pins: bool = Field(
        default=False,
        description="when the pins do not install together, relax them one at a time (relax.py) "
        "instead of failing: set for conda exports, whose pins were never resolved as one set",
    )

    @field_validator("python")
    @classmethod
    def _check_python(cls, value: str | None) -> str | None:
        if value is None:
            return None
        value = value.strip()
        if not _PYTHON_VERSION.fullmatch(value):
            raise ValueError(f'{value!r} is not a Python version like "3.9" or "3.9.18"')
        return value

    @field_validator("as_of")
    @classmethod
    def _check_as_of(cls, value: str | None) -> str | None:
        return None if value is None else as_of_date(value)

    @field_validator("as_of_packages")
    @classmethod
    def _check_as_of_packages(cls, value: dict[str, str]) -> dict[str, str]:
        for name in value:
            if not _PACKAGE_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a package name")
        return {name: as_of_date(when) for name, when in sorted(value.items())}

    @field_validator("requirements", "pip_options")
    @classmethod
    def _check_lines(cls, lines: list[str]) -> list[str]:
        out = []
        for line in lines:
            if "\n" in line.strip() or not line.strip():
                raise ValueError(f"{line!r}: one non-empty requirement or option per entry")
            out.append(one_line(line))
        return out

    @field_validator("env")
    @classmethod
    def _check_env(cls, env: dict[str, str]) -> dict[str, str]:
        for name in env:
            if not _ENV_NAME.fullmatch(name):
                raise ValueError(f"{name!r} is not a valid environment variable name")
        return env

    @model_validator(mode="after")
    def _python_or_inferred(self) -> EnvRecipe:
        if self.python is None and not (self.from_repository and self.from_repository.infer):
            raise ValueError("a recipe needs `python` unless from_repository.infer is set")
        return self

    @property
    def resolved(self) -> bool:
        """Whether nothing is left to read from the repository (only then is there a key)."""
        return self.from_repository is None and self.python is not None

    def key(self, interpreter_version: str) -> str:
        """sha256 hex of everything that determines the environment layer.

        `interpreter_version` is the version of the interpreter actually used ("3.9.18"), so a
        layer is never reused across patch releases. Requirement order is kept: pip's resolution
        can depend on it. `skipped` and `inferred` are documentation only and stay out.

        Raises:
            ValueError: the recipe is not resolved, or the interpreter is another version.
        """
        if self.python is None or self.from_repository is not None:
            raise ValueError("resolve the recipe's from_repository first (tasks.repo_recipes)")
        if minor_version(interpreter_version) != minor_version(self.python):
            raise ValueError(
                f"interpreter {interpreter_version} does not provide the requested "
                f"Python {self.python}"
            )
        canonical = {
            "format": _KEY_FORMAT,
            "python": interpreter_version.strip(),
            "requirements": [one_line(r) for r in self.requirements],
            "pip_options": [one_line(o) for o in self.pip_options],
            "env": dict(sorted(self.env.items())),
        }
        if self.relax_pins:  # (absent when off: the keys of earlier recipes stay as they were)
            canonical["relax_pins"] = True
        if self.as_of:  # (likewise)
            canonical["as_of"] = self.as_of
        if self.as_of_packages:  # (likewise)
            canonical["as_of_packages"] = dict(self.as_of_packages)
        return content_digest(canonical)
