"""Evaluation: real patches graded in real task sandboxes of the bundled examples.

The edge cases are the ways a reward goes wrong: a skipped FAIL_TO_PASS test, a test name that
is a prefix of another, a log claiming success while the test command failed, a patch that does
not apply, a run that never ends, test files changed by the patch.
"""

from __future__ import annotations

import time

import pytest

from minisandbox.evaluation.evaluator import Evaluator, grade
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.eval_script import make_eval_script
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

pytestmark = pytest.mark.timeout(300)


def new_file_patch(path: str, text: str) -> str:
    lines = text.splitlines()
    body = "".join(f"+{line}\n" for line in lines)
    return (
        f"diff --git a/{path} b/{path}\nnew file mode 100644\n--- /dev/null\n+++ b/{path}\n"
        f"@@ -0,0 +1,{len(lines)} @@\n{body}"
    )


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in load_tasks("examples") if t.id == "examples__semverkit-1")


@pytest.fixture
def evaluator(settings: BuildSettings, built: list) -> Evaluator:
    return Evaluator(Builder(settings), timeout=120)


async def test_gold_resolves_and_empty_does_not(evaluator: Evaluator, task: Task) -> None:
    gold = await evaluator.evaluate(task, task.gold_patch)
    assert gold.status == "resolved" and gold.reward == 1.0, gold.reason + gold.log[-2000:]
    assert gold.swebench_resolved and gold.patch_applied and gold.test_exit_code == 0
    assert gold.apply_command == "git apply --verbose"
    assert set(gold.tests_status["FAIL_TO_PASS"]["success"]) == set(task.fail_to_pass)
    report = gold.swebench_report(task.gold_patch)[task.id]
    assert report["resolved"] and report["patch_successfully_applied"]

    empty = await evaluator.evaluate(task, "")
    assert empty.status == "unresolved" and empty.reward == 0.0 and empty.empty_patch
    assert empty.test_exit_code == 1  # the tests ran and some failed
    assert empty.tests_status["FAIL_TO_PASS"]["failure"] == task.fail_to_pass
    assert "FAIL_TO_PASS" in empty.reason


async def test_a_recipes_pytest_addopts_survives_the_guarded_grader(
    evaluator: Evaluator, task: Task
) -> None:
    """The guarded grader adds its plugin through PYTEST_ADDOPTS; a recipe's own value (an
    inferred one's `-rA`, for a test command that lacks it) must stay beside it."""
    assert "-rA" in task.test_cmd, "the control: the example's command asks for it"
    bare = task.model_copy(
        update={
            "id": "examples__semverkit-addopts",
            "test_cmd": task.test_cmd.replace("-rA", ""),
            "eval_script": None,
            "env": task.env.model_copy(update={"env": {"PYTEST_ADDOPTS": "-rA"}}),
        }
    )
    gold = await evaluator.evaluate(bare, bare.gold_patch)
    assert gold.status == "resolved", gold.reason + gold.log[-2000:]


async def test_patch_that_does_not_apply_is_an_error(evaluator: Evaluator, task: Task) -> None:
    broken = task.gold_patch.replace("-    return max(allowed)", "-    return min(allowed)")
    r = await evaluator.evaluate(task, broken)
    assert r.status == "error" and r.reward == 0.0 and not r.patch_applied
    assert "does not apply" in r.reason
    # every fallback of the harness was tried, in its order
    assert r.apply_output.count("$ ") == 3 and "patch --batch --fuzz=5" in r.apply_output


async def test_fuzzy_patch_applies_through_the_fallback(evaluator: Evaluator, task: Task) -> None:
    # A context line of each hunk is off: git apply refuses both, `patch --fuzz` takes them.
    fuzzy = task.gold_patch.replace(
        ' """Pick the newest release of a package that satisfies a requirement."""',
        ' """Pick the newest release of a package (docstring changed since)."""',
    ).replace("     allowed = [v for", "     allowed = [v  for")
    r = await evaluator.evaluate(task, fuzzy)
    assert r.patch_applied and r.apply_command == "patch --batch --fuzz=5 -p1 -i", r.apply_output
    assert r.status == "resolved", r.reason


