"""`build`: build a dataset's layers into the store (and validate its tasks); `build_all`, which
`eval` builds with too."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from minisandbox.cli.aiorun import run_async
from minisandbox.cli.app import (
    AbsPathsOpt,
    CacheOpt,
    EnvsOpt,
    IdsOpt,
    MirrorOpt,
    QuietOpt,
    StoreOpt,
    TasksArg,
    add_columns,
    fail,
    load_dataset,
    make_builder,
    print_table,
)
from minisandbox.cli.progress import Progress
from minisandbox.utils.aio import all_or_none

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.evaluation.validation import Validation
    from minisandbox.tasks.builder import Builder, BuildResult
    from minisandbox.tasks.loaders import TaskFormatError
    from minisandbox.tasks.specs import Task


def build(
    tasks: str = TasksArg,
    ids: list[str] = IdsOpt,
    jobs: int = typer.Option(2, "--jobs", "-j", min=1, metavar="N", help="Tasks built at once."),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    envs_dir: Path = EnvsOpt,
    force: bool = typer.Option(
        False,
        "--force",
        help="Rebuild layers already in the store, and environments whose recorded build "
        "failure makes their tasks fail at once (and re-validate).",
    ),
    validate: bool = typer.Option(
        False,
        "--validate",
        help="Then check each task: its gold patch must resolve it, the empty patch must not. "
        "The verdict is recorded in the store; exit 1 when a task fails.",
    ),
    json_out: bool = typer.Option(False, "--json", help="End with one JSON summary line."),
    quiet: bool = QuietOpt,
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """Build the environment and task layers of a dataset's tasks into the layer store.

    Each environment (a uv venv with pinned requirements) is built once and shared by the tasks
    with the same recipe; each task adds its repository at the base commit, installed."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.tasks.builder import BuildResult

    rejected: list[TaskFormatError] = []
    try:
        loaded = load_dataset(tasks, envs_dir, ids, allow_abs, rejected)
        builder = make_builder(store, cache, mirror)
        results, verdicts = run_async(
            _build_and_validate(builder, loaded, jobs, force, validate, quiet)
        )
    except MiniSandboxError as e:
        fail(str(e))
    # A malformed record fails its task, named with the cause; the others were built.
    results += [
        BuildResult(task_id=e.instance_id or "", status="failed", error=str(e), step="load")
        for e in rejected
    ]
    if json_out:
        typer.echo(json.dumps(_build_summary(results, verdicts if validate else None)))
    else:
        _build_table(results, verdicts if validate else None)
    failed = any(r.status == "failed" for r in results)
    invalid = any(not v.valid for v in verdicts.values())
    raise typer.Exit(1 if failed or invalid else 0)


async def _build_and_validate(
    builder: Builder, tasks: list[Task], jobs: int, force: bool, validate: bool, quiet: bool
) -> tuple[list[BuildResult], dict[str, Validation]]:
    """Build `tasks`, then (when `validate`) validate those that built."""
    with Progress("building", len(tasks), quiet) as progress:
        results = await build_all(builder, tasks, jobs, force, progress)
    verdicts: dict[str, Validation] = {}
    if validate:
        ok = [t for t, r in zip(tasks, results, strict=True) if r.status != "failed"]
        with Progress("validating", len(ok), quiet) as progress:
            verdicts = await _validate_all(builder, ok, jobs, force, progress)
    return results, verdicts


def _build_verdict(r: BuildResult) -> str:
    return f"failed: {r.error}" if r.status == "failed" else r.status


async def build_all(
    builder: Builder,
    tasks: list[Task],
    jobs: int,
    force: bool,
    progress: Progress,
    *,
    final: bool = True,
) -> list[BuildResult]:
    """Build `tasks`, `jobs` at a time, reporting each one's phases to `progress` (and its
    result as its last entry when `final`, else only failures)."""
    limit = asyncio.Semaphore(max(1, jobs))

    async def one(task: Task) -> BuildResult:
        async with limit:
            result = await builder.build(task, force=force, on_phase=progress.phase)
        if final:
            progress.done(task.id, _build_verdict(result))
        elif result.status == "failed":
            progress.done(task.id, f"error: building the task failed: {result.error}")
        return result

    return await all_or_none(one(t) for t in tasks)


