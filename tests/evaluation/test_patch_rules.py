"""The guarded grading's pure parts: which paths a patch names, which of them it may not change,
and how the grader plugin's record is read against the log. The real runs are in
test_reward_hacks.py; these pin the rules' edges."""

from __future__ import annotations

import json

import pytest

from minisandbox.evaluation.patch_rules import config_refusal, refusals, shadowing
from minisandbox.evaluation.tampering import check_pytest_run
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.patches import PatchedFile, patched_files
from minisandbox.tasks.specs import Task


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in load_tasks("examples") if t.id == "examples__semverkit-1")


def test_patched_files_reads_git_headers() -> None:
    patch = (
        "diff --git a/a.py b/b.py\nsimilarity index 100%\nrename from a.py\nrename to b.py\n"
        'diff --git "a/sp ace\\tx.py" "b/sp ace\\tx.py"\nnew file mode 120000\n--- /dev/null\n'
        '+++ "b/sp ace\\tx.py"\n@@ -0,0 +1 @@\n+.git\n'
        "diff --git a/c.py b/c.py\ndeleted file mode 100644\n--- a/c.py\n+++ /dev/null\n"
        "@@ -1 +0,0 @@\n--- not a header\n"
    )
    got = [(f.path, f.old_path, f.change, f.mode) for f in patched_files(patch)]
    assert got == [
        ("b.py", "a.py", "rename", None),
        ("sp ace\tx.py", None, "create", "120000"),
        ("c.py", None, "delete", None),
    ]


@pytest.mark.parametrize(
    ("path", "why"),
    [
        (".git/hooks/post-checkout", "inside .git/"),
        ("../outside.py", "outside the checkout"),
        ("/etc/passwd", "outside the checkout"),
        ("src/conftest.py", "conftest.py"),
        ("conftest/__init__.py", "conftest package"),
        ("pytest.ini", "pytest's configuration"),
        ("sub/.pytest.ini", "pytest's configuration"),
        (".coveragerc", "coverage"),
        ("src/sitecustomize.py", "sitecustomize"),
        ("usercustomize.py", "usercustomize"),
        ("src/x.pth", ".pth"),
        ("pytest.py", "shadow the test runner"),
        ("src/_pytest/runner.py", "shadow the test runner"),
        (".gitattributes", ".gitattributes"),
        ("tests/test_semverkit.py", "hidden tests"),
        ("tests/helpers.py", "hidden tests"),
        ("tests/data/x.json", "hidden tests"),
        ("runtests.py", "test runner"),
        ("sympy/testing/runtests.py", "test runner"),
    ],
)
def test_infrastructure_is_refused(task: Task, path: str, why: str) -> None:
    got = refusals(task, [PatchedFile(path=path, change="create")], set())
    assert len(got) == 1 and why in got[0], got


def test_the_code_under_test_is_not(task: Task) -> None:
    files = [
        *patched_files(task.gold_patch),
        PatchedFile(path="src/semverkit/new_module.py", change="create"),
        PatchedFile(path="setup.cfg"),
        PatchedFile(path="README.md"),
        PatchedFile(path="docs/tests.rst"),  # a doc about tests, not a test directory
    ]
    assert refusals(task, files, set()) == []
    # In pytest's own repository, its runner is the code under test.
    assert refusals(task, [PatchedFile(path="src/_pytest/runner.py")], {"src", "src/_pytest"}) == []
    for t in load_tasks("examples"):
        assert refusals(t, patched_files(t.gold_patch), set()) == [], t.id


def test_a_rename_away_from_infrastructure_is_refused(task: Task) -> None:
    moved = PatchedFile(path="notes.py", old_path="tests/conftest.py", change="rename")
    assert refusals(task, [moved], set())


def test_config_sections() -> None:
    base = "[metadata]\nname = x\n\n[tool:pytest]\naddopts = -q\n"
    assert config_refusal("setup.cfg", base, base.replace("name = x", "name = y")) is None
    assert config_refusal("setup.cfg", base, base + "[pytest]\naddopts = -p evil\n")
    assert config_refusal("setup.cfg", base, base.replace("-q", "-q -p evil"))
    assert config_refusal("tox.ini", None, "[pytest]\naddopts = -p evil\n")
    assert config_refusal("tox.ini", None, "[flake8]\nmax-line-length = 99\n") is None
    toml = '[project]\nname = "x"\n'
    assert config_refusal("pyproject.toml", toml, toml + 'version = "2"\n') is None
    assert config_refusal("pyproject.toml", toml, toml + "[tool.pytest.ini_options]\nx = 1\n")
    assert config_refusal("pyproject.toml", toml, "[broken")  # unreadable: any change counts


def test_shadowing_is_about_new_top_level_modules() -> None:
    new = [
        PatchedFile(path="six.py", change="create"),
        PatchedFile(path="src/json/__init__.py", change="create"),
    ]
    got = shadowing(new, ["", "src"], {"six", "json"})
    assert len(got) == 2
    assert shadowing([PatchedFile(path="six.py")], [""], {"six"}) == []  # the repository's own
    assert shadowing([PatchedFile(path="pkg/six.py", change="create")], [""], {"six"}) == []


