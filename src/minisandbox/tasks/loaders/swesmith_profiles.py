"""SWE-smith's repository profiles as recipes, for records that bring no environment.

SWE-smith keeps, per repository at one commit, a profile (`swesmith.profiles`): the Python
version, the install commands, the test command and the log parser. Its images hold a conda
environment exported after that install; without such an export, the environment here is a
bare venv of the profile's Python, and the install commands run in the repository layer with
their pip installs resolved as of the commit's date (`Task.install_as_of`, envs.asof), which
the layer's metadata records with everything installed.

The `swesmith` package is optional (the `swesmith` extra); it is imported once, on the first
record that needs a profile.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import re
from typing import Any

from pydantic import BaseModel

from minisandbox.envs.recipe import EnvRecipe
from minisandbox.tasks.loaders.errors import MissingDependencyError

# SWE-smith's test commands first activate its conda environment: here the venv is active.
_CONDA_ACTIVATION = re.compile(
    r"^\s*(?:source\s+\S*/activate\s*(?:;|&&)\s*)?(?:conda\s+activate\s+\S+\s*(?:;|&&)\s*)?"
)
_MISSING = (
    "SWE-smith records without an `environment` use SWE-smith's repository profiles, which "
    "need the `swesmith` package: install the `swesmith` extra (in a checkout of "
    "swe-minisandbox: pip install -e '.[swesmith]'; or give each record "
    "an `environment`, or put <owner__repo.commit>.yml exports in --envs-dir)"
)


class SwesmithProfile(BaseModel):
    """What a SWE-smith profile says about a repository at its commit."""

    name: str
    """The profile's key, "owner__repo.commit8"."""
    commit: str
    """The full commit the profile's repository is at."""
    python: str
    """The Python version of its environment."""
    install: list[str]
    """Its install commands, in /testbed."""
    test_cmd: str
    """Its test command, without the conda activation."""

    def recipe(self) -> EnvRecipe:
        """A bare venv of the profile's Python: what the repository needs is installed by
        `install`, as of the commit's date."""
        return EnvRecipe(python=self.python)

    def install_commands(self) -> list[str]:
        """The install commands, plus pytest when the test command runs it (SWE-smith's
        images have it in their environment, not in the profile's commands)."""
        extra = ["python -m pip install pytest"] if "pytest" in self.test_cmd else []
        return [*self.install, *extra]


def without_activation(test_cmd: str) -> str:
    """SWE-smith's test command without its leading `source .../activate; conda activate X;`."""
    return _CONDA_ACTIVATION.sub("", test_cmd, count=1).strip()


@functools.cache
def _registry() -> Any:
    """SWE-smith's profile registry (imported once; swesmith prints as it imports).

    Raises:
        MissingDependencyError: swesmith, or a package its profiles import, is missing.
    """
    environ = dict(os.environ)
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            from swesmith.profiles import registry
    except ImportError as e:
        raise MissingDependencyError(f"{_MISSING} ({e})") from None
    finally:
        # swesmith loads a .env file it finds above it into os.environ: our builds pass UV_*,
        # PIP_* and proxy variables on, so nothing may change them behind our back. It also
        # sets up logging (every INFO line on stderr, `--quiet` or not): the caller's stays.
        os.environ.clear()
        os.environ.update(environ)
        root.handlers[:] = handlers
        root.setLevel(level)
    return registry


def _base_test_cmd(profile: Any) -> Any:
    """The get_test_cmd of SWE-smith's base profile class (the profile's own, if it is that)."""
    for cls in type(profile).__mro__:
        if cls.__name__ == "RepoProfile":
            return getattr(cls, "get_test_cmd", None)
    return getattr(type(profile), "get_test_cmd", None)


def swesmith_profile(name: str) -> SwesmithProfile:
    """The Python profile `name` ("owner__repo.commit8").

    Raises:
        MissingDependencyError: the `swesmith` package is not installed.
        LookupError: SWE-smith has no such profile, or not a Python one (the message says).
    """
    registry = _registry()
    try:
        profile = registry.get(name)
    except KeyError:
        raise LookupError(
            f"SWE-smith has no profile {name!r}: check the record's repo, or give the record "
            "an `environment`"
        ) from None
    except Exception as e:  # a profile whose class fails to construct
        raise LookupError(f"SWE-smith's profile {name!r} cannot be read: {e}") from None
    python = getattr(profile, "python_version", None)
    if python is None:
        raise LookupError(
            f"SWE-smith's profile {name!r} is a {type(profile).__name__}, not a Python one: "
            "only Python repositories run here"
        )
    if type(profile).get_test_cmd is not _base_test_cmd(profile):
        raise LookupError(
            f"SWE-smith's profile {name!r} makes each instance's test command itself (its "
            "get_test_cmd): give the record a `test_cmd`, and an `environment`"
        )
    return SwesmithProfile(
        name=name,
        commit=profile.commit,
        python=str(python),
        install=list(getattr(profile, "install_cmds", [])),
        test_cmd=without_activation(profile.test_cmd),
    )
