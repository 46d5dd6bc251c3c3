"""Covers for a bound host tree's package directories, as one read-only overlay.

hostpython.py names the directories of /usr and of a bound interpreter prefix that a sandbox
must see empty. Covering each with an empty read-only tmpfs costs bwrap two mounts and a read
of the mount table per directory: 1.6 ms of every start on a host whose /usr holds 16 of them.
Instead, the tree is mounted as a read-only overlay of itself under a small covers layer: the
same directories, empty and marked opaque (`user.overlay.opaque`, which bwrap's overlays read:
they are mounted with `userxattr`), so that each shows empty and nothing below it shows. One
mount, as cheap as the bind it replaces, and read-only as a whole.

A covers layer is made once per node, in the caller's private runtime directory, named by what
it holds (the covered paths and the host directories' modes, which the merged directories take
from it). `cover_layer` returns None, and the caller covers with tmpfs as before, wherever an
overlay would not show the tree as a bind does:
- a mount point inside the tree (an overlay shows the directory beneath it);
- a filesystem not known to serve as an overlay's lower layer;
- a covered directory that is not there, or reached through a symlink;
- a runtime directory whose filesystem keeps no user xattrs (tmpfs before Linux 6.6).
Setting MINISANDBOX_COVERS=tmpfs does the same everywhere (a host whose overlay of /usr fails).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import re
import secrets
import stat
from collections.abc import Sequence
from pathlib import Path

from minisandbox.errors import SandboxConfigError
from minisandbox.utils import safefs

logger = logging.getLogger(__name__)

OPAQUE_XATTR = "user.overlay.opaque"
COVERS_VAR = "MINISANDBOX_COVERS"
# Filesystems that overlayfs takes as a lower layer with nothing lost (network and FUSE
# filesystems revalidate their entries, which an overlay's lower layer may not).
_LOWER_OK = frozenset(
    {"ext2", "ext3", "ext4", "xfs", "btrfs", "tmpfs", "overlay", "f2fs", "squashfs", "erofs"}
)
FORMAT = 1


def cover_layer(root: Path, tree: Path, covered: Sequence[Path]) -> Path | None:
    """A layer that, over `tree`, shows each of `covered` (directories inside it) empty: made
    in `root` (the caller's private runtime directory) unless there. None where an overlay
    cannot stand in for a bind of `tree` (see the module's docstring), or where
    $MINISANDBOX_COVERS says `tmpfs`.

    Raises:
        SandboxConfigError: $MINISANDBOX_COVERS is neither `overlay` nor `tmpfs`.
    """
    if not overlay_wanted():
        return None
    try:
        rel = tuple(sorted({str(p.relative_to(tree)) for p in covered}))
    except ValueError:
        return None
    layer = _cover_layer(root, tree, rel)
    if layer is not None and not os.path.isdir(layer):  # removed since (a /tmp cleaner)
        _cover_layer.cache_clear()
        layer = _cover_layer(root, tree, rel)
    if layer is not None and not _intact(layer, rel):
        # Partly removed (a /tmp cleaner takes empty directories first): a covered directory
        # gone would show the host's. Fail closed: tmpfs covers for this start.
        logger.warning("covers layer %s is damaged: tmpfs covers instead", layer)
        return None
    return layer


def _intact(layer: Path, rel: tuple[str, ...]) -> bool:
    """Whether each covered directory of `layer` is there, a directory, and opaque (a few
    dozen system calls: checked at every start)."""
    base = str(layer)
    for sub in rel:
        path = os.path.join(base, sub)  # (strings: pathlib costs more than the calls here)
        try:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                return False
            if os.getxattr(path, OPAQUE_XATTR, follow_symlinks=False) != b"y":
                return False
        except OSError:
            return False
    return True


def overlay_wanted() -> bool:
    """Whether covers may be overlays ($MINISANDBOX_COVERS: `overlay`, the default, or `tmpfs`,
    one tmpfs per covered directory, as a host whose overlays fail can ask).

    Raises:
        SandboxConfigError: any other value.
    """
    how = os.environ.get(COVERS_VAR, "overlay")
    if how not in ("overlay", "tmpfs"):
        raise SandboxConfigError(
            f"{COVERS_VAR}={how!r}: use `overlay` (the default) or `tmpfs` (one tmpfs per "
            "covered directory)"
        )
    return how == "overlay"


@functools.lru_cache(maxsize=64)
def _cover_layer(root: Path, tree: Path, rel: tuple[str, ...]) -> Path | None:
    if not rel or not _overlay_stands_in(tree):
        return None
    modes = _modes(tree, rel)
    if modes is None:
        return None
    modes[""] = stat.S_IMODE(os.stat(tree).st_mode)  # the merged tree's root takes it too
    key = hashlib.sha256(json.dumps([FORMAT, str(tree), rel, sorted(modes.items())]).encode())
    layer = root / f"node-covers-{key.hexdigest()[:32]}"
    if os.path.isdir(layer) and not os.path.islink(layer):
        return layer
    staging = root / f"{layer.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    try:
        _make(staging, rel, modes)
        os.rename(staging, layer)
    except OSError:
        safefs.discard_tree(staging)
        if os.path.isdir(layer) and not os.path.islink(layer):  # another process made it
            return layer
        return None
    return layer


def _modes(tree: Path, rel: tuple[str, ...]) -> dict[str, int] | None:
    """The mode of each directory on the covered paths (all real directories), by path
    relative to `tree`; None if one is missing or a symlink."""
    modes: dict[str, int] = {}
    for path in rel:
        parts = Path(path).parts
        for i in range(1, len(parts) + 1):
            sub = os.path.join(*parts[:i])
            if sub in modes:
                continue
            try:
                st = os.lstat(tree / sub)
            except OSError:
                return None
            if not stat.S_ISDIR(st.st_mode):
                return None
            modes[sub] = stat.S_IMODE(st.st_mode)
    return modes


def _make(staging: Path, rel: tuple[str, ...], modes: dict[str, int]) -> None:
    """The layer's tree in `staging`: the directories on each covered path, with the host's
    modes, the covered ones opaque.

    Raises:
        OSError: the filesystem keeps no user xattrs, or anything else failed.
    """
    os.mkdir(staging, 0o700)
    for sub in sorted(modes):  # parents first
        if sub:
            os.mkdir(staging / sub, 0o700)
    for sub in rel:
        os.setxattr(staging / sub, OPAQUE_XATTR, b"y", follow_symlinks=False)
    for sub in sorted(modes, reverse=True):  # children first: a parent may lose our access
        os.chmod(staging / sub, modes[sub])


def _overlay_stands_in(tree: Path) -> bool:
    """Whether an overlay with `tree` as its lower layer shows what a bind of it shows: no
    mount point below it, and a filesystem that serves as a lower layer."""
    mounts = _mounts()
    if mounts is None:
        return False
    tree = Path(os.path.realpath(tree))  # where the kernel will find it
    best: tuple[int, str] | None = None
    for point, fstype in mounts:
        if point != tree and point.is_relative_to(tree):
            return False
        # >=: of mounts stacked on one point, the last listed is the one on top.
        if tree.is_relative_to(point) and (best is None or len(point.parts) >= best[0]):
            best = (len(point.parts), fstype)
    return best is not None and best[1] in _LOWER_OK


@functools.lru_cache(maxsize=1)
def _mounts() -> tuple[tuple[Path, str], ...] | None:
    """The mount points of this process's mount namespace and their filesystem types, read
    once per process; None if they cannot be read."""
    out: list[tuple[Path, str]] = []
    with contextlib.suppress(OSError), open("/proc/self/mountinfo", "rb") as f:
        for line in os.fsdecode(f.read(1 << 24)).splitlines():
            fields = line.split(" ")
            if "-" not in fields[6:]:
                continue
            sep = fields.index("-", 6)
            out.append((Path(_unescape(fields[4])), fields[sep + 1]))
        return tuple(out)
    return None


def _unescape(field: str) -> str:
    """A mountinfo path: the kernel writes space, tab, newline and backslash as octal escapes."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m[1], 8)), field)
