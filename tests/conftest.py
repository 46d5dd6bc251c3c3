"""Shared fixtures. Every test here runs real bwrap sandboxes: nothing is mocked."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

from minisandbox import Sandbox, SandboxConfig
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.examples import materialize_mirror
from minisandbox.tasks.loaders import load_tasks

# ---------------------------------------------------------------- the session's temp directory


def _sweep_dead_sessions(tmp: Path) -> None:
    """Remove what a session killed before its janitor could run left (its pid is dead)."""
    for entry in tmp.glob("msbs*-*"):
        pid = entry.name[4:].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            fast_remove(entry)


def _sweep_dead_plants() -> None:
    """Remove what attacks_hostpython.py planted outside the session directory (the host's /usr,
    /var/tmp) for a run that was killed (the pid in the name is dead)."""
    for place in ("/usr/lib", "/usr/lib/python3/dist-packages", "/var/tmp"):
        for entry in Path(place).glob("minisandbox-attack-*"):
            pid = entry.name.removeprefix("minisandbox-attack-").split("-", 1)[0]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists() and not entry.is_symlink():
                shutil.rmtree(entry, ignore_errors=True)


def pytest_configure(config: pytest.Config) -> None:
    """Everything the tests make in temp directories goes into one directory of this session
    (pytest's tmp_path too), which a janitor process (the sandboxes' own, cleanup.py) removes
    once this process is gone, however it ended: a killed or timed-out run leaves nothing."""
    from minisandbox.sandbox import cleanup

    if hasattr(config, "workerinput"):
        return  # an xdist worker: the controller's session directory is its TMPDIR already
    tmp = Path(tempfile.gettempdir())
    for place in {tmp, Path("/tmp")}:  # (/tmp: the cluster tests' Ray directory, at worst)
        _sweep_dead_sessions(place)
    _sweep_dead_plants()
    session = Path(tempfile.mkdtemp(prefix=f"msbs{os.getpid()}-", dir=tmp))
    os.chmod(session, 0o755)  # the unprivileged uid's runner and venv live below it
    janitor = subprocess.Popen(
        [sys.executable, "-I", "-S", cleanup.__file__, str(session)],
        stdin=subprocess.PIPE,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # outlives a Ctrl-C or SIGKILL aimed at our process group
    )
    config.stash[_JANITOR] = janitor
    tempfile.tempdir = str(session)
    # Child processes too (the CLI runs, Ray's nodes and their agents): their runtime
    # directories are then the session's, which tests look into and the janitor removes.
    os.environ["TMPDIR"] = str(session)
    # The CLI runs of the tests start no warm process (cli/warm.py) that would outlive the
    # session; tests/cli/test_warm.py starts and stops its own.
    os.environ["MINISANDBOX_WARM"] = "0"
    if config.option.basetemp is None:
        config.option.basetemp = str(session / "pytest")


def pytest_unconfigure(config: pytest.Config) -> None:
    janitor = config.stash.get(_JANITOR, None)
    if janitor is not None and janitor.stdin is not None:
        janitor.stdin.close()  # it removes the session's directory now


_JANITOR = pytest.StashKey[subprocess.Popen]()


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
    from minisandbox.utils.safefs import discard_tree

    discard_tree(path)


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
def home() -> Path:
    # Not removed here: the janitor removes it with the session's directory once the run has
    # ended (its tens of thousands of files took 40 s of the run's wall time under load).
    return Path(tempfile.mkdtemp(prefix="msb-build-"))


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


@pytest.fixture
def builder(settings: BuildSettings, built: list) -> Builder:
    """A Builder on the session's store, with the example tasks built."""
    return Builder(settings)


@pytest.fixture
def use_settings(settings: BuildSettings, built: list, monkeypatch: pytest.MonkeyPatch) -> None:
    """The session's store in the environment, for code that makes its own Builder (a config
    file, an integration made by name, cannot carry one)."""
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_CACHE", str(settings.cache))
    if settings.git_mirror is not None:
        monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))


@pytest.fixture
def dataset_loads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Each dataset load the integrations make (integrations.tasks.load_tasks), recorded as
    made "on a loop" or "off the loop": a load can be a download, and must not block an event
    loop."""
    import minisandbox.integrations.tasks as tasks_module

    real = tasks_module.load_tasks
    seen: list[str] = []

    def load_tasks(*args: Any, **kwargs: Any) -> Any:
        try:
            asyncio.get_running_loop()
            seen.append("on a loop")
        except RuntimeError:
            seen.append("off the loop")
        return real(*args, **kwargs)

    monkeypatch.setattr(tasks_module, "load_tasks", load_tasks)
    return seen


def fast_remove(path: Path) -> None:
    """Remove a tree the tests made: `rm -rf` first (a store and node cache hold tens of
    thousands of files; C removes them twice as fast, so a session's teardown stays far from
    the per-test timeout on a loaded machine), then remove_tree for what it could not remove
    (the mode-000 work directories overlayfs leaves, when we are not root)."""
    from minisandbox.utils.safefs import discard_tree

    subprocess.run(["rm", "-rf", "--", str(path)], capture_output=True, check=False)
    if os.path.lexists(path):
        discard_tree(path)


def run_cli(
    *args: str, stdin: bytes | None = None, timeout: float = 600
) -> subprocess.CompletedProcess:
    # The limit only ends a hung command: `cache verify` re-hashes the whole shared store,
    # 45 s alone on a loaded machine.
    return subprocess.run(
        [*CLI, *args], input=stdin, capture_output=True, timeout=timeout, check=False
    )
