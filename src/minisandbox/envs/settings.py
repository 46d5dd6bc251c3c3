"""Where a builder keeps its store, node cache, logs and repositories."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, Field, field_validator

from minisandbox.sandbox.config import GiB

DEFAULT_IO_BUDGET = 2 * GiB


def default_home() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "minisandbox"


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() not in ("", "0", "false", "no")


class BuildSettings(BaseModel):
    """Where things live. Each location also reads an environment variable, so a cluster or an
    integration can set it once."""

    store: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("MINISANDBOX_STORE") or default_home() / "store"
        ),
        validate_default=True,  # $MINISANDBOX_STORE may be relative too
    )
    """The layer store ($MINISANDBOX_STORE): published layers, shareable between machines."""
    cache: Path = Field(
        default_factory=lambda: Path(
            os.environ.get("MINISANDBOX_CACHE") or default_home() / "layers"
        ),
        validate_default=True,
    )
    """This node's cache of unpacked layers ($MINISANDBOX_CACHE)."""
    git_mirror: Path | None = Field(
        default_factory=lambda: (
            Path(os.environ["MINISANDBOX_GIT_MIRROR"])
            if os.environ.get("MINISANDBOX_GIT_MIRROR")
            else None
        ),
        validate_default=True,
    )
    """A directory of local clones named `<owner>__<name>` ($MINISANDBOX_GIT_MIRROR); when set,
    repositories come only from there."""
    git_url_template: str = "https://github.com/{repo}.git"
    """Where repositories are cloned from when there is no mirror."""
    cache_max_bytes: int = 100 * GiB
    """The node cache's size cap."""
    require_validated: bool = Field(
        default_factory=lambda: _env_flag("MINISANDBOX_REQUIRE_VALIDATED")
    )
    """Agents' sandboxes (the integrations, `minisandbox shell --task`, `agent_sandbox`) refuse a
    task without a passing validation (`minisandbox build --validate`;
    $MINISANDBOX_REQUIRE_VALIDATED)."""

    @field_validator("store", "cache", "git_mirror")
    @classmethod
    def _absolute(cls, v: Path | None) -> Path | None:
        # Relative to the directory the settings were made in, not to wherever a step runs.
        return None if v is None else v.expanduser().absolute()

    @property
    def logs(self) -> Path:
        """The logs: `<store's parent>/logs` for a store named `store` (the default,
        `~/.cache/minisandbox/logs`), else `<store>/logs`. Build steps' logs go to
        `<logs>/<what is built>/`, `minisandbox eval`'s to
        `<logs>/run_evaluation/<run id>/<model>/<instance id>/` (the harness's layout); nothing
        goes to the current directory."""
        return self.store.parent / "logs" if self.store.name == "store" else self.store / "logs"
