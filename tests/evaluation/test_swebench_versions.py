"""Grading with whichever swebench is installed: the current 5.x release, installed for real
next to the 4.1 of the dev environment, grades the same logs the same way (where the two
releases agree), and recipes do not change with it (the spec table ships as data)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from minisandbox.evaluation.evaluator import grade
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task
from minisandbox.utils.uv import uv_binary

pytestmark = pytest.mark.timeout(300)

# A task, then logs: (FAIL_TO_PASS outcome, PASS_TO_PASS outcome) as pytest -rA prints them.
_CASES = {
    "both pass": ("PASSED", "PASSED"),
    "fail_to_pass fails": ("FAILED", "PASSED"),
    "pass_to_pass fails": ("PASSED", "FAILED"),
    "xfail counts": ("XFAIL", "PASSED"),
}

_SCRIPT = """
import json, sys
from minisandbox.evaluation.evaluator import grade
from minisandbox.tasks.loaders import load_tasks
from minisandbox.utils.swebench_imports import swebench_grading
import importlib.metadata
task = load_tasks("examples")[0]
logs = json.loads(sys.stdin.read())
out = {}
for name, log in logs.items():
    g = grade(task, log)
    out[name] = [g.resolved, g.swebench_resolved]
spaced = task.model_copy(update={
    "log_parser": "sphinx", "fail_to_pass": ["t.py::test_y"], "pass_to_pass": ["t.py::test_x[a,"],
})
log = "+ : '>>>>> Start Test Output'\\nPASSED t.py::test_y\\nPASSED t.py::test_x[a, b]\\n"
g = grade(spaced, log + "+ : '>>>>> End Test Output'\\n")
out["spaced ids"] = [g.resolved, g.swebench_resolved]
print(json.dumps({
    "version": importlib.metadata.version("swebench"),
    "grading": swebench_grading().grading.__file__,
    "verdicts": out,
    "recipe": task.env.model_dump(),
    "lite_recipe": load_tasks(sys.argv[1], instance_ids=[sys.argv[2]])[0].env.model_dump(),
}))
"""


def _log(f2p: str, p2p: str, task: Task) -> str:
    lines = [f"{f2p} {t}" for t in task.fail_to_pass] + [f"{p2p} {t}" for t in task.pass_to_pass]
    body = "".join(f"{line}\n" for line in lines)
    return f"+ : '>>>>> Start Test Output'\n{body}+ : '>>>>> End Test Output'\n"


def test_swebench_5_grades_as_4_1_does(tmp_path: Path) -> None:
    target = tmp_path / "swebench5"
    r = subprocess.run(
        [
            str(uv_binary()),
            "pip",
            "install",
            "--no-deps",
            "--target",
            str(target),
            "swebench>=5,<6",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    task = load_tasks("examples")[0]
    logs = {name: _log(a, b, task) for name, (a, b) in _CASES.items()}
    # A record of another split, without an export: its recipe comes from the shipped table.
    records = tmp_path / "lite.jsonl"
    records.write_text(
        json.dumps(
            {
                "instance_id": "pallets__flask-4045",
                "repo": "pallets/flask",
                "base_commit": "d8c37f43724cd9fb0870f77877b7c4c7e38a19e0",
                "patch": "",
                "test_patch": "diff --git a/tests/test_basic.py b/tests/test_basic.py\n",
                "FAIL_TO_PASS": "[]",
                "PASS_TO_PASS": "[]",
                "version": "2.0",
            }
        )
        + "\n"
    )
    env = {**os.environ, "PYTHONPATH": str(target)}
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, str(records), "pallets__flask-4045"],
        input=json.dumps(logs),
        capture_output=True,
        text=True,
        env=env,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    five = json.loads(r.stdout)
    assert five["version"].startswith("5.") and five["grading"].startswith(str(target))
    here = {
        name: [grade(task, log).resolved, grade(task, log).swebench_resolved]
        for name, log in logs.items()
    }
    # An id with a space, as the datasets hold it (cut at the space by 4.x's parsers, which
    # 5.x no longer cuts): the same verdict under both.
    spaced = task.model_copy(
        update={
            "log_parser": "sphinx",
            "fail_to_pass": ["t.py::test_y"],
            "pass_to_pass": ["t.py::test_x[a,"],
        }
    )
    log = "+ : '>>>>> Start Test Output'\nPASSED t.py::test_y\nPASSED t.py::test_x[a, b]\n"
    g = grade(spaced, log + "+ : '>>>>> End Test Output'\n")
    here["spaced ids"] = [g.resolved, g.swebench_resolved]
    assert here["spaced ids"][0] is True
    assert five["verdicts"] == here, (five["verdicts"], here)
    assert here["both pass"] == [True, True] and here["fail_to_pass fails"] == [False, False]
    assert five["recipe"] == task.env.model_dump()
    lite = load_tasks(records, instance_ids=["pallets__flask-4045"])[0]
    assert five["lite_recipe"] == lite.env.model_dump()
    assert lite.env.from_repository is not None
