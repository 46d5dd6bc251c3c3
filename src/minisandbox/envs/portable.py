"""Interpreters as layers of the store, so that a node without them still runs every task.

A venv links to its base interpreter at that interpreter's own path (toolchains: `prefix`). On the
machine that built it, the prefix is bound read-only from the host; a cluster node may not have
it, so there the prefix travels as a layer whose tree holds it at its own path (the layer of
`/opt/py/3.11` holds `opt/py/3.11/...`), overlaid under the task's layers like any other.

Left out of the layer: what sandboxes never show of a host interpreter (sandbox/hostpython.py):
its own site-packages and dist-packages (a task's venv never sees them, a host interpreter's can
hold gigabytes, and a later release of the task's project among them would be readable), and in
a conda base prefix its other environments and its package cache. A prefix under a path every
sandbox mounts from the host (/usr: a distribution's Python; /tmp) cannot travel: it stays a host
path, which a node must have.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

from minisandbox.envs.kinds import format_of
from minisandbox.envs.layerbuild import LayerBuilder
from minisandbox.sandbox.hostpython import CONDA_EXTRAS, prefix_package_dirs
from minisandbox.utils.hashing import content_digest

__all__ = ["interpreter_layer", "interpreter_ref", "travels"]

_FORMAT = format_of("python")  # (envs/kinds.py)
# Where the sandbox mounts host or private directories over the overlay: a layer's files there
# would be hidden (sandbox.rootfs binds these).
_HOST_MOUNTED = (
    "/usr",
    "/bin",
    "/sbin",
    "/lib",
    "/lib32",
    "/lib64",
    "/libx32",
    "/tmp",
    "/dev",
    "/proc",
    "/etc",
    "/run",
)


def travels(prefix: Path) -> bool:
    """Whether the interpreter at `prefix` can be a layer (it is not under a host mount)."""
    p = Path(os.path.abspath(prefix))
    return p != Path("/") and not any(p == Path(m) or p.is_relative_to(m) for m in _HOST_MOUNTED)


def interpreter_ref(prefix: Path) -> str:
    """The layer ref of the interpreter at `prefix`: its path and what its bin/ holds (a
    reinstall at the same path is another layer).

    Raises:
        OSError: its bin/ cannot be read.
    """
    bin_dir = Path(prefix) / "bin"
    entries = []
    for entry in sorted(os.scandir(bin_dir), key=lambda e: e.name):
        st = entry.stat(follow_symlinks=False)
        entries.append([entry.name, st.st_size, st.st_mtime_ns])
    return f"python/{content_digest({'format': _FORMAT, 'prefix': str(prefix), 'bin': entries})}"


def _stage(prefix: Path, tree: Path) -> None:
    """`tree/<prefix>`: the prefix's files (hard links where the filesystem allows), its
    package directories empty; the directories above it 0755, so the sandbox's user can reach
    it."""
    dest = tree / str(prefix).lstrip("/")
    dest.parent.mkdir(parents=True)
    for parent in [dest.parent, *dest.parent.parents]:
        if parent == tree or not parent.is_relative_to(tree):
            break
        os.chmod(parent, 0o755)
    packages = {str(p) for p in prefix_package_dirs(prefix)}

    def ignore(directory: str, names: list[str]) -> list[str]:
        if directory in packages:
            return names  # kept as an empty directory: the interpreter expects it
        return [n for n in names if os.path.join(directory, n) in packages and n in CONDA_EXTRAS]

    def link_or_copy(src: str, dst: str) -> None:
        try:
            os.link(src, dst, follow_symlinks=False)
        except OSError:
            shutil.copy2(src, dst, follow_symlinks=False)

    shutil.copytree(prefix, dest, symlinks=True, ignore=ignore, copy_function=link_or_copy)


async def interpreter_layer(lb: LayerBuilder, prefix: Path) -> str:
    """The layer id of the interpreter at `prefix`, published once per store.

    Raises:
        ValueError: the prefix cannot travel (see `travels`).
        OSError: the prefix could not be read.
    """
    prefix = Path(os.path.abspath(prefix))
    if not travels(prefix):
        raise ValueError(f"{prefix} is under a directory sandboxes mount from the host")
    ref = interpreter_ref(prefix)
    existing = lb.store.resolve(ref)
    if existing:
        return existing

    async def make() -> str:
        with lb.work_dir("python-") as work:
            await asyncio.to_thread(_stage, prefix, work / "tree")
            layer = await asyncio.to_thread(
                lb.store.publish, work / "tree", meta={"kind": "python", "prefix": str(prefix)}
            )
        lb.store.tag(ref, layer.id)
        return layer.id

    return await lb.once(ref, False, make)
