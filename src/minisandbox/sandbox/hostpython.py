"""What of the host's Python software a sandbox must not see: installed packages.

A sandbox binds the host's /usr and each task's interpreter prefix read-only. Whatever is
installed there is readable inside, though no venv imports it: a later release of the task's
own project (pip-installed into the interpreter, a distribution's python3-* package, a copy
vendored by other software) would hand an agent the fix. So the sandbox shows an interpreter's
standard library and binaries, and none of its installed packages:

- in an interpreter prefix bound from the host (any directory holding `lib/pythonX.Y/os.py`):
  `lib*/python*/site-packages` and `dist-packages` (`.pth` files live there too), and a conda
  root's `envs`, `pkgs` (its package cache) and `conda-meta`;
- under /usr: every directory that holds Python packages and is not a standard library: each
  `site-packages` / `dist-packages`, and the parent of each top-level package found elsewhere
  (e.g. a cloud SDK's `lib/third_party`), found by one walk per node (kept in the caller's
  private runtime directory; again when a directory appears up to three levels below /usr).

Each is shown empty: by the covers layer of its bound tree (covers.py), else by an empty
read-only tmpfs. Python files outside packages (a script in
/usr/bin) stay visible: they are programs, not a project's tree. The rest of /usr (compilers,
shared libraries, git, the shell) cannot hold a Python project's future; what a particular task
could still find is what `build --validate` checks (evaluation/validation.py: leaks).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

# Package directories of a Python installation, by name.
_PACKAGE_DIRS = ("site-packages", "dist-packages")
# A conda root's other environments, package cache and metadata (never needed to run Python).
CONDA_EXTRAS = ("envs", "pkgs", "conda-meta")
_STDLIB_NAME = re.compile(r"^python\d(\.\d+)?$")
# Python package archives (a package cache, a wheelhouse): hidden with their directory.
_ARCHIVE = re.compile(r"\.(whl|egg|conda)$")
# Except the wheels a distribution's ensurepip installs into every new venv (Debian's
# python3-pip-whl: pip, setuptools, wheel): `python3 -m venv` fails without them.
_ENSUREPIP_WHEELS = ("share/python-wheels",)


def _is_stdlib(path: str) -> bool:
    """Whether `path` is an interpreter's standard library directory (lib/python3.11)."""
    return bool(_STDLIB_NAME.match(os.path.basename(path))) and os.path.isfile(
        os.path.join(path, "os.py")
    )


def is_python_prefix(path: Path) -> bool:
    """Whether `path` is an interpreter's installation prefix (it holds a standard library)."""
    for lib in ("lib", "lib64"):
        try:
            names = os.listdir(path / lib)
        except OSError:
            continue
        if any(_is_stdlib(os.path.join(path, lib, n)) for n in names):
            return True
    return False


def prefix_package_dirs(prefix: Path) -> list[Path]:
    """The directories of interpreter `prefix` that hold installed packages (existing,
    real directories only)."""
    found: list[Path] = []
    for lib in ("lib", "lib64"):
        try:
            names = sorted(os.listdir(prefix / lib))
        except OSError:
            continue
        for name in names:
            if not _STDLIB_NAME.match(name):
                continue
            found += [prefix / lib / name / d for d in _PACKAGE_DIRS]
    found += [prefix / d for d in CONDA_EXTRAS]
    return [p for p in found if p.is_dir() and not p.is_symlink()]


def _package_trees(root: str) -> list[str]:
    """Directories under `root` that hold Python packages, outside standard libraries (the
    walk never follows symlinks)."""
    found: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        name = os.path.basename(dirpath)
        archives = any(_ARCHIVE.search(f) for f in filenames)
        if archives and any(dirpath == os.path.join(root, w) for w in _ENSUREPIP_WHEELS):
            archives = False
        if name in _PACKAGE_DIRS or archives:
            found.append(dirpath)
            dirnames.clear()
        elif "__init__.py" in filenames:
            parent = os.path.dirname(dirpath)
            if not _is_stdlib(parent):
                found.append(parent)
            dirnames.clear()  # the package's own tree is covered (or is the stdlib's)
    return found


def minimal_cover(paths: Iterable[Path]) -> list[Path]:
    """`paths` without those inside another of them, sorted."""
    out: list[Path] = []
    for p in sorted(set(paths)):
        if not any(p.is_relative_to(q) for q in out):
            out.append(p)
    return out


