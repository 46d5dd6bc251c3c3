"""Interpreter discovery on this host: real interpreters, probed for real."""

from __future__ import annotations

import platform
import sys
from pathlib import Path

import pytest

from minisandbox.envs.toolchains import (
    Interpreter,
    ToolchainNotFoundError,
    clear_cache,
    discover_interpreters,
    find_interpreter,
)
from minisandbox.errors import MiniSandboxError

OWN_VERSION = platform.python_version()
OWN_MINOR = ".".join(OWN_VERSION.split(".")[:2])


@pytest.fixture(scope="module")
def found() -> list[Interpreter]:
    interpreters = discover_interpreters()
    if not interpreters:
        pytest.skip("no base Python interpreter found on this host")
    return interpreters


def test_discovery_finds_this_interpreter(found: list[Interpreter]) -> None:
    versions = {i.version for i in found}
    own_base = Path(sys.base_prefix).resolve()
    if OWN_VERSION not in versions and not any(i.prefix.resolve() == own_base for i in found):
        pytest.skip(f"this interpreter ({sys.base_prefix}) lives where discovery does not look")
    assert OWN_VERSION in versions
    for interpreter in found:
        assert interpreter.executable.is_absolute() and interpreter.executable.is_file()
        assert interpreter.executable == interpreter.executable.resolve()
        assert interpreter.prefix.is_dir()
        assert interpreter.version.count(".") == 2
    assert len({i.executable for i in found}) == len(found)


def test_find_minor_returns_highest_patch(found: list[Interpreter]) -> None:
    if not any(i.version.startswith("3.11.") for i in found):
        pytest.skip("no Python 3.11 here")
    interpreter = find_interpreter("3.11")
    assert interpreter.version.startswith("3.11.")
    assert (interpreter.prefix / "bin" / "python3.11").exists()
    best = max(i.version_tuple for i in found if i.version.startswith("3.11."))
    assert interpreter.version_tuple == best


def test_exact_and_missing_patch(found: list[Interpreter]) -> None:
    target = found[0]
    assert find_interpreter(target.version).version == target.version
    major, minor, _ = target.version_tuple
    # A patch release that does not exist falls back to the highest of that minor.
    fallback = find_interpreter(f"{major}.{minor}.999")
    assert fallback.version_tuple[:2] == (major, minor)


def test_kinds_filter(found: list[Interpreter]) -> None:
    kind = found[-1].kind
    assert {i.kind for i in discover_interpreters(kinds=[kind])} == {kind}
    with pytest.raises(ValueError, match="unknown interpreter kind"):
        discover_interpreters(kinds=["docker"])


def test_bogus_version_names_the_install_command() -> None:
    with pytest.raises(ToolchainNotFoundError) as info:
        find_interpreter("3.99")
    message = str(info.value)
    assert "3.99" in message and "uv python install 3.99" in message
    assert isinstance(info.value, MiniSandboxError)
    for interpreter in discover_interpreters():
        assert interpreter.version in message
    with pytest.raises(ValueError, match="not a Python version"):
        find_interpreter("latest")


def test_uv_install_dir_is_preferred_on_ties(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, found: list[Interpreter]
) -> None:
    """An interpreter under the uv install dir is kind "uv", and wins over the same version
    found elsewhere (the install dir here holds a link to a real interpreter)."""
    target = found[0]
    bin_dir = tmp_path / f"cpython-{target.version}-linux-x86_64-gnu" / "bin"
    bin_dir.mkdir(parents=True)
    (bin_dir / "python3").symlink_to(target.executable)
    monkeypatch.setenv("UV_PYTHON_INSTALL_DIR", str(tmp_path))
    clear_cache()
    interpreters = discover_interpreters()
    mine = [i for i in interpreters if i.executable == target.executable]
    assert len(mine) == 1 and mine[0].kind == "uv"
    assert interpreters[0].kind == "uv"
    assert find_interpreter(target.version).kind == "uv"


def test_probe_cache_is_per_process() -> None:
    first = discover_interpreters()
    assert discover_interpreters() == first


def test_old_missing_version_names_pyenv() -> None:
    """uv downloads no Python older than 3.8 (140 SWE-bench Verified exports pin 3.6): the
    message for one names a command that can install it."""
    with pytest.raises(ToolchainNotFoundError) as info:
        find_interpreter("3.4")
    message = str(info.value)
    assert "pyenv install 3.4" in message and "uv python install" not in message
