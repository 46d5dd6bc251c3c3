"""Find base Python interpreters on the host to build task environments (venvs) from.

A venv only links to its base interpreter, so a sandbox must see the interpreter's
`sys.base_prefix` at its own path: `Interpreter.prefix` is that directory.

Sources, in order of preference on equal versions:
uv-managed > pyenv > conda > system. uv and pyenv installs are self-contained under one
prefix that holds nothing else, so mounting it exposes just that Python; a conda prefix also
holds that environment's packages, and the system Python's prefix is /usr (distribution-patched,
often without ensurepip/venv).
"""

from __future__ import annotations

import glob
import json
import os
import re
import subprocess
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Literal, get_args

from pydantic import BaseModel, ConfigDict

from minisandbox.errors import MiniSandboxError
from minisandbox.utils.uv import find_uv

__all__ = [
    "Interpreter",
    "InterpreterKind",
    "ToolchainNotFoundError",
    "clear_cache",
    "discover_interpreters",
    "find_interpreter",
]

InterpreterKind = Literal["uv", "pyenv", "conda", "system"]
KIND_PREFERENCE: tuple[InterpreterKind, ...] = get_args(InterpreterKind)

PROBE_TIMEOUT = 10.0
_UV_OLDEST = (3, 8)  # the oldest Python uv downloads
UV_TIMEOUT = 10.0

_VERSION = re.compile(r"^(\d+)\.(\d+)(?:\.(\d+))?$")
_PYTHON_NAME = re.compile(r"^python3(\.\d+)?$")
# Runs under -I -S (no site, no user env): only the interpreter's own facts.
_PROBE = (
    "import sys, json; print(json.dumps({'version': '%d.%d.%d' % sys.version_info[:3], "
    "'base_prefix': sys.base_prefix, 'executable': sys.executable, "
    "'implementation': sys.implementation.name}))"
)


class ToolchainNotFoundError(MiniSandboxError):
    """No interpreter of the requested version; the message lists what exists and how to
    install one."""


