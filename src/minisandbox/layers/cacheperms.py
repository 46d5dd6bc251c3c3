"""Who may reach a node cache: its owner alone.

A root caller's cache is root's (`make_private`), an unprivileged caller's its own
(`make_own`); either way each directory of it is mode 0700, so no other uid of the host reaches
its layers, its pool (whose files are the layers' files), its locks or its accounts.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable, Sequence

from minisandbox.layers.errors import CacheOwnerError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _each_dir(root: str, subs: Sequence[str], fix: Callable[[int, str], None]) -> None:
    """`fix(fd, path)` on each directory `root/sub`, opened without following a link."""
    for sub in subs:
        path = os.path.join(root, sub)
        fd = os.open(path, _DIR_FLAGS | os.O_NOFOLLOW)
        try:
            fix(fd, path)
        finally:
            os.close(fd)


def make_private(
    root_path: os.PathLike[str] | str,
    subs: Sequence[str],
    *,
    created: bool,
    sandbox_uid: int | None,
) -> None:
    """A root caller's cache is root's alone: its layers are owned by the uid its sandboxes
    run as (they must appear as root inside), so a process of that uid on the host must not
    reach them, or it could rewrite every later sandbox's files (a grader's included), nor
    take the cache's locks. Root-owned directories of mode 0700 hold everything (bwrap still
    mounts the layers, as it does so as root before dropping to that uid, and overlayfs
    reads lower layers with the mounter's credentials).

    The cache root itself is made private too when this made it (`created`); an existing one
    is left as it is (it may be a directory others use, /tmp say) unless `sandbox_uid` owns
    it: then it could swap the directories in it, and root takes it."""
    root = os.path.realpath(root_path)  # the root may be a link the caller made
    fd = os.open(root, _DIR_FLAGS)
    try:
        if created or (sandbox_uid is not None and os.fstat(fd).st_uid == sandbox_uid):
            os.fchown(fd, 0, 0)
            os.fchmod(fd, 0o700)
    finally:
        os.close(fd)

    def fix(fd: int, _path: str) -> None:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o700)

    _each_dir(root, subs, fix)
    # A lock file that uid could open is a lock it could hold (eviction would stall).
    fd = os.open(os.path.join(root, "evict.lock"), os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        os.fchown(fd, 0, 0)
        os.fchmod(fd, 0o600)
    finally:
        os.close(fd)


def make_own(root_path: os.PathLike[str] | str, subs: Sequence[str], *, created: bool) -> None:
    """An unprivileged caller's cache is its own, and a cache another user owns is refused: a
    cache is per user (a shared one would let each user rewrite what the others' sandboxes
    run). The cache root is made 0700 when this made it (`created`); an existing one of ours
    loses write permission for group and others (they could swap what is in it).

    Raises:
        CacheOwnerError: the cache, or a directory of it, belongs to another user.
    """
    uid = os.geteuid()
    root = os.path.realpath(root_path)
    fd = os.open(root, _DIR_FLAGS)
    try:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise CacheOwnerError(root, st.st_uid)
        if created:
            os.fchmod(fd, 0o700)
        elif st.st_mode & 0o022:
            os.fchmod(fd, stat.S_IMODE(st.st_mode) & ~0o022)
    finally:
        os.close(fd)

    def fix(fd: int, path: str) -> None:
        st = os.fstat(fd)
        if st.st_uid != uid:
            raise CacheOwnerError(path, st.st_uid)
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)

    _each_dir(root, subs, fix)
