"""Validating a task: its gold patch must resolve it, the empty patch must not, its
repository must hold nothing from after its base commit, and no file an agent can read outside
/testbed may hold the fix (a later release of the project on the host, say): no fix for an agent
to find.

A task that fails either check gives a wrong reward whatever the agent does (a broken
environment, a test spec that does not match the repository, tests that pass on the base
commit). The verdict is recorded in the store, on the task layer's meta, so every node and
process sees it. It is keyed by the task id and by a hash of what it depends on (the test patch,
the gold patch, FAIL_TO_PASS/PASS_TO_PASS, the eval script and test command, the grading): two
tasks can share one task layer, and a task whose test spec changes needs a new verdict. A
rebuilt layer is a new layer, with no verdict.
"""

from __future__ import annotations

import asyncio
import time
from importlib import resources
from typing import Any

from pydantic import BaseModel, Field

from minisandbox.errors import EvalScriptError, TaskNotBuiltError, TaskNotValidatedError
from minisandbox.evaluation.evaluator import DEFAULT_TIMEOUT, EvalResult, Evaluator
from minisandbox.tasks.builder import Builder
from minisandbox.tasks.eval_script import make_eval_script
from minisandbox.tasks.specs import Task, files_in_patch
from minisandbox.utils.hashing import content_digest

# Bump when what a verdict means changes (the evaluator's procedure or the checks below).
# 2: the history check; 3: keyed by the one canonical digest (utils.hashing); 4: the guarded
# grading (evaluation.guard): a verdict of the unguarded one is made again; 5: the leak check
_FORMAT = 5
META_KEY = "validations"


class Check(BaseModel):
    """One of the two evaluations a validation runs."""

    status: str
    resolved: bool
    swebench_resolved: bool
    reason: str = ""
    duration_s: float = 0.0


class HistoryCheck(BaseModel):
    """What a task sandbox's /testbed/.git holds beyond the base commit's past."""

    problems: list[str] = Field(default_factory=list, description="empty: only the past")
    objects: int = 0
    unreachable_objects: int = 0
    notes: list[str] = Field(
        default_factory=list, description="e.g. a gold version that HEAD's own history holds"
    )


class LeakCheck(BaseModel):
    """Whether the fix is readable in the task's agent sandbox outside /testbed: the lines the
    gold patch adds that are long and absent from the base commit's tree, searched for in every
    readable file (the host's /usr, the interpreter, the venv, /etc ...)."""

    lines: int = Field(0, description="rare gold lines searched for")
    leaks: list[str] = Field(
        default_factory=list, description="files that hold them: `path: how many`"
    )


class Validation(BaseModel):
    """The verdict on a task: `valid` when the gold patch resolves it and the empty one does
    not. `reason` says what failed."""

    task: str
    key: str
    valid: bool
    reason: str = ""
    gold: Check
    empty: Check
    # FAIL_TO_PASS tests that pass without the patch: allowed (the task is still not resolved
    # without it) but worth knowing; SWE-bench's own datasets have a few.
    fail_to_pass_passing_without_patch: list[str] = Field(default_factory=list)
    history: HistoryCheck | None = None
    leaks: LeakCheck | None = None
    validated_at: float = 0.0


def validation_key(task: Task) -> str:
    """A hash of everything a task's verdict depends on besides its layers."""
    try:
        script = make_eval_script(task)
    except EvalScriptError as e:  # such a task cannot be evaluated; its verdict says so
        script = f"error: {e}"
    spec = {
        "format": _FORMAT,
        "test_patch": task.test_patch,
        "gold_patch": task.gold_patch,
        "fail_to_pass": task.fail_to_pass,
        "pass_to_pass": task.pass_to_pass,
        "eval_script": script,
        "test_cmd": task.test_cmd,
        "log_parser": task.log_parser,
        "eval_type": task.eval_type,
        "services": task.services,
    }
    return content_digest(spec)


def _records(meta: dict[str, Any] | None) -> dict[str, dict[str, Any]]:
    records = (meta or {}).get(META_KEY)
    return records if isinstance(records, dict) else {}