class Interpreter(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    executable: Path  # real path, symlinks resolved
    version: str  # "3.11.7"
    prefix: Path  # sys.base_prefix: mount read-only at its own path in sandboxes
    kind: InterpreterKind

    @property
    def version_tuple(self) -> tuple[int, int, int]:
        major, minor, patch = (int(x) for x in self.version.split("."))
        return major, minor, patch


# ------------------------------------------------------------------ probing (cached per process)

_probe_cache: dict[tuple[str, int], tuple[str, Path] | None] = {}
_cache_lock = threading.Lock()


def clear_cache() -> None:
    """Forget probed interpreters (e.g. after installing a new one)."""
    with _cache_lock:
        _probe_cache.clear()


def _probe(executable: Path) -> tuple[str, Path] | None:
    """(version, base prefix) of a CPython interpreter, or None if it does not run as one."""
    try:
        real = executable.resolve(strict=True)
        stat = real.stat()
    except OSError:
        return None
    if not os.access(real, os.X_OK) or not real.is_file():
        return None
    key = (str(real), stat.st_mtime_ns)
    with _cache_lock:
        if key in _probe_cache:
            return _probe_cache[key]
    result: tuple[str, Path] | None = None
    try:
        proc = subprocess.run(
            [str(real), "-I", "-S", "-c", _PROBE],
            capture_output=True,
            text=True,
            timeout=PROBE_TIMEOUT,
            stdin=subprocess.DEVNULL,
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LC_ALL": "C.UTF-8"},
        )
        if proc.returncode == 0:
            info = json.loads(proc.stdout.strip().splitlines()[-1])
            if info.get("implementation") == "cpython":
                result = (str(info["version"]), Path(info["base_prefix"]))
    except (OSError, subprocess.SubprocessError, ValueError, KeyError, IndexError):
        result = None
    with _cache_lock:
        _probe_cache[key] = result
    return result


# ------------------------------------------------------------------ candidate locations


def _home() -> Path:
    return Path(os.environ.get("HOME") or Path.home())


def _uv_install_dirs() -> list[Path]:
    """Where uv keeps its managed Pythons. `uv python dir` honours uv's own configuration; the
    environment variable and the default location cover a host without a uv binary."""
    dirs = []
    uv = find_uv()
    if uv:
        try:
            proc = subprocess.run(
                [uv, "python", "dir"],
                capture_output=True,
                text=True,
                timeout=UV_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            if proc.returncode == 0 and proc.stdout.strip():
                dirs.append(Path(proc.stdout.strip()))
        except (OSError, subprocess.SubprocessError):
            pass
    if os.environ.get("UV_PYTHON_INSTALL_DIR"):
        dirs.append(Path(os.environ["UV_PYTHON_INSTALL_DIR"]).expanduser())
    data_home = os.environ.get("XDG_DATA_HOME")
    dirs.append(
        Path(data_home) / "uv" / "python" if data_home else _home() / ".local/share/uv/python"
    )
    return list(dict.fromkeys(dirs))


def _uv_candidates() -> list[Path]:
    # Not `uv python list --only-installed`: it also probes every Python on PATH (pyenv shims
    # included) and takes seconds; the install directory holds exactly the managed ones.
    found: list[Path] = []
    for folder in _uv_install_dirs():
        found += _glob_paths(str(folder / "*" / "bin" / "python3"))
    return found


def _pyenv_candidates() -> list[Path]:
    root = Path(os.environ.get("PYENV_ROOT") or _home() / ".pyenv").expanduser()
    return _glob_paths(str(root / "versions" / "*" / "bin" / "python3"))


def _conda_candidates() -> list[Path]:
    roots: list[Path] = []
    if os.environ.get("CONDA_PREFIX"):
        roots.append(Path(os.environ["CONDA_PREFIX"]))
    home = _home()
    for base in (
        home / "miniconda3",
        home / "anaconda3",
        home / "miniforge3",
        home / "mambaforge",
        Path("/opt/conda"),
        Path("/opt/miniconda3"),
        Path("/opt/anaconda3"),
        Path("/opt/miniforge3"),
    ):
        roots.append(base)
        roots += _glob_paths(str(base / "envs" / "*"))
    return [root / "bin" / "python3" for root in roots]


def _system_candidates() -> list[Path]:
    found = []
    for folder in ("/usr/bin", "/usr/local/bin"):
        found += [p for p in _glob_paths(f"{folder}/python3*") if _PYTHON_NAME.match(p.name)]
    return found


def _glob_paths(pattern: str) -> list[Path]:
    return [Path(p) for p in sorted(glob.glob(pattern))]


_CANDIDATES = {
    "uv": _uv_candidates,
    "pyenv": _pyenv_candidates,
    "conda": _conda_candidates,
    "system": _system_candidates,
}


# ------------------------------------------------------------------ public API


def _check_kinds(kinds: Iterable[str] | None) -> list[InterpreterKind]:
    if kinds is None:
        return list(KIND_PREFERENCE)
    wanted = list(dict.fromkeys(kinds))
    unknown = [k for k in wanted if k not in KIND_PREFERENCE]
    if unknown:
        raise ValueError(f"unknown interpreter kind(s) {unknown}; use {list(KIND_PREFERENCE)}")
    return [k for k in KIND_PREFERENCE if k in wanted]


def discover_interpreters(kinds: Iterable[str] | None = None) -> list[Interpreter]:
    """Every working CPython found, one entry per real executable, in preference order
    (uv, pyenv, conda, system) and then by descending version. Nothing is assumed to exist."""
    seen: set[Path] = set()
    found: list[Interpreter] = []
    for kind in _check_kinds(kinds):
        for candidate in _CANDIDATES[kind]():
            try:
                real = candidate.resolve(strict=True)
            except OSError:
                continue
            if real in seen:
                continue
            seen.add(real)
            probed = _probe(real)
            if probed is None or not _VERSION.match(probed[0]):
                continue
            version, prefix = probed
            found.append(Interpreter(executable=real, version=version, prefix=prefix, kind=kind))
    order = {k: i for i, k in enumerate(KIND_PREFERENCE)}
    found.sort(key=lambda i: (order[i.kind], tuple(-x for x in i.version_tuple)))
    return found


def find_interpreter(version: str, *, kinds: Iterable[str] | None = None) -> Interpreter:
    """The interpreter to build a `version` environment with.

    "X.Y.Z": that exact release if present, else the highest X.Y.* (a patch release does not
    change what a pinned environment installs). "X.Y": the highest X.Y.*. On equal versions,
    uv > pyenv > conda > system (see the module docstring).
    """
    m = _VERSION.match(version.strip())
    if not m:
        raise ValueError(f'{version!r} is not a Python version like "3.9" or "3.9.18"')
    major, minor, patch = int(m[1]), int(m[2]), (int(m[3]) if m[3] is not None else None)
    available = discover_interpreters(kinds)
    same_minor = [i for i in available if i.version_tuple[:2] == (major, minor)]
    if patch is not None:
        exact = [i for i in same_minor if i.version_tuple[2] == patch]
        if exact:
            return exact[0]  # already in preference order
    if same_minor:
        best = max(i.version_tuple[2] for i in same_minor)
        return next(i for i in same_minor if i.version_tuple[2] == best)
    raise ToolchainNotFoundError(_not_found_message(version.strip(), available, kinds))


def _not_found_message(
    version: str, available: list[Interpreter], kinds: Iterable[str] | None
) -> str:
    where = f" among kinds {sorted(set(kinds))}" if kinds is not None else ""
    if available:
        listing = "; ".join(f"{i.version} ({i.kind}, {i.executable})" for i in available)
        found = f"Found: {listing}."
    else:
        found = "Found no Python interpreter (looked for uv, pyenv, conda and system ones)."
    m = _VERSION.match(version)
    if m and (int(m[1]), int(m[2])) < _UV_OLDEST:
        # uv's managed builds start at 3.8; pyenv still builds older releases from source.
        how = f"pyenv install {version} (uv provides Python 3.8 and later)"
    else:
        how = f"uv python install {version}"
    return f"No Python {version} interpreter found{where}. {found} Install one with: {how}"
