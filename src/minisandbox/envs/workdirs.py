"""Build work directories: named after their owner, so that what a killed build leaves behind is
recognised and swept (on a builder's first build, and by `minisandbox cache gc`).

They hold sandbox-written trees (upper layers), so they are measured and removed by descriptors
that never follow a link (utils.safefs).
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import socket
import time
from pathlib import Path

from minisandbox.envs.settings import BuildSettings
from minisandbox.utils import safefs
from minisandbox.utils.procfs import start_time


def build_tmp(settings: BuildSettings) -> Path:
    """Where builds keep their work directories (upper layers, staged layers)."""
    return settings.store.parent / "build-tmp"


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9_-]", "_", socket.gethostname())[:40] or "host"


def work_name() -> str:
    """`<host>.<pid>.<start time>.<random>`: whose work directory this is, across the machines
    that share a store and across pid reuse."""
    pid = os.getpid()
    return f"{_host()}.{pid}.{start_time(pid) or 0}.{secrets.token_hex(4)}"


_WORK_NAME = re.compile(
    r"^[a-z]+-(?P<host>[A-Za-z0-9_-]+)\.(?P<pid>\d+)\.(?P<start>\d+)\.[0-9a-f]+$"
)
# Work directories named before owners were recorded: removed once this old.
_UNNAMED_GRACE_SECONDS = 24 * 3600.0


def _owner_dead(name: str) -> bool:
    m = _WORK_NAME.match(name)
    if m is None or m["host"] != _host():
        return False  # another machine's (a shared store): its own sweep decides
    return start_time(int(m["pid"])) != m["start"]


def sweep_build_tmp(root: Path) -> list[tuple[Path, int]]:
    """Remove the work directories under `root` whose builder process is gone (killed builds
    leave them), and unattributable ones older than a day; returns (path, bytes) removed.
    They hold sandbox-written trees, so they are measured and removed by descriptors."""
    removed: list[tuple[Path, int]] = []
    try:
        names = sorted(os.listdir(root))
    except FileNotFoundError:
        return removed
    cutoff = time.time() - _UNNAMED_GRACE_SECONDS
    for name in names:
        path = root / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        stale = _owner_dead(name) or (_WORK_NAME.match(name) is None and st.st_mtime < cutoff)
        if not stale:
            continue
        size = 0
        with contextlib.suppress(OSError):
            if os.path.isdir(path) and not os.path.islink(path):
                size = sum(s.st_size for _fd, _n, s in safefs.walk(path))
        try:
            gone = safefs.remove_tree(path)
        except OSError:  # another user's, say: not ours to remove
            gone = False
        if gone:
            removed.append((path, size))
    return removed
