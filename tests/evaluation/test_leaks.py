"""Validation's leak check: the gold patch's rare lines searched for in a task's agent sandbox
outside /testbed (issue: the host's installed packages must not hold the answer)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest

from minisandbox.evaluation.validation import (
    LEAK_LINE_MIN,
    check_leaks,
    judge,
    leak_lines,
    leaking_files,
)
from minisandbox.tasks.builder import Builder
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

TASK = "examples__semverkit-1"


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in load_tasks("examples") if t.id == TASK)


@pytest.fixture
def host_dir(layer_dir: Path) -> Path:
    """A host directory a root caller's sandbox uid can read (conftest's layer_dir)."""
    return layer_dir


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    for p in [path, *path.parents]:
        if p == Path(tempfile.gettempdir()):
            break
        os.chmod(p, 0o755 if p.is_dir() else 0o644)


def test_leak_lines_are_long_added_lines() -> None:
    patch = (
        "--- a/x.py\n+++ b/x.py\n@@ -1,2 +1,3 @@\n"
        "-    raise ValueError('this old line is removed, not added by the fix')\n"
        "+    raise ValueError(\"'name' may not be empty.\")\n"
        "+    x = 1\n"
        "+    # ------------------------------------------------------------\n"
        "+    raise ValueError(\"'name' may not be empty.\")\n"
    )
    assert leak_lines(patch) == ["raise ValueError(\"'name' may not be empty.\")"]
    assert all(len(line) >= LEAK_LINE_MIN for line in leak_lines(patch))


def test_a_file_leaks_with_two_rare_lines_or_the_only_one() -> None:
    found = [("/a", "l1"), ("/a", "l2"), ("/b", "l1"), ("/b", "l1")]
    assert leaking_files(found, searched=3) == ["/a: 2"]
    assert leaking_files([("/b", "l1")], searched=1) == ["/b: 1"]


async def test_no_leak_in_a_clean_task(builder: Builder, task: Task) -> None:
    check = await check_leaks(builder, task)
    assert check.lines > 0, "no gold line was searched for (positive control)"
    assert check.leaks == [], check.leaks


async def test_a_later_release_bound_from_the_host_is_found(
    builder: Builder, task: Task, host_dir: Path
) -> None:
    """Software on the host that vendors the project's fixed release (bound read-only as the
    host's /usr is) leaks; the verdict names it and the task is not valid."""
    rare = leak_lines(task.gold_patch)
    _write(host_dir / "vendor" / "semverkit_fixed.py", "\n".join(["# later release", *rare]))
    check = await check_leaks(builder, task, ro_paths=[host_dir / "vendor"])
    assert check.leaks == [f"{host_dir}/vendor/semverkit_fixed.py: {check.lines}"], check
    from minisandbox.evaluation.evaluator import EvalResult

    ok = EvalResult(
        instance_id=task.id, status="resolved", resolved=True, swebench_resolved=True, reward=1.0
    )
    no = EvalResult(
        instance_id=task.id, status="unresolved", resolved=False, swebench_resolved=False, reward=0
    )
    verdict = judge(task, ok, no, None, check)
    assert not verdict.valid and "the fix is readable outside /testbed" in verdict.reason


async def test_a_later_release_installed_into_a_bound_interpreter_is_not_readable(
    builder: Builder, task: Task, host_dir: Path
) -> None:
    """The same release pip-installed into an interpreter prefix the sandbox binds: its
    site-packages is covered, so the leak check finds nothing, while the prefix's standard
    library stays readable."""
    rare = leak_lines(task.gold_patch)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    prefix = host_dir / "python"
    _write(prefix / "lib" / version / "os.py", "# the standard library\n")
    _write(prefix / "lib" / version / "site-packages" / "semverkit" / "fixed.py", "\n".join(rare))
    assert (await check_leaks(builder, task, ro_paths=[prefix])).leaks == []
    # The positive control: the same files in a directory that is not a prefix are found.
    other = host_dir / "not-a-prefix"
    _write(other / "site" / "semverkit" / "fixed.py", "\n".join(rare))
    assert (await check_leaks(builder, task, ro_paths=[other])).leaks != []
