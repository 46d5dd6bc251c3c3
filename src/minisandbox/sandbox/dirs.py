"""A sandbox's host directories: its runtime directory, channel directory and upper layer.

The runtime directory (private, under runtime.process_dir) holds the channel directory and, for
a throwaway sandbox, the upper layer and overlay work directory. A kept upper layer (`upper=`)
lies where the caller chose; its work directory goes beside it, named after its owner process so
that a later start can remove a dead owner's, and registered for the janitor before it exists.

A kept upper layer holds whatever an earlier sandbox wrote, symlinks included: below the path the
caller chose, every walk here goes by directory descriptors and never follows a link.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path

from minisandbox.errors import SandboxConfigError
from minisandbox.sandbox import cleanup
from minisandbox.utils import safefs
from minisandbox.utils.procfs import start_time


def make_runtime_dir(path: Path, searchable: bool = False) -> Path:
    """Create the runtime directory `path` (mode 700) and its channel directory `io`: the
    channel directory's path. `io` is mode 300: its owner creates and opens files by name
    there, but the sandbox (read-only inside) cannot list it to find another command's FIFO.
    `searchable` (a root caller's): 311, so that the sandbox's first program, which runs as
    host root without capabilities (a stranger to `io`, owned by the sandbox's uid), can be
    executed from it; `path` (700, ours) keeps every other host user out."""
    path.mkdir(mode=0o700)
    io = path / "io"
    io.mkdir(mode=0o700)
    os.chmod(io, 0o311 if searchable else 0o300)
    return io


def kept_work_dir(upper: Path, runtime_dir: Path, sandbox_id: str) -> Path:
    """Create the kept upper layer `upper` if needed, and the overlay work directory beside it
    (overlayfs wants it empty and on the upper's filesystem): its path. Work directories of dead
    owners are removed first; the new one is registered in `runtime_dir` for the janitor before
    it exists, in case we die without stopping the sandbox.

    Raises:
        SandboxConfigError: `upper` is there and is not a directory.
    """
    if os.path.lexists(upper) and not upper.is_dir():
        raise SandboxConfigError(
            f"upper {upper}: not a directory: give a directory (made if missing)"
        )
    upper.mkdir(parents=True, exist_ok=True)
    _sweep_dead_work_dirs(upper)
    work = upper.parent / _work_dir_name(upper, sandbox_id)
    fd = os.open(
        runtime_dir / cleanup.EXTERNAL_DIRS,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
    )
    with os.fdopen(fd, "wb") as f:
        f.write(os.fsencode(work) + b"\n")
    work.mkdir()
    return work


def chown(path: Path, owner: tuple[int, int] | None) -> None:
    """Give `path` (not a symlink's target) to `owner`, when set."""
    if owner is not None:
        os.chown(path, *owner, follow_symlinks=False)


def seal_kept_upper(upper: Path, mode: int) -> None:
    """A kept upper layer stays on the host after the sandbox: make it private to its owner
    (`mode` 0700 once stopped; the directory is the sandbox's `/`, which it may chmod) and
    clear set-id bits in it (seccomp refuses setting them, but a set-id file of a lower
    layer can be copied up), so that no other host user can run anything from it as the
    sandbox's uid. Directories that not even the caller may enter are skipped: 0700 covers
    them."""
    # The caller chose this path: following its links is theirs to decide. Below it, the
    # sandbox's tree is walked without following any.
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fchmod(fd, mode)
    finally:
        os.close(fd)
    safefs.strip_setid(os.path.realpath(upper))


def precreate(
    upper: Path,
    destinations: list[str],
    layers: list[Path],
    workdir: str,
    owner: tuple[int, int] | None,
) -> None:
    """Create, owned by the sandbox's root (`owner`, for a root caller), the directories that
    bwrap would otherwise create as its own (root's, for a root caller) while placing mount
    points: /root, the workdir, and every parent of a mount destination that no layer provides.

    Raises:
        SandboxConfigError: a path in the upper layer is not a directory (a symlink?).
    """
    wanted = {"/root", workdir}
    for dest in destinations:
        parent = os.path.dirname(dest)
        while os.path.dirname(parent) != parent:  # not `!= "/"`: "//usr" ends at "//"
            wanted.add(parent)
            parent = os.path.dirname(parent)
    for inside in sorted(wanted):
        rel = inside.lstrip("/")
        if not any(os.path.lexists(tree / rel) for tree in layers):
            _make_upper_dir(upper, Path(rel), layers, owner)


def _make_upper_dir(
    upper: Path, rel: Path, layers: list[Path], owner: tuple[int, int] | None
) -> None:
    """mkdir -p in the upper layer. A parent that a lower layer provides is created with
    that layer's mode and owner: in an overlay the upper copy's attributes win.

    A kept upper layer holds whatever an earlier sandbox wrote there, symlinks included: walk
    it by directory descriptors and never follow a link, or a planted `/testbed -> /etc`
    would make us create (and chown) directories on the host."""
    fd = os.open(upper, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for i, name in enumerate(rel.parts, start=1):
            sub = Path(*rel.parts[:i])
            try:
                os.mkdir(name, 0o700, dir_fd=fd)
                created = True
            except FileExistsError:
                created = False
            try:
                child = os.open(
                    name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd
                )
            except OSError as e:
                raise SandboxConfigError(
                    f"refusing to start: {upper / sub} in the upper layer is not a "
                    f"directory (a symlink?): {e.strerror}"
                ) from None
            os.close(fd)
            fd = child
            if created:
                _like_lower(fd, sub, layers, owner)
    finally:
        os.close(fd)


def _like_lower(fd: int, sub: Path, layers: list[Path], owner: tuple[int, int] | None) -> None:
    """Give the new upper directory `fd` (at `sub`) the mode and owner of the topmost lower
    layer's directory there, or defaults (0755, /root 0700, `owner`) if none has one."""
    lower = next((t / sub for t in reversed(layers) if _is_dir(t / sub)), None)
    if lower is not None:
        st = os.stat(lower, follow_symlinks=False)
        mode, lower_owner = stat.S_IMODE(st.st_mode), (st.st_uid, st.st_gid)
    else:
        mode, lower_owner = (0o700 if str(sub) == "root" else 0o755), None
    os.fchmod(fd, mode)  # whatever our umask is
    if owner is not None:
        os.fchown(fd, *(lower_owner or owner))


def _is_dir(path: Path) -> bool:
    """A real directory (not a symlink to one)."""
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False


def _work_dir_name(upper: Path, sandbox_id: str) -> str:
    """The overlay work directory of a kept `upper`, beside it: `.<upper>.work-p<pid>-<start
    time>-<sandbox id>`, so that a later start can tell whether its owner still runs."""
    return f".{upper.name}.work-p{os.getpid()}-{start_time(os.getpid())}-{sandbox_id}"


def _sweep_dead_work_dirs(upper: Path) -> None:
    """Remove the work directories beside `upper` whose owner process is gone (killed before
    its janitor could remove them, or the janitor was killed too). Only our own directories,
    named as `_work_dir_name` names them; a live owner's (same pid and start time) is kept."""
    prefix = f".{upper.name}.work-p"
    try:
        names = [n for n in os.listdir(upper.parent) if n.startswith(prefix)]
    except OSError:
        return
    for name in names:
        pid, _, rest = name[len(prefix) :].partition("-")
        start, _, _sandbox = rest.partition("-")
        if not pid.isdigit() or not start.isdigit():
            continue
        if start_time(int(pid)) == start:
            continue  # its owner still runs
        path = upper.parent / name
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            with contextlib.suppress(OSError):
                safefs.remove_tree(path)