def read_validation(builder: Builder, task: Task) -> Validation | None:
    """The recorded verdict for the task as it is now, or None."""
    layers = builder.built_layers(task)
    if not layers:
        return None
    entry = _records(builder.store.meta(layers[-1])).get(task.id, {}).get(validation_key(task))
    return Validation.model_validate(entry) if entry else None


def check_validated(builder: Builder, task: Task) -> None:
    """Refuse a task without a passing validation.

    Raises:
        TaskNotValidatedError: it has none (the message says how to validate it).
    """
    v = read_validation(builder, task)
    if v is not None and v.valid:
        return
    why = "has no validation" if v is None else f"failed validation ({v.reason})"
    raise TaskNotValidatedError(
        f"task {task.id} {why}, and a passing one is required (require_validated / "
        "MINISANDBOX_REQUIRE_VALIDATED). Validate it with "
        f"`minisandbox build <tasks> --validate -i {task.id}`"
    )


def _check(r: EvalResult) -> Check:
    return Check(
        status=r.status,
        resolved=r.resolved,
        swebench_resolved=r.swebench_resolved,
        reason=r.reason,
        duration_s=r.duration_s,
    )


async def check_history(builder: Builder, task: Task) -> HistoryCheck:
    """Run the history check (data/check_history.sh) in a sandbox of the task, as an agent's
    git would see the repository: refs, reflogs, remotes, unreachable objects, gold blobs."""
    script = (resources.files("minisandbox") / "data" / "check_history.sh").read_text()
    files = files_in_patch(task.gold_patch) if task.gold_patch else []
    async with builder.sandbox(task) as sb:
        await sb.write_file("/tmp/.msb-check-history.sh", script)
        await sb.write_file("/tmp/.msb-gold.patch", task.gold_patch or "")
        r = await sb.execute(
            ["/bin/bash", "/tmp/.msb-check-history.sh", "/testbed", "/tmp/.msb-gold.patch", *files],
            timeout=1800,
        )
    check = HistoryCheck(problems=[line for line in r.stdout.splitlines() if line.strip()])
    check.notes = [line[6:] for line in r.stderr.splitlines() if line.startswith("note: ")]
    counts = next(
        (line.split() for line in r.stderr.splitlines() if line.startswith("objects ")), []
    )
    if len(counts) == 4 and counts[1].isdigit() and counts[3].isdigit():
        check.objects, check.unreachable_objects = int(counts[1]), int(counts[3])
    elif r.exit_code != 0 or not check.problems:
        check.problems.append(f"the history check did not run: {r.output.strip()[-300:]}")
    return check


# A gold line means something when it is this long (stripped) and the base tree lacks it.
LEAK_LINE_MIN = 30
_LEAK_LINES_MAX = 200


def leak_lines(patch: str) -> list[str]:
    """The lines `patch` adds that are long enough to identify the fix (stripped, distinct)."""
    found: dict[str, None] = {}
    for line in patch.splitlines():
        if not line.startswith("+") or line.startswith("+++"):
            continue
        text = line[1:].strip()
        if len(text) >= LEAK_LINE_MIN and sum(c.isalnum() for c in text) >= LEAK_LINE_MIN // 2:
            found[text] = None
    return list(found)[:_LEAK_LINES_MAX]


def leaking_files(findings: list[tuple[str, str]], searched: int) -> list[str]:
    """Files that hold the fix: two of the rare gold lines (one when only one was searched
    for, so a single common-looking line elsewhere is not a leak by itself)."""
    per_file: dict[str, set[str]] = {}
    for path, line in findings:
        per_file.setdefault(path, set()).add(line)
    need = min(2, searched)
    return [f"{path}: {len(hit)}" for path, hit in sorted(per_file.items()) if len(hit) >= need]


