"""Evaluating a patch for a task, as SWE-bench's container harness does, in a fresh sandbox.

The procedure is the harness's: write the patch, apply it with `git apply`, then the harness's
fallbacks; run the task's eval script (the dataset's own `eval_script` when it has one: it
resets the test files, applies the test patch and runs the tests between two markers); parse the
test output with swebench's log parser; grade FAIL_TO_PASS / PASS_TO_PASS with swebench's
`get_eval_tests_report`. `swebench_resolved` is exactly swebench's verdict on the same log.

`resolved` is that verdict, made stricter in two places where swebench trusts what it should not
(both are reward hacks for a policy, and neither happens for a correct patch):
- a FAIL_TO_PASS or PASS_TO_PASS test must have *passed* (or xfailed); swebench ignores a test
  that was skipped (all FAIL_TO_PASS tests skipped counts as resolved there);
- the test command must have completed: it must exit 0 or 1 (tests ran, some may have failed).
  Any other status (not found, killed, pytest's internal/usage errors, interrupted collection)
  makes the run unresolved whatever the log claims.

A timeout kills the whole process tree (the sandbox's command group) and counts as unresolved,
with the reason. The patch never sees the network: task sandboxes have none; what a test suite
needs (e.g. httpbin) is served inside the sandbox on loopback (see `services`).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import re
import time
from collections.abc import Awaitable, Callable
from contextlib import AbstractAsyncContextManager
from types import SimpleNamespace
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from minisandbox.errors import CommandTimeoutError, GradingError, MiniSandboxError, SandboxFileError
from minisandbox.evaluation import guard
from minisandbox.evaluation.purposes import EVAL_ENV, graded_task, purpose_layers
from minisandbox.evaluation.services import start_services
from minisandbox.evaluation.tampering import runs_pytest, runs_sympy
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.tasks.builder import Builder, TaskLayers, launch
from minisandbox.tasks.eval_script import END_MARKER, START_MARKER, make_eval_script
from minisandbox.tasks.specs import Task
from minisandbox.utils.aio import all_or_none
from minisandbox.utils.swebench_imports import repo_parser, swebench_grading

# The harness's ways of applying a patch, in its order (swebench.harness.run_evaluation).
APPLY_COMMANDS = (
    "git apply --verbose",
    "git apply --verbose --reject",
    "patch --batch --fuzz=5 -p1 -i",
)
# Strings the harness writes into a log when a step failed; a log holding one is not graded.
_BAD_CODES = (
    ">>>>> Patch Apply Failed",
    ">>>>> Reset Failed",
    ">>>>> Tests Errored",
    ">>>>> Tests Timed Out",
)
DEFAULT_TIMEOUT = 1800.0  # the harness's default
PATCH_PATH = "/tmp/patch.diff"
EVAL_SCRIPT_PATH = "/eval.sh"
_HOOK_PATH = "/tmp/.minisandbox-eval-hook.sh"
_RC_PATH = "/tmp/.minisandbox-test-rc"
_RC_MAX_BYTES = 64
# Sourced by bash before the eval script (BASH_ENV). Bash looks functions up before builtins,
# so this `:` still does nothing (status 0) and the script stays byte-for-byte the published
# one; at the end marker it records the exit status of the command before it, the test command.
# Its own lines are kept out of the xtrace log.
_HOOK = f"""\
: () {{
    {{ __msb_rc=$?; __msb_x=${{-//[^x]/}}; set +x; }} 2>/dev/null
    if [ "${{1-}}" = '{END_MARKER}' ]; then echo "$__msb_rc" > {_RC_PATH}; fi
    if [ -n "$__msb_x" ]; then set -x; fi
}}
"""

Status = Literal["resolved", "unresolved", "error"]
Grading = Literal["guarded", "harness"]
GRADINGS: tuple[Grading, ...] = ("guarded", "harness")


class Grade(BaseModel):
    """What a test log says about a task's tests."""

    resolved: bool
    swebench_resolved: bool
    tests_found: bool = Field(description="the log holds the test section between the markers")
    reason: str = ""
    test_results: dict[str, str] = Field(default_factory=dict, description="test → status")
    tests_status: dict[str, dict[str, list[str]]] = Field(
        default_factory=dict, description="swebench's FAIL_TO_PASS/PASS_TO_PASS success/failure"
    )


class EvalResult(BaseModel):
    """The verdict on one patch for one task. `reward` is 1.0 when resolved, else 0.0."""

    instance_id: str
    status: Status
    resolved: bool
    reward: float
    reason: str = ""
    swebench_resolved: bool = False
    empty_patch: bool = False
    patch_applied: bool = False
    apply_command: str | None = None
    apply_output: str = ""
    timed_out: bool = False
    test_exit_code: int | None = None
    test_results: dict[str, str] = Field(default_factory=dict)
    tests_status: dict[str, dict[str, list[str]]] = Field(default_factory=dict)
    log: str = ""
    duration_s: float = 0.0
    grading: Grading = "guarded"
    tampering: list[str] = Field(
        default_factory=list,
        description="each guard that fired (guarded grading): a rule of what a patch may "
        "change (`path: ...`), or a disagreement of the test run (`runtime: ...`)",
    )

    @classmethod
    def not_graded(cls, instance_id: str, patch: str | None, reason: str = "") -> EvalResult:
        """An error result for `patch`, graded by nothing yet: what an evaluation starts from
        and what it ends as when its sandbox never ran the tests."""
        # The harness's rule: None or "" is empty (whitespace is a patch that fails).
        return cls(
            instance_id=instance_id,
            status="error",
            resolved=False,
            reward=0.0,
            empty_patch=not patch,
            reason=reason,
        )

    def swebench_report(self, model_patch: str | None) -> dict[str, Any]:
        """This result as swebench's per-instance `report.json`."""
        entry: dict[str, Any] = {
            "patch_is_None": model_patch is None,
            "patch_exists": model_patch is not None,
            "patch_successfully_applied": self.patch_applied,
            "resolved": self.resolved,
        }
        if self.tests_status:
            entry["tests_status"] = self.tests_status
        # Ours beside swebench's fields (`resolved` is our reward's verdict).
        entry["reward"] = self.reward
        entry["swebench_resolved"] = self.swebench_resolved
        entry["grading"] = self.grading
        entry["tampering"] = self.tampering
        return {self.instance_id: entry}


# ---------------------------------------------------------------- grading


def _swebench() -> SimpleNamespace:
    try:
        light = swebench_grading()
    except ImportError as e:
        raise GradingError(
            f"evaluation uses swebench's log parsers and grading, which did not import ({e}): "
            "pip install 'swebench>=4.1'"
        ) from None
    constants = light.constants  # the enums grading compares against come from its own load
    return SimpleNamespace(
        grading=light.grading,
        python_parsers=light.python_parsers,
        FAIL_ONLY_REPOS=constants.FAIL_ONLY_REPOS,
        EvalType=constants.EvalType,
        ResolvedStatus=constants.ResolvedStatus,
    )


def log_parser(task: Task) -> Callable[[str], dict[str, str]]:
    """swebench's parser named by the task (`pytest` → `parse_log_pytest`), else its repo's;
    `swesmith`: SWE-smith's (swesmith_log_parser)."""
    if task.log_parser == "swesmith":
        return swesmith_log_parser(task)
    sb = _swebench()
    name = f"parse_log_{task.log_parser.removeprefix('parse_log_')}"
    fn = getattr(sb.python_parsers, name, None)
    for module_name in ("javascript", "go", "java", "c", "php", "ruby", "rust"):
        if fn is not None:
            break
        try:  # (the whole of swebench, imported only for another language's parser)
            module = importlib.import_module(f"swebench.harness.log_parsers.{module_name}")
        except ImportError:  # a language this swebench version does not have
            continue
        fn = getattr(module, name, None)
    if fn is None:
        fn = repo_parser(task.repo)
    if fn is None:
        raise GradingError(f"task {task.id}: swebench has no log parser {name!r}")
    # Parsers take the test spec; the Python ones do not read it, the others read these fields.
    spec = SimpleNamespace(
        instance_id=task.id, repo=task.repo, version=task.version, test_cmd=task.test_cmd
    )
    return lambda log: fn(log, spec)


_SWESMITH_STATUSES = ("FAILED", "PASSED", "SKIPPED", "ERROR", "XFAIL")
_VERBOSE_LINE = re.compile(rf"^(\S+)\s+({'|'.join(_SWESMITH_STATUSES)})")


def swesmith_log_parser(task: Task) -> Callable[[str], dict[str, str]]:
    """SWE-smith's Python parser: its profile's own when `swesmith` is installed and knows the
    repository; else the same rule, `<test id> <STATUS>` lines of `pytest --verbose`."""
    try:
        from swesmith.profiles import registry  # (optional: the `swesmith` extra)

        return registry.get(task.id.rsplit(".", 1)[0]).log_parser
    except (ImportError, KeyError):
        pass

    def parse(log: str) -> dict[str, str]:
        found: dict[str, str] = {}
        for line in log.splitlines():
            m = _VERBOSE_LINE.match(line)
            if m:
                found[m[1]] = m[2]
        return found

    return parse


def _passed(status: str | None) -> bool:
    return status in ("PASSED", "XFAIL")


def grade(task: Task, log: str, *, test_exit_code: int | None = None) -> Grade:
    """Grade a test log as swebench's `get_logs_eval` + `get_eval_report` do, then strictly."""
    sb = _swebench()
    bad = [code for code in _BAD_CODES if code in log]
    if bad:
        return Grade(resolved=False, swebench_resolved=False, tests_found=False, reason=bad[0])
    if START_MARKER not in log or END_MARKER not in log:
        return Grade(
            resolved=False,
            swebench_resolved=False,
            tests_found=False,
            reason="the log has no test section: the eval script did not reach the tests",
        )
    parse = log_parser(task)
    section = log.split(START_MARKER)[1].split(END_MARKER)[0]
    results = parse(section) or parse(log)  # the harness's fallback: the whole log
    fail_only = task.eval_type == "fail_only" or task.repo in sb.FAIL_ONLY_REPOS
    eval_type = sb.EvalType.FAIL_ONLY if fail_only else sb.EvalType.PASS_AND_FAIL
    gold = {"FAIL_TO_PASS": task.fail_to_pass, "PASS_TO_PASS": task.pass_to_pass}
    report = sb.grading.get_eval_tests_report(results, gold, eval_type=eval_type)
    swebench_resolved = sb.grading.get_resolution_status(report) == sb.ResolvedStatus.FULL.value
    reasons = []
    status = _statuses(results)
    if not fail_only:
        for kind, tests in gold.items():
            not_passed = [t for t in tests if not _passed(status(t))]
            if not_passed:
                t = not_passed[0]
                more = f" and {len(not_passed) - 1} more" if len(not_passed) > 1 else ""
                reasons.append(f"{kind} {t}: {status(t) or 'not run'}{more}")
    elif not swebench_resolved:
        failed = report["FAIL_TO_PASS"]["failure"] + report["PASS_TO_PASS"]["failure"]
        reasons.append(f"failed: {', '.join(failed[:3])}")
    if test_exit_code is not None and test_exit_code not in (0, 1):
        reasons.append(f"the test command did not complete (exit status {test_exit_code})")
    resolved = swebench_resolved and not reasons
    return Grade(
        resolved=resolved,
        swebench_resolved=swebench_resolved,
        tests_found=True,
        reason="; ".join(reasons),
        test_results=results,
        tests_status=report,
    )


def _statuses(results: dict[str, str]) -> Callable[[str], str | None]:
    """A test id's status in `results`. The datasets' ids were made by swebench 4.x's parsers,
    which kept a reported id only up to its first space (`test_x[a,` for `test_x[a, b]`);
    5.x keeps it whole. An id missing as such is looked up as 4.x would have kept it (the
    last such test reported wins, as in 4.x's table)."""
    cut: dict[str, str] = {}
    for test, state in results.items():
        if " " in test:
            cut[test.split(" ", 1)[0]] = state
    return lambda t: results.get(t) or cut.get(t)


# ---------------------------------------------------------------- evaluating


class Evaluator:
    """Evaluates patches for tasks, each in a fresh sandbox of its task. `on_phase(task_id,
    phase)` is told "starting sandbox", "applying the patch" and "running tests" (for
    progress displays). `builder` (made on first use when not given) is the store of the
    tasks' layers; `Runtime.evaluate` runs the same procedure on any backend."""

    def __init__(
        self,
        builder: Builder | None = None,
        *,
        timeout: float = DEFAULT_TIMEOUT,
        on_phase: Callable[[str, str], None] | None = None,
        grading: Grading = "guarded",
    ):
        if grading not in GRADINGS:
            raise ValueError(f"grading must be one of {', '.join(GRADINGS)}, not {grading!r}")
        self._builder = builder
        self.timeout = timeout
        self.on_phase = on_phase
        self.grading: Grading = grading

    @property
    def builder(self) -> Builder:
        if self._builder is None:
            self._builder = Builder()
        return self._builder

    async def evaluate(
        self,
        task: Task,
        patch: str | None,
        *,
        build: bool = True,
        run: Callable[[TaskLayers, Task], Awaitable[EvalResult]] | None = None,
    ) -> EvalResult:
        """Grade `patch` for `task` in a fresh evaluation sandbox (evaluation.purposes), its
        missing layers built first when `build`; `run(layers, graded_task)` starts it (default:
        on this host). An error result when the task could not be built or started."""
        began = time.monotonic()
        self.phase(task.id, "starting sandbox")
        try:
            layers = await purpose_layers(self.builder, task, "evaluation", build=build)
            graded = graded_task(self.builder, task, "evaluation")
        except MiniSandboxError as e:
            result = self.not_graded(task.id, patch, e)
        else:
            if run is None:
                builder = self.builder
                result = await self.evaluate_in(lambda: launch(builder, layers), graded, patch)
            else:
                result = await run(layers, graded)
        result.duration_s = round(time.monotonic() - began, 3)
        return result

    def not_graded(self, task_id: str, patch: str | None, error: Exception) -> EvalResult:
        result = EvalResult.not_graded(task_id, patch, f"{type(error).__name__}: {error}")
        result.grading = self.grading
        return result

    async def evaluate_in(
        self,
        open_sandbox: Callable[[], AbstractAsyncContextManager[SandboxAPI]],
        task: Task,
        patch: str | None,
    ) -> EvalResult:
        """The procedure (`run_in`) in the sandbox `open_sandbox()` gives, `task` as graded; an
        error result, with what it got to, when the sandbox fails."""
        began = time.monotonic()
        result = EvalResult.not_graded(task.id, patch)
        result.grading = self.grading
        try:
            async with open_sandbox() as sb:
                await self._run(sb, task, patch or "", result)
        except MiniSandboxError as e:
            result.status, result.reason = "error", f"{type(e).__name__}: {e}"
        result.duration_s = round(time.monotonic() - began, 3)
        return result

    def phase(self, task_id: str, phase: str) -> None:
        if self.on_phase is not None:
            self.on_phase(task_id, phase)

    async def run_in(self, sb: SandboxAPI, task: Task, patch: str | None) -> EvalResult:
        """The harness's procedure in `sb` (a fresh sandbox of the task, `task` as graded):
        apply `patch`, run the eval script with the task's services, grade the log. Guarded
        grading adds its checks (evaluation.guard) around it; whatever they find, the tests
        still run, so that `swebench_resolved` is the harness's verdict on the same patch.

        Raises:
            MiniSandboxError: the sandbox failed (`evaluate_in` makes it an error result).
        """
        result = EvalResult.not_graded(task.id, patch)
        await self._run(sb, task, patch or "", result)
        return result

    async def _run(self, sb: SandboxAPI, task: Task, patch: str, result: EvalResult) -> None:
        """`run_in`, into `result` (what it got to stays there when the sandbox fails)."""
        result.grading = self.grading
        base = None
        if self.grading == "guarded":
            await guard.install_runner_pins(sb, task, EVAL_ENV)
            base = await guard.base_state(sb, task)
        if result.empty_patch:
            result.patch_applied = True  # nothing to apply: the tests run on the base commit
        else:
            self.phase(task.id, "applying the patch")
            await sb.write_file(PATCH_PATH, patch if patch.endswith("\n") else patch + "\n")
            if base is not None:
                result.tampering += await guard.check_patch(sb, task, PATCH_PATH, patch, base)
            if not await self._apply(sb, result, base, task):
                result.status, result.reason = "error", "the patch does not apply"
                return
            if base is not None:
                result.tampering += await guard.check_configs(sb, patch)
        self.phase(task.id, "running tests")
        grader_env = {}
        if base is not None and runs_pytest(task):
            tox = "tox" in task.test_cmd.split()
            grader_env = await guard.install_plugin(sb, base, tox=tox)
        elif base is not None and runs_sympy(task):
            grader_env = await guard.install_sympy_hook(sb, base)
        await self._run_tests(sb, task, result, grader_env)
        if result.timed_out:
            result.status = "unresolved"
            result.reason = f"the tests timed out after {self.timeout:g} s (process tree killed)"
            result.reward = 0.0
            return
        # Absent: the end marker never ran. The tests could have replaced it (a link to
        # /dev/zero, a FIFO, a huge file): read_file refuses those, and an exit status is short.
        with contextlib.suppress(SandboxFileError):
            rc = (await sb.read_text(_RC_PATH, max_bytes=_RC_MAX_BYTES)).strip()
            if rc.lstrip("-").isdigit():
                result.test_exit_code = int(rc)
        g = grade(task, result.log, test_exit_code=result.test_exit_code)
        if base is not None and grader_env:
            result.tampering += await guard.check_run(
                sb,
                task,
                base,
                log_results=g.test_results,
                test_exit_code=result.test_exit_code,
                patch=patch,
                parse=log_parser(task),
            )
        self._verdict(result, g)

    async def _run_tests(
        self, sb: SandboxAPI, task: Task, result: EvalResult, grader_env: dict[str, str]
    ) -> None:
        """The eval script, with the task's services (and the grader's plugin): its log into
        `result`, or that it timed out."""
        await sb.write_file(EVAL_SCRIPT_PATH, make_eval_script(task))
        await sb.write_file(_HOOK_PATH, _HOOK)
        async with start_services(sb, task) as service_env:
            env = {"BASH_ENV": _HOOK_PATH, **service_env}
            if "PYTEST_ADDOPTS" in grader_env:
                # Ours beside the task's own (a recipe's `-rA`), which this would replace.
                theirs = env.get("PYTEST_ADDOPTS") or task.env.env.get("PYTEST_ADDOPTS")
                ours = grader_env["PYTEST_ADDOPTS"]
                env["PYTEST_ADDOPTS"] = f"{ours} {theirs}" if theirs else ours
            elif grader_env:
                env.update(grader_env)
            if self.grading == "guarded":  # no git hook runs in the eval script's git commands
                env |= {
                    "GIT_CONFIG_COUNT": "1",
                    "GIT_CONFIG_KEY_0": "core.hooksPath",
                    "GIT_CONFIG_VALUE_0": "/dev/null",
                }
            try:
                run = await sb.execute(
                    ["/bin/bash", EVAL_SCRIPT_PATH],
                    cwd="/testbed",
                    env=env,
                    timeout=self.timeout,
                    merge_stderr=True,
                    max_output=64 << 20,
                )
                result.log = run.stdout
            except CommandTimeoutError as e:
                result.log = e.output + f"\n\nTimeout error: {self.timeout:g} seconds exceeded."
                result.timed_out = True

    def _verdict(self, result: EvalResult, g: Grade) -> None:
        """`result`'s verdict and reward from the log's grade and the guards that fired."""
        result.resolved, result.swebench_resolved = g.resolved, g.swebench_resolved
        result.test_results, result.tests_status = g.test_results, g.tests_status
        result.reason = g.reason
        result.tampering = list(dict.fromkeys(result.tampering))
        if self.grading == "harness":  # the harness's verdict, exactly
            result.resolved = g.swebench_resolved
            result.reason = "" if g.swebench_resolved else g.reason
        elif result.tampering:
            result.resolved = False
            paths = [t for t in result.tampering if t.startswith("path: ")]
            why = (
                f"the patch changes what decides the tests: {paths[0].removeprefix('path: ')}"
                if paths
                else "the test run was tampered with: "
                + result.tampering[0].removeprefix("runtime: ")
            )
            result.reason = "; ".join(filter(None, (why, g.reason)))
        result.status = "resolved" if result.resolved else "unresolved"
        if result.empty_patch and result.resolved:
            # The harness never counts an empty patch as resolved (it does not even run it);
            # the tests passing anyway is worth knowing: the task is broken (see validation).
            result.resolved = False
            result.status = "unresolved"
            result.reason = "empty patch (the tests pass without it: the task is not valid)"
        result.reward = 1.0 if result.resolved else 0.0

    async def _apply(
        self, sb: SandboxAPI, result: EvalResult, base: guard.BaseState | None, task: Task
    ) -> bool:
        """The harness's apply commands in its order. Guarded, `patch`'s fallback is checked
        first by its own dry run (it writes what git refuses, .git/hooks among them)."""
        outputs = []
        for command in APPLY_COMMANDS:
            if base is not None and command.startswith("patch "):
                result.tampering += await guard.check_patch_fallback(sb, task, PATCH_PATH, base)
            r = await sb.execute(f"{command} {PATCH_PATH}", cwd="/testbed", merge_stderr=True)
            outputs.append(f"$ {command} {PATCH_PATH}\n{r.stdout}")
            if r.exit_code == 0:
                result.patch_applied, result.apply_command = True, command
                break
            # Like the harness, the next attempt starts from whatever this one left.
        result.apply_output = "\n".join(outputs)
        return result.patch_applied


async def evaluate(
    task: Task,
    patch: str | None,
    *,
    builder: Builder | None = None,
    timeout: float = DEFAULT_TIMEOUT,
    grading: Grading = "guarded",
) -> EvalResult:
    """Evaluate `patch` for `task` in a fresh sandbox: the verdict, reward, tests and log
    (`grading="harness"`: exactly the harness's verdict, no guard; for comparisons)."""
    return await Evaluator(builder, timeout=timeout, grading=grading).evaluate(task, patch)


class Evaluates(Protocol):
    """What grades a (task, patch) pair: an Evaluator (this host), or a Runtime's."""

    async def evaluate(self, task: Task, patch: str | None) -> EvalResult: ...


async def evaluate_many(
    evaluator: Evaluates,
    items: list[tuple[Task, str | None]],
    *,
    jobs: int = 1,
    on_done: Callable[[EvalResult], None] | None = None,
) -> list[EvalResult]:
    """Evaluate several (task, patch) pairs, `jobs` at a time; results in input order.

    `on_done` runs as each evaluation finishes (e.g. to write its report at once). The first
    exception (from an evaluation or from `on_done`), or our own cancellation, stops the rest:
    each is cancelled and awaited, so that every sandbox is stopped before this returns, and
    nothing is left running for `asyncio.run` to wait on. That exception is then raised.
    """
    gate = asyncio.Semaphore(max(1, jobs))

    async def one(task: Task, patch: str | None) -> EvalResult:
        async with gate:
            r = await evaluator.evaluate(task, patch)
        if on_done is not None:
            on_done(r)
        return r

    return await all_or_none(one(t, p) for t, p in items)
