"""The SWE-smith-format sample made here (bench/swesmith_generate.py: SWE-smith's procedural
generators on three repositories of its profile list, validated by its rules) loads as SWE-smith
records: bug patch, reversed gold, SWE-smith's parser, the hidden FAIL_TO_PASS files."""

from __future__ import annotations

import re
from pathlib import Path

from minisandbox.evaluation.evaluator import swesmith_log_parser
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.patches import reverse_patch
from minisandbox.tasks.specs import hidden_tests

SAMPLE = Path(__file__).parents[1] / "data" / "swesmith-sample" / "tasks.jsonl"
SWESMITH_ID = re.compile(
    r"(?P<owner>[\w-]+)__(?P<repo>[\w.-]+)\.(?P<commit>[0-9a-f]{8})\.func_pm_\w+__\w{8}"
)


def test_the_sample_loads_as_swesmith_tasks() -> None:
    tasks = load_tasks(SAMPLE)
    assert len({t.repo for t in tasks}) == 3 and len(tasks) == 6
    for task in tasks:
        m = SWESMITH_ID.fullmatch(task.id)
        assert m, task.id
        assert task.repo == f"{m['owner']}/{m['repo']}" and task.base_commit.startswith(m["commit"])
        assert task.bug_patch.startswith("--- a/") and task.gold_patch == reverse_patch(
            task.bug_patch
        )
        assert reverse_patch(task.gold_patch) == task.bug_patch
        assert task.log_parser == "swesmith" and "--verbose" in task.test_cmd
        assert task.fail_to_pass and task.pass_to_pass
        assert hidden_tests(task) == sorted({t.split("::")[0] for t in task.fail_to_pass})


def test_swesmith_parser_reads_pytest_verbose_lines() -> None:
    (task, *_) = load_tasks(SAMPLE)
    log = (
        "test_addict.py::DictTests::test_copy PASSED [ 10%]\n"
        "test_addict.py::DictTests::test_set FAILED [ 20%]\n"
        "FAILED test_addict.py::DictTests::test_set - AssertionError\n"
    )
    assert swesmith_log_parser(task)(log) == {
        "test_addict.py::DictTests::test_copy": "PASSED",
        "test_addict.py::DictTests::test_set": "FAILED",
    }
