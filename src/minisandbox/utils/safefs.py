"""Host-side operations on trees a sandbox could have written, in one place.

The rule: host code never resolves a path inside such a tree (an upper layer, a build's output, a
kept upper, a checkout that ran install commands) by following symlinks. A sandbox can replace any
directory it wrote with a symlink to a host path; a plain `shutil.rmtree(upper / "a/b")`,
`os.rename(upper / "opt/venv", ...)` or `open(upper / "x")` then acts on the host path, with the
supervisor's rights (root's, for a root caller).

Every function here starts from a directory the caller trusts (`root`, which it created) and walks
the relative path one component at a time with `O_NOFOLLOW | O_DIRECTORY`, acting on the last
component through its parent's descriptor (`*at` calls, `follow_symlinks=False`). A symlink on the
way is an error (`UnsafePathError`), never a detour; a missing component is `FileNotFoundError`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from pathlib import Path

from minisandbox.errors import MiniSandboxError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
SETID = stat.S_ISUID | stat.S_ISGID


class UnsafePathError(MiniSandboxError, OSError):
    """A path inside a sandbox-written tree is not what it must be (a symlink on the way, a
    device where a regular file was expected, a file over its size cap)."""


def _parts(rel: str | os.PathLike[str]) -> list[str]:
    parts = [p for p in Path(rel).parts if p not in ("", ".")]
    if parts and parts[0] == "/":
        parts = parts[1:]
    if any(p == ".." for p in parts):
        raise UnsafePathError(f"{os.fspath(rel)!r}: '..' is not allowed here")
    return parts


def open_root(root: str | os.PathLike[str]) -> int:
    """A descriptor of `root` itself, refusing a symlink in its last component."""
    try:
        return os.open(root, _DIR_FLAGS)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafePathError(f"{os.fspath(root)} is not a directory (a symlink?)") from None
        raise


def open_dir(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> int:
    """A descriptor of the directory `root/rel`, no symlink followed on the way."""
    fd = open_root(root)
    try:
        for i, name in enumerate(_parts(rel)):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ELOOP, errno.ENOTDIR):
                    where = os.path.join(os.fspath(root), *_parts(rel)[: i + 1])
                    raise UnsafePathError(
                        f"{where} is not a directory (a symlink?): refusing to follow it"
                    ) from None
                raise
            os.close(fd)
            fd = child
        return fd
    except BaseException:
        os.close(fd)
        raise


@contextlib.contextmanager
def parent_of(
    root: str | os.PathLike[str], rel: str | os.PathLike[str]
) -> Iterator[tuple[int, str]]:
    """(descriptor of the parent directory, last name) of `root/rel`."""
    parts = _parts(rel)
    if not parts:
        raise UnsafePathError(f"{os.fspath(rel)!r} names the root itself")
    fd = open_dir(root, os.path.join(*parts[:-1]) if len(parts) > 1 else ".")
    try:
        yield fd, parts[-1]
    finally:
        os.close(fd)


def lstat_at(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> os.stat_result | None:
    """lstat of `root/rel` (None when absent), no symlink followed on the way."""
    try:
        with parent_of(root, rel) as (fd, name):
            return os.stat(name, dir_fd=fd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def open_dir_as_owner(fd: int, name: str) -> int:
    """Open the directory `name` (in `fd`) that its owner (us) may not read or search (a
    sandbox left it mode 000): give the owner rwx through an O_PATH descriptor, which needs no
    permission on it and refuses a symlink, so the chmod cannot be redirected. The caller gives
    the mode back if it must (after reading the entries: that needs the permission too). -1
    when that fails too (not ours)."""
    try:
        flags = os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC
        path_fd = os.open(name, flags, dir_fd=fd)
    except OSError:
        return -1
    try:
        mode = stat.S_IMODE(os.fstat(path_fd).st_mode)
        via = f"/proc/self/fd/{path_fd}"
        os.chmod(via, mode | stat.S_IRWXU)
        # Through the descriptor's magic link, which names the very directory opened above
        # (nothing can redirect it); O_NOFOLLOW would refuse that link itself (ELOOP).
        return os.open(via, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return -1
    finally:
        os.close(path_fd)


def _remove_dir_at(fd: int, name: str) -> None:
    """Remove the directory `name` in `fd` and everything in it, never following a link."""
    try:
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
    except PermissionError:  # a non-root owner's mode-000 directory
        child = open_dir_as_owner(fd, name)
    except OSError:
        child = -1
    if child >= 0:
        try:
            _rmtree_fd(child)
        finally:
            os.close(child)
    os.rmdir(name, dir_fd=fd)


def _rmtree_fd(fd: int) -> None:
    """Empty the directory open at `fd`, never following a symlink; copes with directories a
    sandbox left without write or search permission (overlay work dirs are mode 000)."""
    with contextlib.suppress(OSError):
        os.fchmod(fd, stat.S_IRWXU)
    for entry in list(os.scandir(fd)):
        name = entry.name
        try:
            is_dir = entry.is_dir(follow_symlinks=False)
        except OSError:
            is_dir = False
        if is_dir:
            _remove_dir_at(fd, name)
        else:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=fd)


def remove(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> bool:
    """Delete `root/rel` (a file, a symlink itself, or a whole directory); False if absent."""
    try:
        with parent_of(root, rel) as (fd, name):
            st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if stat.S_ISDIR(st.st_mode):
                _remove_dir_at(fd, name)
            else:
                os.unlink(name, dir_fd=fd)
            return True
    except FileNotFoundError:
        return False


def remove_tree(path: str | os.PathLike[str]) -> bool:
    """Delete the directory `path` and everything in it; the tree may be hostile, `path`'s own
    parents are trusted. True when nothing is left."""
    parent, name = os.path.split(os.path.abspath(os.fspath(path)))
    try:
        remove(parent, name)
    except FileNotFoundError:
        pass
    return not os.path.lexists(path)


def discard_tree(path: str | os.PathLike[str]) -> bool:
    """`remove_tree`, where an error only means something is left: True when nothing is (the
    janitor's and every cleanup's way: a tree half removed is still removed later)."""
    try:
        return remove_tree(path)
    except OSError:
        return not os.path.lexists(path)


def rmdir_empty_chain(root: str | os.PathLike[str], rel: str | os.PathLike[str]) -> None:
    """rmdir `root/rel`, then its parents while they are empty, up to (not including) `root`."""
    parts = _parts(rel)
    while parts:
        try:
            with parent_of(root, os.path.join(*parts)) as (fd, name):
                os.rmdir(name, dir_fd=fd)
        except (FileNotFoundError, UnsafePathError):
            pass
        except OSError:  # not empty, or not a directory
            return
        parts = parts[:-1]


def move_dir(
    src_root: str | os.PathLike[str],
    rel: str | os.PathLike[str],
    dst_root: str | os.PathLike[str],
    dst_rel: str | os.PathLike[str],
) -> None:
    """Rename the real directory `src_root/rel` to `dst_root/dst_rel` (same filesystem; the
    destination's parent must exist). A symlink anywhere on the source path, the source itself
    included, is refused: what moves is what the build produced, never what a link points at."""
    with parent_of(src_root, rel) as (sfd, sname), parent_of(dst_root, dst_rel) as (dfd, dname):
        st = os.stat(sname, dir_fd=sfd, follow_symlinks=False)
        if not stat.S_ISDIR(st.st_mode):
            raise UnsafePathError(
                f"{os.path.join(os.fspath(src_root), os.fspath(rel))} is not a directory "
                f"({stat.filemode(st.st_mode)}): refusing to move it"
            )
        os.rename(sname, dname, src_dir_fd=sfd, dst_dir_fd=dfd)


def read_bounded(
    root: str | os.PathLike[str], rel: str | os.PathLike[str], max_bytes: int
) -> bytes:
    """The bytes of the regular file `root/rel`, at most `max_bytes` (more is an error); a FIFO,
    device or symlink is refused without being opened for reading."""
    with parent_of(root, rel) as (fd, name):
        f = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=fd)
    try:
        st = os.fstat(f)
        where = os.path.join(os.fspath(root), os.fspath(rel))
        if not stat.S_ISREG(st.st_mode):
            raise UnsafePathError(f"{where} is not a regular file ({stat.filemode(st.st_mode)})")
        chunks, total = [], 0
        while chunk := os.read(f, min(1 << 20, max_bytes + 1 - total)):
            chunks.append(chunk)
            total += len(chunk)
            if total > max_bytes:
                raise UnsafePathError(f"{where} is larger than {max_bytes} bytes")
        return b"".join(chunks)
    finally:
        os.close(f)


def walk(root: str | os.PathLike[str]) -> Iterator[tuple[int, str, os.stat_result]]:
    """Every entry under `root` as (descriptor of its directory, name, lstat), depth first,
    directories after their contents. Symlinks are reported, never entered. The descriptors are
    valid only during the iteration step."""

    def visit(fd: int) -> Iterator[tuple[int, str, os.stat_result]]:
        for entry in list(os.scandir(fd)):
            try:
                st = os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISDIR(st.st_mode):
                try:
                    child = os.open(entry.name, _DIR_FLAGS, dir_fd=fd)
                except OSError:
                    child = -1
                if child >= 0:
                    try:
                        yield from visit(child)
                    finally:
                        os.close(child)
            yield fd, entry.name, st

    fd = open_root(root)
    try:
        yield from visit(fd)
    finally:
        os.close(fd)


def strip_setid(root: str | os.PathLike[str]) -> list[str]:
    """Clear set-user-id and set-group-id bits on every regular file under `root` (and on
    `root`'s own files); returns the relative names it changed. Links are not followed."""
    changed = []
    for fd, name, st in walk(root):
        if stat.S_ISREG(st.st_mode) and st.st_mode & SETID:
            # O_PATH: no read permission needed (a caller's own mode-4000 file), no link followed.
            f = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            try:
                if stat.S_ISREG(os.fstat(f).st_mode):
                    os.chmod(f"/proc/self/fd/{f}", stat.S_IMODE(st.st_mode) & ~SETID)
                    changed.append(name)
            finally:
                os.close(f)
    return changed


def chown_tree(root: str | os.PathLike[str], uid: int, gid: int) -> None:
    """chown `root` and everything under it, links themselves (never their targets)."""
    for fd, name, _st in walk(root):
        os.chown(name, uid, gid, dir_fd=fd, follow_symlinks=False)
    fd = open_root(root)
    try:
        os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