async def _validate_all(
    builder: Builder, tasks: list[Task], jobs: int, force: bool, progress: Progress
) -> dict[str, Validation]:
    from minisandbox.errors import MiniSandboxError
    from minisandbox.evaluation.validation import validate

    limit = asyncio.Semaphore(max(1, jobs))
    verdicts: dict[str, Validation] = {}

    async def one(task: Task) -> None:
        async with limit:
            progress.phase(task.id, "validating")
            try:
                verdicts[task.id] = await validate(builder, task, force=force)
            except MiniSandboxError as e:
                verdicts[task.id] = _unvalidated(task, str(e))
        v = verdicts[task.id]
        progress.done(task.id, "valid" if v.valid else f"invalid: {v.reason}")

    await all_or_none(one(t) for t in tasks)
    return verdicts


def _unvalidated(task: Task, reason: str) -> Validation:
    from minisandbox.evaluation.validation import Check, Validation, validation_key

    none = Check(status="error", resolved=False, swebench_resolved=False, reason=reason)
    return Validation(
        task=task.id, key=validation_key(task), valid=False, reason=reason, gold=none, empty=none
    )


def _build_summary(
    results: list[BuildResult], verdicts: dict[str, Validation] | None
) -> dict[str, object]:
    """`build --json`'s summary line (with the verdicts when the tasks were validated)."""
    summary: dict[str, object] = {
        "total": len(results),
        "built": [r.task_id for r in results if r.status == "built"],
        "cached": [r.task_id for r in results if r.status == "cached"],
        "failed": {r.task_id: r.error for r in results if r.status == "failed"},
        "warnings": {r.task_id: r.warnings for r in results if r.warnings},
        # Environments whose pins conflict as pip packages, installed as they are.
        "unresolved": [r.task_id for r in results if r.unresolved],
        # Pins an environment stepped down to install (relax.py), per task.
        "relaxed": {
            r.task_id: [x.model_dump(exclude={"conflict"}) for x in r.relaxed]
            for r in results
            if r.relaxed
        },
        # What a recipe took from its repository, and from which file (tasks.repo_recipes).
        "inferred": {r.task_id: r.inferred for r in results if r.inferred},
    }
    if verdicts is not None:
        invalid = sorted(i for i, v in verdicts.items() if not v.valid)
        summary["valid"] = sorted(i for i, v in verdicts.items() if v.valid)
        summary["invalid"] = {i: verdicts[i].reason for i in invalid}
    return summary


def _build_table(results: list[BuildResult], verdicts: dict[str, Validation] | None) -> None:
    from rich.table import Table

    table = Table(title="build summary")
    columns = ["task", "status", "seconds", "detail"]
    if verdicts is not None:
        columns.append("validation")
    add_columns(table, columns, [r.task_id for r in results], wrap=("detail", "validation"))
    for r in results:
        colour = {"built": "green", "cached": "cyan", "failed": "red"}[r.status]
        detail = (r.error or "").splitlines()[0][:120] if r.error else (r.task_layer or "")[:12]
        if r.unresolved:
            detail += " (pins installed unresolved"
            detail += f", {len(r.relaxed)} relaxed)" if r.relaxed else ")"
        for warning in r.warnings:
            detail += f"\nwarning: {warning}"
        row = [r.task_id, f"[{colour}]{r.status}[/{colour}]", f"{r.seconds:.1f}", detail]
        if verdicts is not None:
            row.append(_verdict_cell(verdicts.get(r.task_id)))
        table.add_row(*row)
    print_table(table)


def _verdict_cell(v: Validation | None) -> str:
    if v is None:
        return "-"
    return "[green]valid[/green]" if v.valid else f"[red]invalid[/red]: {v.reason[:160]}"