def _record(*records: dict) -> str:
    return "".join(json.dumps({**r, "token": r.get("token", "t")}) + "\n" for r in records)


def _run_of(task: Task, text: str | None, rc: int = 0, status: str = "PASSED") -> list[str]:
    log = {t: status for t in [*task.fail_to_pass, *task.pass_to_pass]}
    blobs = {"tests/test_semverkit.py": "0" * 40}
    return check_pytest_run(task, text, log_results=log, test_exit_code=rc, base_blobs=blobs)


def test_a_faithful_record_raises_nothing(task: Task) -> None:
    tests = [
        {"e": "test", "id": t, "when": w, "exc": None, "kind": None, "outcome": "passed"}
        for t in [*task.fail_to_pass, *task.pass_to_pass]
        for w in ("setup", "call", "teardown")
    ]
    text = _record({"e": "start"}, *tests, {"e": "end", "exitstatus": 0, "replaced": []})
    assert _run_of(task, text) == []
    # and each disagreement is named
    assert "did not run" in _run_of(task, None)[0]
    assert any("never finished" in t for t in _run_of(task, _record({"e": "start"}, *tests)))
    assert any(
        "exited 0" in t for t in _run_of(task, text.replace('"exitstatus": 0', '"exitstatus": 1'))
    )
    forged = text + _record({"e": "start", "token": "u"})
    assert any("other than its plugin" in t for t in _run_of(task, forged))
    failed = text.replace(
        '"when": "call", "exc": null, "kind": null',
        '"when": "call", "exc": "AssertionError", "kind": "error"',
        1,
    )
    got = _run_of(task, failed)
    assert any("reported as passed" in t for t in got) and any("pytest saw" in t for t in got)


def test_old_pytests_instance_nodes_name_the_same_tests(task: Task) -> None:
    """pytest 3 records a method as "a.py::C::()::test" and reports it as "a.py::C::test" (the
    log's and the dataset's name): the same test, not one that never ran."""
    named = task.model_copy(update={"fail_to_pass": ["tests/test_semverkit.py::TestA::test_x"]})

    def run(test_id: str) -> list[str]:
        tests = [
            {"e": "test", "id": test_id, "when": w, "exc": None, "kind": None, "outcome": "passed"}
            for w in ("setup", "call", "teardown")
        ] + [
            {"e": "test", "id": t, "when": "call", "exc": None, "kind": None, "outcome": "passed"}
            for t in named.pass_to_pass
        ]
        text = _record({"e": "start"}, *tests, {"e": "end", "exitstatus": 0, "replaced": []})
        return _run_of(named, text)

    assert run("tests/test_semverkit.py::TestA::()::test_x") == []
    assert run("tests/test_semverkit.py::TestA::test_x") == []
    # Another test's record still does not stand for it.
    assert any("never ran" in t for t in run("tests/test_semverkit.py::TestB::()::test_x"))


def test_headers_git_reads_as_we_do() -> None:
    # unquoted names with spaces and no ---/+++ (an empty new file); mnemonic prefixes
    spaced = "diff --git a/my dir/x.py b/my dir/x.py\nnew file mode 100644\n"
    assert [f.path for f in patched_files(spaced)] == ["my dir/x.py"]
    mnemonic = (
        "diff --git i/pkg/a.py w/pkg/a.py\n--- i/pkg/a.py\n+++ w/pkg/a.py\n@@ -1 +1 @@\n-a\n+b\n"
    )
    assert [f.path for f in patched_files(mnemonic)] == ["pkg/a.py"]


def test_ini_sections_are_read_as_pytest_reads_them() -> None:
    # configparser would name this section "tool:pytest] # "; pytest's reader names it tool:pytest
    assert config_refusal("setup.cfg", "", "[tool:pytest] # ]\naddopts = -p evil\n")
    assert config_refusal("tox.ini", "[tox]\n", "[tox]\n\n[testenv]\nsetenv = PYTEST_PLUGINS=x\n")


def test_test_support_anywhere_is_refused(task: Task) -> None:
    for path in (
        "astropy/tests/helper.py",
        "lib/matplotlib/testing/decorators.py",
        "django/test/testcases.py",
        "xarray/testing.py",
    ):
        assert refusals(task, [PatchedFile(path=path)], set()), path
    # a doctest id names a module of the code, which stays the patch's to change
    doctest = task.model_copy(update={"pass_to_pass": ["src/semverkit/__init__.py::semverkit.f"]})
    assert refusals(doctest, [PatchedFile(path="src/semverkit/__init__.py")], set()) == []


def test_a_malformed_record_is_tampering_not_a_crash(task: Task) -> None:
    text = _record({"e": "start", "token": [1]}, {"e": "end", "replaced": 7})
    assert _run_of(task, text)
