"""cgroup v2 limits for a whole sandbox, where the caller may use them; rlimits everywhere else.

A sandbox goes into its own cgroup (memory.max, pids.max) when a delegated cgroup v2 directory
with the memory and pids controllers is available: the one named by $MINISANDBOX_CGROUP, or, for
root on a host whose cgroup2 root offers both controllers, `<cgroup2 root>/minisandbox`. Otherwise
(no cgroup v2, no delegation, hybrid hosts with controllers bound to v1) nothing is required.
"""

from __future__ import annotations

import contextlib
import functools
import os
from pathlib import Path

_NEEDED = {"memory", "pids"}


def _cgroup2_root() -> Path | None:
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                if right.split()[:1] == ["cgroup2"]:
                    return Path(left.split()[4])
    except OSError:
        pass
    return None


def _controllers(path: Path, name: str) -> set[str]:
    try:
        return set((path / name).read_text().split())
    except OSError:
        return set()


def _usable(parent: Path) -> bool:
    """Children of `parent` get memory and pids limits, and we may create them."""
    if not os.access(parent, os.W_OK):
        return False
    if _controllers(parent, "cgroup.subtree_control") >= _NEEDED:
        return True
    if not _controllers(parent, "cgroup.controllers") >= _NEEDED:
        return False
    try:  # delegate the controllers to the children we are about to create
        (parent / "cgroup.subtree_control").write_text("+memory +pids")
    except OSError:
        return False
    return _controllers(parent, "cgroup.subtree_control") >= _NEEDED


@functools.cache
def delegated_parent() -> Path | None:
    """Where sandbox cgroups go, or None when cgroup limits are unavailable to this caller."""
    explicit = os.environ.get("MINISANDBOX_CGROUP")
    if explicit:
        return Path(explicit) if _usable(Path(explicit)) else None
    root = _cgroup2_root()
    if root is None or os.geteuid() != 0:
        return None
    if not _controllers(root, "cgroup.controllers") >= _NEEDED:
        return None
    parent = root / "minisandbox"
    with contextlib.suppress(FileExistsError, OSError):
        parent.mkdir()
    return parent if _usable(parent) else None


class SandboxCgroup:
    """One sandbox's cgroup: created before its processes exist, removed after they are gone."""

    def __init__(self, parent: Path, name: str) -> None:
        self.path = parent / name

    def create(self, memory_bytes: int | None, pids: int | None) -> None:
        self.path.mkdir()
        if memory_bytes is not None:
            (self.path / "memory.max").write_text(str(memory_bytes))
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")
        if pids is not None:
            (self.path / "pids.max").write_text(str(pids))

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError, OSError):
            os.rmdir(self.path)