async def test_partial_reject_is_kept_as_the_harness_does(evaluator: Evaluator, task: Task) -> None:
    # Only the first hunk is off: `git apply --reject` applies the second and fails, and the
    # harness then runs `patch` over that half-applied tree, which fails on the second hunk.
    fuzzy = task.gold_patch.replace(
        ' """Pick the newest release of a package that satisfies a requirement."""',
        ' """Pick the newest release of a package (docstring changed since)."""',
    )
    r = await evaluator.evaluate(task, fuzzy)
    assert r.status == "error" and not r.patch_applied
    assert "Rejected hunk #1" in r.apply_output and "Hunk #2 FAILED" in r.apply_output


async def test_skipped_fail_to_pass_fails_the_instance(evaluator: Evaluator, task: Task) -> None:
    # A conftest.py (not a test file, so the reset keeps it) that skips every test: swebench
    # ignores skipped tests and calls this resolved; the reward must not.
    skip_all = new_file_patch(
        "conftest.py",
        "import pytest\n\n\ndef pytest_collection_modifyitems(items):\n"
        "    for item in items:\n        item.add_marker(pytest.mark.skip(reason='nope'))\n",
    )
    r = await evaluator.evaluate(task, skip_all)
    assert r.patch_applied and "5 skipped" in r.log
    # pytest -rA reports skips by location, not by test: the tests are missing from the log
    assert r.status == "unresolved" and r.reward == 0.0 and not r.swebench_resolved
    assert "not run" in r.reason


def test_skipped_test_named_in_the_log_fails_the_instance(task: Task) -> None:
    # Runners that name skipped tests (pytest -v, django's runner): swebench ignores a skipped
    # test, so with every FAIL_TO_PASS test skipped it calls the instance resolved.
    t = task.model_copy(update={"fail_to_pass": ["tests/t.py::test_a"], "pass_to_pass": []})
    g = grade(t, _log("SKIPPED tests/t.py::test_a"))
    assert g.swebench_resolved
    assert not g.resolved and "FAIL_TO_PASS tests/t.py::test_a: SKIPPED" in g.reason


async def test_log_claiming_success_while_the_command_failed(
    evaluator: Evaluator, task: Task
) -> None:
    # The patch prints a PASSED line for every test, then kills pytest before any test runs.
    lines = [f"PASSED {t}" for t in task.fail_to_pass + task.pass_to_pass]
    forge = new_file_patch(
        "conftest.py",
        "import os\nimport sys\n\n\ndef pytest_configure(config):\n"
        f"    sys.stdout.write({chr(10).join(lines)!r} + '\\n')\n"
        "    sys.stdout.flush()\n    os._exit(3)\n",
    )
    r = await evaluator.evaluate(task, forge)
    assert r.test_exit_code == 3
    assert all(r.test_results.get(t) == "PASSED" for t in task.fail_to_pass)
    assert r.swebench_resolved  # the log alone fools the harness
    assert r.status == "unresolved" and "did not complete (exit status 3)" in r.reason


async def test_patched_test_files_are_reset(evaluator: Evaluator, task: Task) -> None:
    # Rewriting the failing tests to pass does not help: the eval script restores them.
    cheat = (
        "diff --git a/tests/test_semverkit.py b/tests/test_semverkit.py\n"
        "--- a/tests/test_semverkit.py\n+++ b/tests/test_semverkit.py\n"
    )
    r0 = await evaluator.evaluate(task, "")
    assert r0.status == "unresolved"
    # Build the cheat from the real file: every assert becomes `assert True`.
    async with evaluator.builder.sandbox(task) as sb:
        original = (await sb.read_file("/testbed/tests/test_semverkit.py")).decode()
    lines = original.splitlines()
    hunk = [f"@@ -1,{len(lines)} +1,{len(lines)} @@\n"]
    for line in lines:
        if line.strip().startswith("assert "):
            indent = line[: len(line) - len(line.lstrip())]
            hunk += [f"-{line}\n", f"+{indent}assert True\n"]
        else:
            hunk.append(f" {line}\n")
    r = await evaluator.evaluate(task, cheat + "".join(hunk))
    assert r.patch_applied, r.apply_output
    assert r.status == "unresolved"
    assert r.tests_status["FAIL_TO_PASS"]["failure"] == task.fail_to_pass


