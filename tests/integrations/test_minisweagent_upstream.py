"""mini-swe-agent's own tests, run against MiniSandboxEnvironment instead of LocalEnvironment.

Its agent tests (tests/agents/) and LocalEnvironment's tests (tests/environments/test_local.py)
build `LocalEnvironment` by name; a plugin given to their pytest makes that name ours (a plain
sandbox: the host's system, an empty /testbed), so every command of theirs runs sandboxed. Their
tests are not in the sdist: they come from a checkout of mini-swe-agent at the installed
release's tag, which `scripts/test-stack minisweagent` clones (or MINISWEAGENT_TESTS names one).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from importlib.metadata import version
from pathlib import Path

import pytest

pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (extra: minisweagent)")

ROOT = Path(__file__).resolve().parents[2]
CHECKOUT = os.environ.get("MINISWEAGENT_TESTS") or (
    str(ROOT / ".venv-stacks" / "src" / "mini-swe-agent")
    if os.environ.get("MINISANDBOX_STACK") == "minisweagent"
    else ""
)
if not CHECKOUT:
    pytest.skip(
        "needs mini-swe-agent's repository (its tests are not in the sdist): run by "
        "scripts/test-stack minisweagent (or set MINISWEAGENT_TESTS to a checkout of the "
        "installed release's tag)",
        allow_module_level=True,
    )

# test_local.py's tests that read the host, not the environment: a host temp directory as the
# working directory (and files checked there), the host's current directory, host variables
# inherited, a child's pid looked up on the host. test_minisweagent_environment.py has each
# behaviour against the sandbox.
HOST_BOUND = {
    "test_local_environment_existing_env_variables",
    "test_local_environment_custom_cwd",
    "test_local_environment_cwd_parameter_override",
    "test_local_environment_default_cwd",
    "test_local_environment_timeout_kills_child_process",
    "test_local_environment_file_operations",
}

PLUGIN = '''
import minisweagent.environments.local as local

from minisandbox.integrations.minisweagent import MiniSandboxEnvironment

MADE = []


class PlainMiniSandbox(MiniSandboxEnvironment):
    """LocalEnvironment's place: a plain sandbox (LocalEnvironment has no task either)."""

    def __init__(self, **kwargs):
        super().__init__(plain=True, **kwargs)
        MADE.append(self)


local.LocalEnvironment = PlainMiniSandbox


def pytest_sessionfinish(session):
    for env in MADE:
        env.cleanup()
    print(f"\\nminisandbox environments made: {len(MADE)}")
'''


def _run_theirs(tmp_path: Path, *paths: str) -> tuple[dict[str, str], str]:
    """Their tests at `paths` with our environment: {test id: outcome}, and the output."""
    (tmp_path / "msb_as_local.py").write_text(PLUGIN)
    report = tmp_path / "report.xml"
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])),
        "MSWEA_SILENT_STARTUP": "1",
    }
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:xdist",
            "-p",
            "msb_as_local",
            "-o",
            "addopts=",
            "-s",
            f"--junitxml={report}",
            *paths,
        ],
        cwd=CHECKOUT,  # (their config tests read src/minisweagent/config/ from here)
        capture_output=True,
        text=True,
        env=env,
        timeout=1500,
    )
    assert report.is_file(), proc.stdout[-3000:] + proc.stderr[-3000:]
    outcome: dict[str, str] = {}
    for case in ET.parse(report).getroot().iter("testcase"):
        kinds = [child.tag for child in case if child.tag in ("failure", "error", "skipped")]
        outcome[case.attrib["name"]] = kinds[0] if kinds else "passed"
    return outcome, proc.stdout


@pytest.fixture(scope="module", autouse=True)
def _same_release() -> None:
    init = Path(CHECKOUT) / "src" / "minisweagent" / "__init__.py"
    assert f'__version__ = "{version("mini-swe-agent")}"' in init.read_text(), (
        f"{CHECKOUT} is not a checkout of the installed mini-swe-agent {version('mini-swe-agent')}"
    )


@pytest.mark.timeout(1800)
def test_their_agent_tests_pass_on_our_environment(tmp_path: Path) -> None:
    outcome, out = _run_theirs(tmp_path, "tests/agents")
    failed = sorted(name for name, kind in outcome.items() if kind in ("failure", "error"))
    passed = sum(kind == "passed" for kind in outcome.values())
    print(f"\nmini-swe-agent {version('mini-swe-agent')} tests/agents: {passed} passed, {failed}")
    assert not failed, out[-5000:]
    assert passed >= 100, outcome  # (181 in 2.4.6)
    made = [line for line in out.splitlines() if line.startswith("minisandbox environments")]
    assert made and int(made[-1].rsplit(" ", 1)[1]) > 0, out[-2000:]  # ours ran theirs


@pytest.mark.timeout(600)
def test_their_local_environment_tests_on_our_environment(tmp_path: Path) -> None:
    outcome, out = _run_theirs(tmp_path, "tests/environments/test_local.py")
    failed = {name for name, kind in outcome.items() if kind in ("failure", "error")}
    passed = sum(kind == "passed" for kind in outcome.values())
    print(f"\ntest_local.py: {passed} passed, {len(failed)} failed (host-bound) {sorted(failed)}")
    assert failed == HOST_BOUND, out[-5000:]
    assert passed == len(outcome) - len(HOST_BOUND), outcome