def _tree_stamp(root: str) -> tuple[tuple[str, int], ...]:
    """The modification times of `root` and of the directories in it: software installed as a
    new directory one level below them (/usr/lib/<sdk>, /usr/share/<tool>) changes one. Cheap
    enough for every sandbox start (a dozen stats)."""
    stamp: list[tuple[str, int]] = []
    try:
        stamp.append((root, os.stat(root).st_mtime_ns))
        with os.scandir(root) as it:
            for entry in it:
                if entry.is_dir(follow_symlinks=False):
                    stamp.append((entry.path, entry.stat(follow_symlinks=False).st_mtime_ns))
    except OSError:
        pass
    return tuple(sorted(stamp))


def _deep_stamp(root: str) -> list[tuple[str, int]]:
    """The modification times of the directories up to two levels below `root` (a few
    hundred stats): what the node-wide record of a walk is keyed on."""
    stamp: list[tuple[str, int]] = []
    for path, _mtime in _tree_stamp(root)[1:] if os.path.isdir(root) else ():
        try:
            with os.scandir(path) as it:
                for entry in it:
                    if entry.is_dir(follow_symlinks=False):
                        st = entry.stat(follow_symlinks=False)
                        stamp.append((entry.path, st.st_mtime_ns))
        except OSError:
            continue
    return sorted(stamp)


def _record_path(root: str, stamp: tuple[tuple[str, int], ...]) -> Path:
    from minisandbox.sandbox.runtime import runtime_root

    key = hashlib.sha256(json.dumps([root, stamp, _deep_stamp(root)]).encode()).hexdigest()
    return runtime_root() / f"node-usr-packages-{key[:32]}.json"


@functools.lru_cache(maxsize=4)
def _usr_package_dirs(root: str, stamp: tuple[tuple[str, int], ...]) -> tuple[Path, ...]:
    """The walk, once per node while /usr is unchanged: its result is kept in the caller's
    private runtime directory (mode 700, checked as sandboxes check it), keyed on the
    modification times of /usr's directories up to three levels down; a process reads it
    instead of walking (a walk costs 0.2-0.3 s, a CLI command's whole budget)."""
    from minisandbox.errors import RuntimeDirError
    from minisandbox.sandbox.runtime import private_root

    record = _record_path(root, stamp)
    try:
        private_root(record.parent)  # ours alone, or no record is read or kept
    except (OSError, RuntimeDirError):
        return tuple(minimal_cover(Path(p) for p in _package_trees(root)))
    with contextlib.suppress(OSError, ValueError):
        fd = os.open(record, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            if os.fstat(f.fileno()).st_uid == os.geteuid():
                paths = json.loads(f.read(1 << 20))
                if isinstance(paths, list) and all(isinstance(p, str) for p in paths):
                    return tuple(Path(p) for p in paths)
    found = tuple(minimal_cover(Path(p) for p in _package_trees(root)))
    with contextlib.suppress(OSError):
        staging = record.with_name(f"{record.name}.{os.getpid()}.tmp")
        staging.write_text(json.dumps([str(p) for p in found]))
        os.replace(staging, record)
    return found


def usr_package_dirs(root: str = "/usr") -> tuple[Path, ...]:
    """The package-holding directories under the host's `root` (/usr): rechecked at each call
    against the directories one level below it (a dozen stats), walked once per node while
    none is added up to three levels down (packages added deeper into a tree that already holds
    packages are covered with it)."""
    return _usr_package_dirs(root, _tree_stamp(root))


@functools.lru_cache(maxsize=64)
def _prefix_dirs_cached(prefix: str) -> tuple[Path, ...]:
    return tuple(prefix_package_dirs(Path(prefix))) if is_python_prefix(Path(prefix)) else ()


def hidden_dirs(bound: Iterable[Path], usr: str = "/usr") -> list[Path]:
    """What to cover in a sandbox that binds `usr` and the host directories `bound`: the
    package directories of /usr and of each bound interpreter prefix."""
    return list(_hidden(tuple(str(p) for p in bound), usr, _tree_stamp(usr)))


@functools.lru_cache(maxsize=64)
def _hidden(
    bound: tuple[str, ...], usr: str, stamp: tuple[tuple[str, int], ...]
) -> tuple[Path, ...]:
    hidden: list[Path] = list(_usr_package_dirs(usr, stamp))
    for path in bound:
        if Path(path).is_relative_to(usr):
            continue  # under /usr: covered by its walk
        hidden += _prefix_dirs_cached(path)
    return tuple(minimal_cover(hidden))