async def test_timeout_kills_the_run_and_counts_unresolved(
    settings: BuildSettings, built: list, task: Task
) -> None:
    hang = new_file_patch(
        "conftest.py",
        "import subprocess\nimport time\n\n\ndef pytest_configure(config):\n"
        "    subprocess.Popen(['sleep', '1000'])\n    time.sleep(1000)\n",
    )
    evaluator = Evaluator(Builder(settings), timeout=3)
    began = time.monotonic()
    r = await evaluator.evaluate(task, hang)
    assert time.monotonic() - began < 30
    assert r.timed_out and r.status == "unresolved" and r.reward == 0.0
    assert "timed out after 3 s" in r.reason and "Timeout error" in r.log


async def test_published_swebench_script_runs_unchanged(evaluator: Evaluator, task: Task) -> None:
    # The shape of SWE-bench's eval_script column: conda activation, a reinstall of the
    # package, then the generated test procedure. Our venv stands in for conda's `testbed`;
    # the reinstall works offline.
    ours = make_eval_script(task).split("\n", 2)[2]  # without the shebang and `set` line
    script = (
        "#!/bin/bash\nset -uxo pipefail\nsource /opt/miniconda3/bin/activate\n"
        "conda activate testbed\ncd /testbed\n"
        "git config --global --add safe.directory /testbed\n"
        "python -m pip install -e .\n" + ours
    )
    swebench_task = task.model_copy(update={"eval_script": script})
    r = await evaluator.evaluate(swebench_task, swebench_task.gold_patch)
    assert r.status == "resolved", r.reason + r.log[-3000:]
    assert "Successfully installed semverkit" in r.log
    assert "conda activate testbed" in r.log
    assert "+ return" not in r.log  # the exit-status hook leaves no trace in the log


async def test_an_eval_script_that_pins_the_runner_resolves(
    settings: BuildSettings, built: list, task: Task
) -> None:
    """astropy 3.1's eval script installs `pytest<7.2` before its tests. Guarded grading makes
    the runner read-only: the script's own install then failed half-way (pytest's command
    removed, "pytest: command not found", gold unresolved). The pin is installed first."""
    ours = make_eval_script(task).split("\n", 2)[2]
    pin = "python -m pip install -q 'pytest<8.3'"
    marker = ": '>>>>> Start Test Output'"
    assert marker in ours
    script = "#!/bin/bash\nset -uxo pipefail\n" + ours.replace(marker, f"{pin}\n{marker}", 1)
    pinned = task.model_copy(update={"id": "examples__semverkit-pin", "eval_script": script})
    builder = Builder(settings)
    built_pinned = await builder.build(pinned)
    assert built_pinned.status == "built", built_pinned.error
    for grading in ("guarded", "harness"):
        r = await Evaluator(builder, timeout=120, grading=grading).evaluate(
            pinned, pinned.gold_patch
        )
        assert r.status == "resolved" and not r.tampering, (grading, r.reason, r.log[-3000:])
        assert "pytest-8.2" in r.log or "pytest 8.2" in r.log, r.log[-3000:]  # the pin held


# ---------------------------------------------------------------- grading a log


def _log(body: str) -> str:
    return f"+ : '>>>>> Start Test Output'\n{body}\n+ : '>>>>> End Test Output'\n"


