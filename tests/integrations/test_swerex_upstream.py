"""SWE-ReX's own runtime tests (tests/test_execution.py of the installed release's sdist),
run against MiniSandboxRuntime on a plain sandbox instead of SWE-ReX's RemoteRuntime.

Their file comes from PyPI (the sdist of the installed swe-rex version, which ships its tests),
so this runs where the network is expected: under `scripts/test-stack sweagent`, or with
SWEREX_TESTS naming a directory that holds their test_execution.py. Their conftest.py is not in
the sdist: ours below gives their fixtures (`remote_runtime`, `runtime_with_default_session`)
our runtime, and their `_Action` / `_Command` (a 5 s default timeout).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip(
    "swerex", reason="SWE-ReX is not installed (the `swerex` extra: pip install -e '.[swerex]')"
)
if not (os.environ.get("SWEREX_TESTS") or os.environ.get("MINISANDBOX_STACK") == "sweagent"):
    pytest.skip(
        "downloads SWE-ReX's tests from PyPI: run by scripts/test-stack sweagent "
        "(or set SWEREX_TESTS to a directory holding SWE-ReX's test_execution.py)",
        allow_module_level=True,
    )

# Theirs that cannot hold here: they write a file through the runtime and read it on the host
# (tmp_path), and the sandbox's filesystem is its own.
HOST_FILESYSTEM = {"test_read_write_file", "test_read_large_file"}

PIP_DOWNLOAD = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:"]
PYTEST = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-o", "addopts="]
PYTEST += ["-o", "asyncio_mode=auto", "-p", "no:xdist", "-q"]

CONFTEST = """
import pytest
from swerex.runtime.abstract import BashAction, Command, CreateBashSessionRequest

from minisandbox.integrations.swerex import MiniSandboxDeployment


class _Action(BashAction):
    timeout: float | None = 5


class _Command(Command):
    timeout: float | None = 5


@pytest.fixture
async def remote_runtime():
    deployment = MiniSandboxDeployment()
    await deployment.start()
    try:
        yield deployment.runtime
    finally:
        await deployment.stop()


@pytest.fixture
async def runtime_with_default_session(remote_runtime):
    await remote_runtime.create_session(CreateBashSessionRequest())
    yield remote_runtime
"""


def _their_tests(into: Path) -> Path:
    given = os.environ.get("SWEREX_TESTS")
    if given:
        return Path(given) / "test_execution.py"
    release = version("swe-rex")
    proc = subprocess.run(
        [*PIP_DOWNLOAD, "-d", str(into), f"swe-rex=={release}"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    (sdist,) = into.glob("swe_rex-*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = tar.getmember(f"swe_rex-{release}/tests/test_execution.py")
        extracted = tar.extractfile(member)
        assert extracted is not None
        target = into / "test_execution.py"
        target.write_bytes(extracted.read())
    return target


def test_swerex_own_execution_tests_pass_on_our_runtime(tmp_path: Path) -> None:
    source = _their_tests(tmp_path / "download")
    package = tmp_path / "run" / "tests"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "conftest.py").write_text(CONFTEST)
    shutil.copy(source, package / "test_execution.py")
    report = tmp_path / "report.xml"
    proc = subprocess.run(
        [*PYTEST, f"--junitxml={report}", "tests/test_execution.py"],
        cwd=tmp_path / "run",
        capture_output=True,
        text=True,
        timeout=900,
    )
    cases = ET.parse(report).getroot().iter("testcase")
    outcome: dict[str, str] = {}
    for case in cases:
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome[case.attrib["name"]] = kinds[0] if kinds else "passed"
    failed = {name for name, kind in outcome.items() if kind in ("failure", "error")}
    passed = sum(kind == "passed" for kind in outcome.values())
    others = len(outcome) - passed - len(failed)
    print(
        f"\nSWE-ReX {version('swe-rex')} test_execution.py on MiniSandboxRuntime: {passed} "
        f"passed, {len(failed)} failed {sorted(failed)}, {others} skipped/xfailed"
    )
    assert outcome, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert failed == HOST_FILESYSTEM & set(outcome), proc.stdout[-5000:]
    assert passed >= len(outcome) - len(HOST_FILESYSTEM) - 3, outcome  # (their own xfails)
