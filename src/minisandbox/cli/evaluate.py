"""`eval`: evaluate predicted patches as SWE-bench's harness does, and write its reports."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, cast

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
    count,
    fail,
    load_dataset,
    make_builder,
    out_console,
    positive_seconds,
    print_table,
)
from minisandbox.cli.build import build_all
from minisandbox.cli.oserrors import explain_os_error, place
from minisandbox.cli.progress import Progress

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.evaluation.evaluator import EvalResult
    from minisandbox.evaluation.predictions import Prediction
    from minisandbox.tasks.builder import Builder
    from minisandbox.tasks.loaders import TaskFormatError
    from minisandbox.tasks.specs import Task


# long: a typer command; its options and help text are declarations, its body is 20 lines
def eval_(
    tasks: str = TasksArg,
    predictions: str = typer.Option(
        ...,
        "--predictions",
        "-p",
        metavar="FILE|gold|empty",
        help="SWE-bench predictions (instance_id, model_name_or_path, model_patch) as a .json "
        "list or object keyed by instance id, or .jsonl; or `gold` (each task's gold patch) or "
        "`empty` (no patch).",
    ),
    ids: list[str] = IdsOpt,
    jobs: int = typer.Option(
        2, "--jobs", "-j", min=1, metavar="N", help="Instances built and evaluated at once."
    ),
    report: Path = typer.Option(
        None,
        "--report",
        metavar="DIR",
        help="Directory of the reports, laid out as SWE-bench's (default: the run's log "
        "directory, <logs>/run_evaluation/<run id>, with the build logs in <logs>: logs/ beside "
        "the store, ~/.cache/minisandbox/logs unless MINISANDBOX_STORE moves it).",
    ),
    run_id: str = typer.Option(
        "minisandbox", "--run-id", metavar="NAME", help="Names the run's summary file."
    ),
    timeout: float = typer.Option(
        1800.0,
        "--timeout",
        metavar="SECONDS",
        callback=positive_seconds,
        help="Seconds the tests may take (more than 0).",
    ),
    grading: str = typer.Option(
        "guarded",
        "--grading",
        metavar="guarded|harness",
        help="`guarded` (the reward: swebench's verdict, and no patch may change what decides "
        "the tests or tamper with the run) or `harness` (exactly SWE-bench's harness, for "
        "comparisons).",
    ),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    envs_dir: Path = EnvsOpt,
    regrade: bool = typer.Option(
        False,
        "--regrade",
        help="Grade every instance again, also those this run id already graded with the same "
        "task, patch, grading and timeout (by default their results are reused).",
    ),
    json_out: bool = typer.Option(False, "--json", help="End with one JSON summary line."),
    quiet: bool = QuietOpt,
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """Evaluate predicted patches as SWE-bench's harness does, each in a fresh task sandbox.

    Only tasks with a prediction are evaluated (their layers are built first when missing).
    Writes SWE-bench's per-instance report.json, test_output.txt and patch.diff under
    <logs>/run_evaluation/<run id>/<model>/<instance_id>/ as each instance finishes, next to
    the build logs in <logs> (logs/ beside the store; never the current directory), and
    the same under --report/<model>/<instance_id>/ when --report is given; the run summary
    goes to --report/<model>.<run id>.json at the end (default: the run's log directory).
    Started again with the same run id, it reuses what that run graded with the same task,
    patch, grading and timeout (as the harness skips instances with a report; --regrade
    grades them again), so the summary holds every instance of the run.
    Exits 0 whatever the verdicts; 2 on bad input or when a write fails (disk full, quota,
    read-only, permission): then the run stops, the reports of the instances finished so far
    stay, and no summary is written."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.evaluation.evaluator import GRADINGS
    from minisandbox.evaluation.predictions import run_log_dir
    from minisandbox.tasks.specs import path_name_problem

    if grading not in GRADINGS:
        fail(f"--grading {grading!r} is not one of {', '.join(GRADINGS)}: use --grading guarded")
    problem = path_name_problem(run_id)
    if problem is not None:
        fail(f"--run-id {run_id!r} {problem}: it names the run's directory and summary file")
    written: list[str] = []
    try:
        rejected: list[TaskFormatError] = []
        preds, loaded = _predictions_and_tasks(
            predictions, tasks, ids, envs_dir, allow_abs, rejected
        )
        builder = make_builder(store, cache, mirror)
        # The run's logs go with the build logs, whatever the current directory.
        log_dir = run_log_dir(builder.settings.logs, run_id)
        place("logs", log_dir, "MINISANDBOX_STORE (--store)")
        report_dir = report or log_dir
        place("report", report_dir, "--report")
        dirs = list(dict.fromkeys([log_dir, report_dir]))  # once each, when they are the same
        for d in dirs:
            _check_writable(d)  # before hours of evaluation, not after
        run = _Run(timeout, grading, regrade)
        results = run_async(_eval_all(builder, loaded, preds, dirs, jobs, run, quiet, written))
        _eval_summary(loaded, preds, results, (report_dir, log_dir), run, run_id, json_out)
    except MiniSandboxError as e:
        fail(str(e))
    except OSError as e:
        kept = f" (the run stopped; {len(written)} finished reports are kept)" if written else ""
        fail(f"{explain_os_error(e)}{kept}")


def _predictions_and_tasks(
    predictions: str,
    tasks: str,
    ids: list[str] | None,
    envs_dir: Path | None,
    allow_abs: bool,
    rejected: list[TaskFormatError],
) -> tuple[dict[str, Prediction], list[Task]]:
    """The predictions to evaluate (`ids`' only, when given) and the dataset's tasks they are
    for (its malformed records into `rejected`). Raises PredictionsError, naming the file and
    entry, for a prediction of an unknown instance, and when nothing is left to evaluate."""
    from minisandbox.evaluation.predictions import (
        SPECIAL,
        PredictionsError,
        load_predictions,
        special_predictions,
    )
    from minisandbox.tasks.loaders import TaskNotFoundError

    if predictions in SPECIAL:
        loaded = load_dataset(tasks, envs_dir, ids, allow_abs, rejected)
        preds = special_predictions(predictions, loaded)
    else:
        preds = load_predictions(Path(predictions))
        if ids:
            preds = {i: p for i, p in preds.items() if i in set(ids)}
        if not preds:
            raise PredictionsError(f"{predictions}: no predictions to evaluate")
        try:
            loaded = load_dataset(tasks, envs_dir, ids or list(preds), allow_abs, rejected)
        except TaskNotFoundError as e:
            if ids:
                raise  # an --instance-ids problem
            # Name the first unknown one where the file has it (the loader lists them all).
            missing = set(e.missing)
            unknown = [p for i, p in preds.items() if i in missing]
            where = unknown[0].where if unknown else predictions
            raise PredictionsError(f"{where}: a prediction for an unknown instance ({e})") from None
    if not preds:
        raise PredictionsError(f"no tasks to evaluate in {tasks}")
    return preds, loaded


def _check_writable(directory: Path) -> None:
    """Create `directory` and write a file in it, or raise the OSError that says why not."""
    from minisandbox.evaluation.predictions import write_file

    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".minisandbox-probe-{os.getpid()}"
    write_file(probe, "probe\n")
    probe.unlink()


@dataclasses.dataclass(frozen=True)
class _Run:
    """How this run grades."""

    timeout: float
    grading: str
    regrade: bool
    reused: list[str] = dataclasses.field(default_factory=list)
    """The instances whose result this run id had already (filled in as the run goes)."""


async def _eval_all(
    builder: Builder,
    tasks: list[Task],
    preds: dict[str, Prediction],
    report_dirs: list[Path],
    jobs: int,
    run: _Run,
    quiet: bool,
    written: list[str],
) -> dict[str, EvalResult]:
    """Build, then evaluate, writing each instance's report into each of `report_dirs` as soon
    as it is known (into `written`, the ids whose report is complete). The first failed write
    stops the run: the running evaluations are cancelled (their sandboxes stopped), and the
    OSError is raised. Each instance's phases and verdict go to stderr unless `quiet`."""
    todo = [t for t in tasks if t.id in preds]
    with Progress("evaluating", len(todo), quiet) as progress:
        return await _build_and_eval(
            builder, todo, preds, report_dirs, jobs, run, written, progress
        )


async def _build_and_eval(
    builder: Builder,
    todo: list[Task],
    preds: dict[str, Prediction],
    report_dirs: list[Path],
    jobs: int,
    run: _Run,
    written: list[str],
    progress: Progress,
) -> dict[str, EvalResult]:
    from minisandbox.evaluation.evaluator import EvalResult, Evaluator, Grading, evaluate_many
    from minisandbox.evaluation.graded import grading_key, save_graded
    from minisandbox.evaluation.predictions import write_instance_report

    keys = {t.id: grading_key(t, preds[t.id].model_patch, run.grading, run.timeout) for t in todo}
    every, by_id = todo, {t.id: t for t in todo}
    results = {} if run.regrade else _graded_before(todo, preds, report_dirs[0], keys, progress)
    reused = set(results)
    run.reused.extend(results)
    todo = [t for t in todo if t.id not in reused]
    builds = await build_all(builder, todo, jobs, False, progress, final=False)
    ready = []
    for t, b in zip(todo, builds, strict=True):
        if b.status == "failed":
            # Whole: a failed step's error ends with the last lines of its log.
            reason = f"building the task failed: {(b.error or '')[:4000]}"
            results[t.id] = EvalResult(
                instance_id=t.id, status="error", resolved=False, reward=0.0, reason=reason
            )
        else:
            ready.append(t)

    def write(r: EvalResult) -> None:
        for report_dir in report_dirs:
            write_instance_report(report_dir, by_id[r.instance_id], preds[r.instance_id], r)
            model = preds[r.instance_id].model_name_or_path
            save_graded(report_dir, model, keys[r.instance_id], r)
        written.append(r.instance_id)

    for r in results.values():
        if r.instance_id not in reused or len(report_dirs) > 1:  # --report gets them too
            write(r)

    def done(r: EvalResult) -> None:
        write(r)
        progress.done(r.instance_id, f"{r.status}: {r.reason}" if r.reason else r.status)

    evaluated = await evaluate_many(
        Evaluator(
            builder,
            timeout=run.timeout,
            on_phase=progress.phase,
            grading=cast(Grading, run.grading),
        ),
        [(t, preds[t.id].model_patch) for t in ready],
        jobs=jobs,
        on_done=done,
    )
    results.update({r.instance_id: r for r in evaluated})
    return {t.id: results[t.id] for t in every}  # in the dataset's order


def _graded_before(
    tasks: list[Task],
    preds: dict[str, Prediction],
    log_dir: Path,
    keys: dict[str, str],
    progress: Progress,
) -> dict[str, EvalResult]:
    """What this run id graded before with the same keys (graded.py), each told to progress."""
    from minisandbox.evaluation.graded import load_graded

    results = {}
    for t in tasks:
        before = load_graded(log_dir, preds[t.id].model_name_or_path, t.id, keys[t.id])
        if before is not None:
            results[t.id] = before
            progress.done(t.id, f"{before.status} (graded before in this run: reused)")
    return results


def _eval_summary(
    tasks: list[Task],
    preds: dict[str, Prediction],
    results: dict[str, EvalResult],
    where: tuple[Path, Path],
    run: _Run,
    run_id: str,
    json_out: bool,
) -> None:
    """Write the run summary, then show it: one JSON line with `json_out`, else a table.
    `where`: the report and log directories."""
    from minisandbox.evaluation.predictions import model_dir, run_report, write_file

    report_dir, log_dir = where
    model = next(iter(preds.values())).model_name_or_path
    summary_path = report_dir / f"{model_dir(model)}.{run_id}.json"
    report_dir.mkdir(parents=True, exist_ok=True)
    write_file(summary_path, json.dumps(run_report(tasks, preds, results), indent=4) + "\n")
    by_status = {
        s: [i for i, r in results.items() if r.status == s]
        for s in ("resolved", "unresolved", "error")
    }
    if json_out:
        typer.echo(
            json.dumps(
                {
                    "total": len(results),
                    "resolved": len(by_status["resolved"]),
                    "resolved_ids": by_status["resolved"],
                    "unresolved_ids": by_status["unresolved"],
                    "error_ids": by_status["error"],
                    "empty_patch_ids": [i for i, r in results.items() if r.empty_patch],
                    "rewards": {i: r.reward for i, r in results.items()},
                    "grading": next((r.grading for r in results.values()), "guarded"),
                    "swebench_resolved": sum(r.swebench_resolved for r in results.values()),
                    "swebench_resolved_ids": [i for i, r in results.items() if r.swebench_resolved],
                    "tampered": sum(bool(r.tampering) for r in results.values()),
                    "tampering": {i: r.tampering for i, r in results.items() if r.tampering},
                    "reasons": {i: r.reason for i, r in results.items() if r.reason},
                    "model": model,
                    "report": str(summary_path),
                    "logs": str(log_dir),
                    "reused_ids": run.reused,
                }
            )
        )
    else:
        _eval_table(model, results, by_status, (report_dir, log_dir, summary_path), run)


def _eval_table(
    model: str,
    results: dict[str, EvalResult],
    by_status: dict[str, list[str]],
    paths: tuple[Path, Path, Path],
    run: _Run,
) -> None:
    from rich.table import Table

    report_dir, log_dir, summary_path = paths
    console = out_console()
    table = Table(title=f"evaluation of {model}")
    add_columns(
        table, ("instance", "status", "reward", "seconds", "reason"), results, wrap=("reason",)
    )
    for i, r in results.items():
        colour = {"resolved": "green", "unresolved": "yellow", "error": "red"}[r.status]
        reason = r.reason.splitlines()[0][:160] if r.reason else ""
        table.add_row(
            i, f"[{colour}]{r.status}[/{colour}]", f"{r.reward:g}", f"{r.duration_s:.1f}", reason
        )
    print_table(table)
    console.print(
        f"resolved {len(by_status['resolved'])}/{len(results)}, unresolved "
        f"{len(by_status['unresolved'])}, error {len(by_status['error'])}; "
        f"reports in {report_dir}, summary {summary_path}"
        + (f", logs in {log_dir}" if log_dir != report_dir else "")
        + (
            f"; {count(len(run.reused), 'result')} reused from this run id's earlier grading "
            "(--regrade grades again)"
            if run.reused
            else ""
        ),
        soft_wrap=True,  # one line the terminal wraps: its paths stay whole, to copy
    )