def test_test_names_match_exactly_never_by_prefix(task: Task) -> None:
    t = task.model_copy(update={"fail_to_pass": ["tests/t.py::test_a"], "pass_to_pass": []})
    g = grade(t, _log("PASSED tests/t.py::test_ab\nPASSED tests/t.py::test_a_b"))
    assert not g.resolved and not g.swebench_resolved
    assert g.tests_status["FAIL_TO_PASS"]["failure"] == ["tests/t.py::test_a"]
    g = grade(t, _log("PASSED tests/t.py::test_ab\nPASSED tests/t.py::test_a"))
    assert g.resolved


def test_log_without_the_test_section_is_not_graded(task: Task) -> None:
    t = task.model_copy(update={"fail_to_pass": ["tests/t.py::test_a"], "pass_to_pass": []})
    g = grade(t, "PASSED tests/t.py::test_a\n")
    assert not g.resolved and not g.tests_found and "no test section" in g.reason
    g = grade(t, ">>>>> Tests Timed Out\n" + _log("PASSED tests/t.py::test_a"))
    assert not g.resolved and not g.tests_found


def test_xfail_counts_as_passed_and_missing_as_failed(task: Task) -> None:
    t = task.model_copy(
        update={"fail_to_pass": ["tests/t.py::test_a"], "pass_to_pass": ["tests/t.py::test_b"]}
    )
    assert grade(t, _log("XFAIL tests/t.py::test_a\nPASSED tests/t.py::test_b")).resolved
    g = grade(t, _log("PASSED tests/t.py::test_a"))
    assert not g.resolved and g.tests_status["PASS_TO_PASS"]["failure"] == ["tests/t.py::test_b"]


async def test_task_sandbox_has_what_the_official_images_have(
    evaluator: Evaluator, task: Task
) -> None:
    async with evaluator.builder.sandbox(task) as sb:
        r = await sb.execute(
            "set -u; source /opt/miniconda3/bin/activate && conda activate testbed && "
            "command -v python && readlink /opt/miniconda3/envs/testbed && "
            "git commit -qam wip --allow-empty && git log -1 --format=%an",
            cwd="/testbed",
        )
        assert r.exit_code == 0, r.output
        assert r.stdout.split() == ["/opt/venv/bin/python", "/opt/venv", "SWE-bench"]
        r = await sb.execute("source /opt/miniconda3/bin/activate; conda install numpy")
        assert r.exit_code != 0 and "not available" in r.stderr


async def test_a_fix_that_adds_a_dependency_installs_it_offline(
    evaluator: Evaluator, task: Task
) -> None:
    # The gold patch declares and imports a new dependency (six); the eval script reinstalls
    # the package, as SWE-bench's do. The harness would fetch six from PyPI; here its wheel was
    # fetched at build time into a layer only evaluation sandboxes mount.
    gold = task.gold_patch.replace("@@ -1,6 +1,7 @@", "@@ -1,6 +1,8 @@").replace(
        "+from packaging.version import Version\n",
        "+from packaging.version import Version\n+import six  # noqa: F401\n",
    ).replace("@@ -8,9 +9,9 @@", "@@ -8,9 +10,9 @@") + (
        "diff --git a/pyproject.toml b/pyproject.toml\n--- a/pyproject.toml\n"
        "+++ b/pyproject.toml\n@@ -6,5 +6,5 @@\n"
        ' name = "semverkit"\n version = "0.1.0"\n requires-python = ">=3.8"\n'
        '-dependencies = ["packaging>=21"]\n+dependencies = ["packaging>=21", "six"]\n \n'
    )
    ours = make_eval_script(task).split("\n", 2)[2]
    script = "#!/bin/bash\nset -uxo pipefail\ncd /testbed\npython -m pip install -e .\n" + ours
    variant = task.model_copy(update={"gold_patch": gold, "eval_script": script})
    built = await evaluator.builder.build(variant)
    assert built.status != "failed", built.error
    r = await evaluator.evaluate(variant, gold)
    assert r.status == "resolved", r.reason + r.log[-3000:]
    assert "Successfully installed" in r.log and "six" in r.log
    # The agent's sandbox has neither the wheel nor the package.
    async with evaluator.builder.sandbox(variant) as sb:
        probe = await sb.execute("ls /opt/minisandbox/; python -c 'import six'")
        assert "eval-wheelhouse" not in probe.stdout and probe.exit_code != 0


