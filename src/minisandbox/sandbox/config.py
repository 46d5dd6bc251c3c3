"""Pydantic models that describe a sandbox: what it sees, what it may use."""

from __future__ import annotations

import os
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from minisandbox.errors import SandboxConfigError
from minisandbox.sandbox.egress import EgressPolicy

GiB = 1024**3
MiB = 1024**2

# Host uid that a root caller's sandbox runs as. The sandbox's uid 0 is never the host's root:
# a root-owned sandbox process could otherwise rewrite host kernel settings under /proc/sys.
DEFAULT_ROOT_MAPPED_UID = 1_500_000_000


class Limits(BaseModel):
    """Resource limits. rlimits always apply (per process, except `processes`, which counts every
    process of the sandbox). `upper_bytes` and `upper_inodes` are enforced by a watchdog that
    scans the upper layer (at most a second apart) and stops the sandbox when one is exceeded;
    a single file is capped at `upper_bytes` too (RLIMIT_FSIZE), so that it cannot outgrow the
    layer between two scans. `total_memory_bytes` caps the whole sandbox: in a delegated cgroup
    v2 where there is one (cgroups.py), else by a watchdog on the host (memory.py)."""

    model_config = ConfigDict(extra="forbid")

    memory_bytes: int | None = Field(4 * GiB, description="address space per process (RLIMIT_AS)")
    processes: int | None = Field(1024, description="processes and threads in the sandbox")
    open_files: int = Field(4096, description="open file descriptors per process")
    file_size_bytes: int | None = Field(
        8 * GiB, description="largest file a process may write (at most upper_bytes)"
    )
    cpu_seconds: int | None = Field(None, description="CPU time per process")
    total_memory_bytes: int | None = Field(
        None,
        ge=0,
        description="memory of the whole sandbox: None, a share of the host's (80% of it over "
        "$MINISANDBOX_SLOTS, else the CPU count); 0, no cap. A delegated cgroup v2 enforces "
        "it; else a host watchdog polls every 0.25 s and stops the sandbox past it",
    )
    tmp_bytes: int = Field(1 * GiB, description="size of the private /tmp (tmpfs)")
    shm_bytes: int = Field(256 * MiB, description="size of /dev/shm (tmpfs)")
    upper_bytes: int | None = Field(8 * GiB, description="bytes written to the upper layer")
    upper_inodes: int | None = Field(
        500_000, description="files, directories and links in the upper layer"
    )
    command_timeout: float = Field(600.0, description="default wall clock per command, seconds")


class SandboxConfig(BaseModel):
    """Everything a sandbox is made of.

    The root filesystem is an overlay: `layers` (read-only, lowest first) below one writable upper
    layer. Host system directories (/usr and friends) and `ro_paths` are bound read-only on top, at
    their own paths, so that venvs built on the host keep working inside.
    """

    model_config = ConfigDict(extra="forbid")

    layers: list[Path] = Field(default_factory=list, description="lower layers, lowest first")
    upper: Path | None = Field(None, description="keep the writable layer here")
    ro_paths: list[Path] = Field(default_factory=list, description="host dirs bound read-only")
    network: bool = False
    egress: EgressPolicy | None = Field(
        None,
        description="no network but an HTTP proxy to these hosts (sandbox/egress.py); "
        "excludes `network`",
    )
    hostname: str = "sandbox"
    workdir: str = "/testbed"
    env: dict[str, str] = Field(default_factory=dict)
    venv: str | None = Field(None, description="path of a venv inside the sandbox to put on PATH")
    limits: Limits = Field(default_factory=Limits)
    bwrap: Path | None = Field(None, description="a system bwrap >= 0.11")
    root_mapped_uid: int = Field(
        DEFAULT_ROOT_MAPPED_UID, description="host uid a root caller's sandbox runs as"
    )
    runtime_dir: Path | None = Field(None, description="where temporary upper layers live")

    def sandbox_owner(self) -> tuple[int, int]:
        """The host uid and gid of the sandbox's root: the caller, or for a root caller the
        mapped unprivileged uid."""
        if os.geteuid() == 0:
            return self.root_mapped_uid, self.root_mapped_uid
        return os.geteuid(), os.getegid()

    def layer_owner(self) -> tuple[int, int] | None:
        """Whom to chown files to that the sandbox's root must be able to change (a root
        caller's layers, checkouts); None when the caller's own files already are its root's."""
        return self.sandbox_owner() if os.geteuid() == 0 else None

    @field_validator("layers", "ro_paths")
    @classmethod
    def _absolute_dirs(cls, paths: list[Path]) -> list[Path]:
        out = []
        for p in paths:
            p = Path(os.path.abspath(p))
            if not p.is_dir():
                raise SandboxConfigError(f"{p} is not a directory")
            out.append(p)
        return out

    @field_validator("workdir", "venv")
    @classmethod
    def _absolute_inside(cls, value: str | None) -> str | None:
        if value is not None and not value.startswith("/"):
            raise SandboxConfigError(f"{value!r} must be an absolute path inside the sandbox")
        return value

    @model_validator(mode="after")
    def _egress_without_network(self) -> SandboxConfig:
        if self.egress is not None and self.network:
            raise SandboxConfigError(
                "network=True shares the host's network; egress gives a proxy to a few hosts "
                "instead: set one of them"
            )
        return self

    @field_validator("hostname")
    @classmethod
    def _hostname(cls, value: str) -> str:
        if not value or len(value) > 63 or not all(c.isalnum() or c in "-." for c in value):
            raise SandboxConfigError(f"{value!r} is not a valid hostname")
        return value
