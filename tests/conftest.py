"""Shared fixtures. Every test here runs real bwrap sandboxes: nothing is mocked."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks


@pytest.fixture
async def sandbox() -> AsyncIterator[Sandbox]:
    async with Sandbox() as sb:
        yield sb


@pytest.fixture
def layer_dir() -> Iterator[Path]:
    """A directory a root caller's sandbox (an unprivileged uid) can also traverse: pytest's
    own tmp_path lives under a mode-700 directory when we run as root."""
    path = Path(tempfile.mkdtemp(prefix="msb-test-"))
    os.chmod(path, 0o755)
    yield path
    from minisandbox.sandbox.runtime import remove_tree

    remove_tree(path)


def give_to_sandbox(path: Path) -> None:
    """Make a layer writable for the sandbox's root, whoever runs the tests: a root caller's
    sandbox runs as an unprivileged uid and cannot write root's files."""
    owner = SandboxConfig().layer_owner()
    if owner is None:
        return
    for dirpath, dirnames, filenames in os.walk(path):
        for name in [*dirnames, *filenames]:
            os.chown(os.path.join(dirpath, name), *owner, follow_symlinks=False)
    os.chown(path, *owner)


# --- built example tasks, shared by the builder and CLI tests (building takes ~15 s)


@pytest.fixture(scope="session")
def home() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="msb-build-"))
    yield path
    from minisandbox.sandbox.runtime import remove_tree

    remove_tree(path)


@pytest.fixture(scope="session")
def settings(home: Path) -> BuildSettings:
    return BuildSettings(
        store=home / "store", cache=home / "layers", git_mirror=materialize_mirror(home / "mirror")
    )


@pytest.fixture(scope="session")
def built(settings: BuildSettings) -> list:
    builder = Builder(settings)
    tasks = load_tasks("examples")

    async def go() -> list:
        return await asyncio.gather(*(builder.build(t) for t in tasks))

    results = asyncio.run(go())
    assert [r.status for r in results] == ["built"] * 3, [r.error for r in results]
    return results


CLI = [sys.executable, "-m", "minisandbox.cli"]


def run_cli(
    *args: str, stdin: bytes | None = None, timeout: float = 60
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, timeout=timeout, check=False
    )