async def check_leaks(builder: Builder, task: Task, **overrides: Any) -> LeakCheck:
    """Search the task's agent sandbox (outside /testbed) for the gold patch's rare lines
    (data/check_leaks.sh). `overrides`: SandboxConfig fields agents' sandboxes add (e.g.
    `ro_paths`), so that what they bind is searched too."""
    lines = leak_lines(task.gold_patch or "")
    if not lines:
        return LeakCheck()
    script = (resources.files("minisandbox") / "data" / "check_leaks.sh").read_text()
    async with builder.sandbox(task, **overrides) as sb:
        await sb.execute(["mkdir", "-p", "/tmp/.msb-leaks"])
        await sb.write_file("/tmp/.msb-leaks/check.sh", script)
        await sb.write_file("/tmp/.msb-leaks/lines", "\n".join(lines) + "\n")
        r = await sb.execute(
            ["/bin/bash", "/tmp/.msb-leaks/check.sh", "/tmp/.msb-leaks/lines"], timeout=1800
        )
    searched = next(
        (int(w[1]) for w in (x.split() for x in r.stderr.splitlines()) if w[:1] == ["lines"]),
        None,
    )
    if searched is None:
        return LeakCheck(leaks=[f"the leak check did not run: {r.output.strip()[-300:]}"])
    findings = [
        (path, line)
        for path, sep, line in (x.partition("\t") for x in r.stdout.splitlines())
        if sep
    ]
    return LeakCheck(lines=searched, leaks=leaking_files(findings, searched))


def judge(
    task: Task,
    gold: EvalResult,
    empty: EvalResult,
    history: HistoryCheck | None = None,
    leaks: LeakCheck | None = None,
) -> Validation:
    """The verdict from the gold patch's and the empty patch's evaluations (and the history
    and leak checks, when they ran)."""
    reasons = []
    if not gold.resolved:
        reasons.append(f"the gold patch does not resolve it ({gold.status}: {gold.reason})")
    if empty.status == "error":
        reasons.append(f"the empty patch could not be evaluated ({empty.reason})")
    elif empty.swebench_resolved:  # an empty patch's result is never `resolved`: ask swebench
        reasons.append("the tests pass without a patch")
    if history is not None and history.problems:
        more = f" and {len(history.problems) - 1} more" if len(history.problems) > 1 else ""
        reasons.append(f"the repository holds more than its past: {history.problems[0]}{more}")
    if leaks is not None and leaks.leaks:
        more = f" and {len(leaks.leaks) - 1} more" if len(leaks.leaks) > 1 else ""
        reasons.append(f"the fix is readable outside /testbed: {leaks.leaks[0]}{more}")
    passing = [t for t in task.fail_to_pass if empty.test_results.get(t) in ("PASSED", "XFAIL")]
    return Validation(
        task=task.id,
        key=validation_key(task),
        valid=not reasons,
        reason="; ".join(reasons),
        gold=_check(gold),
        empty=_check(empty),
        fail_to_pass_passing_without_patch=passing,
        history=history,
        leaks=leaks,
        validated_at=time.time(),
    )


async def validate(
    builder: Builder, task: Task, *, timeout: float | None = None, force: bool = False
) -> Validation:
    """Evaluate the task's gold and empty patches (unless a verdict for it as it is now is
    recorded and not `force`), record the verdict on its task layer and return it.

    Raises:
        TaskNotBuiltError: the task is not built (build it first).
    """
    if not force and (known := read_validation(builder, task)) is not None:
        return known
    layers = builder.built_layers(task)
    if not layers:
        raise TaskNotBuiltError(f"task {task.id} is not built; build it before validating")
    evaluator = Evaluator(builder, timeout=timeout or DEFAULT_TIMEOUT)
    gold, empty, history, leaks = await asyncio.gather(
        evaluator.evaluate(task, task.gold_patch),
        evaluator.evaluate(task, ""),
        check_history(builder, task),
        check_leaks(builder, task),
    )
    verdict = judge(task, gold, empty, history, leaks)

    def record(meta: dict[str, Any]) -> dict[str, Any]:
        records = _records(meta)
        records.setdefault(task.id, {})[verdict.key] = verdict.model_dump(mode="json")
        return {**meta, META_KEY: records}

    # Read-modify-write under the store's own lock: one writer at a time across processes.
    await asyncio.to_thread(builder.store.update_meta, layers[-1], record)
    return verdict
