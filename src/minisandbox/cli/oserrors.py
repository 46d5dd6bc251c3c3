"""Disk full and friends: an OSError explained in one line by the place it hit and the setting
that moves that place."""

from __future__ import annotations

import errno
import os
from pathlib import Path

# Where the CLI writes, and the setting that moves each place: filled in by the commands, so
# that an OSError is explained by the place it hit.
_PLACES: dict[str, tuple[Path, str]] = {}

_FIXES = {
    errno.ENOSPC: "free space on its filesystem, or point {knob} elsewhere",
    errno.EDQUOT: "free space within your quota there, or point {knob} elsewhere",
    errno.EROFS: "it is on a read-only filesystem: point {knob} elsewhere",
    errno.EACCES: "uid {uid} may not write there: fix its permissions, or point {knob} elsewhere",
    errno.EPERM: "uid {uid} may not write there: fix its permissions, or point {knob} elsewhere",
}


def place(name: str, path: Path | None, knob: str) -> None:
    """The command writes under `path` (when given), which the setting `knob` moves."""
    if path is not None:
        _PLACES[name] = (Path(os.path.abspath(path)), knob)


def default_places() -> None:
    """The places every command may write to (the sandboxes' runtime directory). Named only
    when an error is explained: it imports the sandbox package, which `--help` must not wait
    for."""
    if "runtime" in _PLACES:
        return
    try:
        from minisandbox.sandbox.runtime import runtime_root

        place("runtime", runtime_root(), "MINISANDBOX_RUNTIME (or TMPDIR)")
    except Exception:  # the explanation goes without it
        return


def _filesystem(path: Path) -> tuple[int, int] | None:
    """(device, bytes free) of the filesystem holding `path` or its nearest existing parent."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
            dev = os.stat(candidate).st_dev
        except OSError:
            continue
        return dev, st.f_bavail * st.f_frsize
    return None


def _fullest(places: list[tuple[Path, str]]) -> tuple[list[tuple[Path, str]], int] | None:
    """The places on the filesystem with the least room left, and that room."""
    by_dev: dict[int, tuple[list[tuple[Path, str]], int]] = {}
    for root, knob in places:
        fs = _filesystem(root)
        if fs is not None:
            by_dev.setdefault(fs[0], ([], fs[1]))[0].append((root, knob))
    return min(by_dev.values(), key=lambda group: group[1]) if by_dev else None


def _named_path(e: OSError) -> Path | None:
    """The file `e` names, or the first error of its chain with the same errno that does."""
    seen: BaseException | None = e
    for _ in range(16):  # a clean-up's error hides the first one in its context: look there too
        if seen is None:
            break
        if (
            isinstance(seen, OSError)
            and seen.errno == e.errno
            and isinstance(seen.filename, (str, bytes, os.PathLike))
        ):
            return Path(os.path.abspath(os.fsdecode(seen.filename)))
        seen = seen.__cause__ or seen.__context__
    return None


def explain_os_error(e: OSError) -> str:
    """One line for an OSError: the path it hit and what to do about it.

    A failed write() names no file: then the first error of its chain that does is used, or for
    ENOSPC the places on the fullest filesystem, or else every place the command writes to."""
    default_places()
    path = _named_path(e)
    # The deepest place first: the node cache may live inside the store's folder.
    places = sorted(_PLACES.values(), key=lambda p: len(p[0].parts), reverse=True)
    knob = " / ".join(dict.fromkeys(k for _, k in places)) or "it"
    if path is not None:
        knob = next((k for root, k in places if path == root or root in path.parents), knob)
    what = e.strerror or str(e)
    where = f"{path}: " if path is not None else ""
    if path is None and places and e.errno in _FIXES:  # a failed write: where it may have been
        where = f"writing under one of {', '.join(str(p) for p, _ in places)}: "
        fullest = _fullest(places) if e.errno == errno.ENOSPC else None
        if fullest is not None:  # the write named no file: the likeliest culprit
            group, free = fullest
            knob = " / ".join(dict.fromkeys(k for _, k in group))
            where = f"{', '.join(str(p) for p, _ in group)}: "
            what += f" (the fullest filesystem this command writes to; {free >> 20} MiB free now)"
    fix = _FIXES.get(e.errno or 0, "")
    line = f"{where}{what}"
    if fix:
        line += "; " + fix.format(knob=knob, uid=os.geteuid())
    return line.replace("\n", " ")