# ------------------------------------------------------------------ the procedure on a fake runner


class _ScriptedRunner:
    """A SandboxAPI that answers from a script: for the evaluator's own decisions (which
    apply command won, how an exit status and a log are graded), not for sandboxing."""

    pid = None

    def __init__(self, apply_codes: list[int], log: str, rc: str | None) -> None:
        self.apply_codes, self.log, self.rc = list(apply_codes), log, rc
        self.files: dict[str, bytes | str] = {}
        self.commands: list[str] = []

    async def execute(self, command, **_kw):  # type: ignore[no-untyped-def]
        from minisandbox.sandbox.sandbox import ExecResult

        text = command if isinstance(command, str) else " ".join(command)
        self.commands.append(text)
        dry = "--numstat" in text or "--dry-run" in text  # guarded grading's reading of it
        if text.startswith(("git apply", "patch ")):
            code = 0 if dry else self.apply_codes.pop(0)
            return ExecResult(exit_code=code, stdout="", stderr="")
        return ExecResult(exit_code=0, stdout=self.log, stderr="")

    async def write_file(self, path: str, data: bytes | str, *, mode: int | None = None) -> None:
        self.files[path] = data

    async def read_text(self, path: str, **_kw) -> str:  # type: ignore[no-untyped-def]
        from minisandbox.errors import SandboxFileError

        if self.rc is None:
            raise SandboxFileError(f"{path}: no such file")
        return self.rc


def _scripted_log(task: Task, status: str) -> str:
    from minisandbox.tasks.eval_script import END_MARKER, START_MARKER

    lines = [f"{status} {t}" for t in task.fail_to_pass]
    lines += [f"PASSED {t}" for t in task.pass_to_pass]
    return "\n".join([f"+ : '{START_MARKER}'", *lines, f"+ : '{END_MARKER}'"])


@pytest.mark.parametrize(
    ("apply_codes", "status", "rc", "want_cmd", "resolved"),
    [
        ([0], "PASSED", "1", "git apply --verbose", True),
        ([1, 0], "PASSED", "0", "git apply --verbose --reject", True),
        ([1, 1, 0], "PASSED", "0", "patch --batch --fuzz=5 -p1 -i", True),
        ([0], "FAILED", "1", "git apply --verbose", False),
        ([0], "PASSED", "137", "git apply --verbose", False),  # killed: the log is not trusted
        ([0], "PASSED", "2", "git apply --verbose", False),  # pytest interrupted
    ],
)
async def test_the_procedure_on_a_scripted_runner(
    task: Task,
    apply_codes: list[int],
    status: str,
    rc: str | None,
    want_cmd: str,
    resolved: bool,
) -> None:
    runner = _ScriptedRunner(apply_codes, _scripted_log(task, status), rc)
    result = await Evaluator(timeout=60).run_in(runner, task, task.gold_patch)
    assert result.apply_command == want_cmd and result.patch_applied
    assert result.resolved is resolved and result.reward == (1.0 if resolved else 0.0)
    assert runner.files["/eval.sh"] == make_eval_script(task)
    applied = [c for c in runner.commands if c.startswith(("git apply", "patch "))]
    assert len([c for c in applied if "--numstat" not in c and "--dry-run" not in c]) == len(
        apply_codes
    )


async def test_a_patch_no_command_applies_is_an_error_on_a_scripted_runner(task: Task) -> None:
    runner = _ScriptedRunner([1, 1, 1], "", "0")
    result = await Evaluator(timeout=60).run_in(runner, task, task.gold_patch)
    assert result.status == "error" and not result.patch_applied and "/eval.sh" not in runner.files
