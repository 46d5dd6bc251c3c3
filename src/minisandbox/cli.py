"""The `minisandbox` command line."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import sys
import time
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from rich.console import Console
    from rich.progress import Progress

    from .builder import Builder, BuildResult
    from .config import SandboxConfig
    from .evaluation import EvalResult
    from .predictions import Prediction
    from .sandbox import Sandbox
    from .specs import Task
    from .store import LayerStore
    from .validation import Validation

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    help=(
        "Container-free sandboxes for software-engineering agents: unprivileged Linux "
        "namespaces (bubblewrap), an overlay root over read-only layers, seccomp and resource "
        "limits. No root, no daemon."
    ),
)

LayerOpt = typer.Option(
    None,
    "--layer",
    "-l",
    help="A read-only directory whose content is overlaid at / (repeatable; first is lowest).",
)
UpperOpt = typer.Option(
    None, "--upper", help="Keep everything the sandbox writes in this directory (default: discard)."
)
NetworkOpt = typer.Option(False, "--network", help="Give the sandbox the host's network.")
RoOpt = typer.Option(
    None,
    "--ro",
    help="A host directory to show read-only at its own path, e.g. a Python install (repeatable).",
)
WorkdirOpt = typer.Option("/testbed", "--workdir", "-w", help="Working directory inside.")


def _config(
    layer: list[Path] | None,
    upper: Path | None,
    network: bool,
    ro: list[Path] | None,
    workdir: str,
) -> SandboxConfig:
    from .config import SandboxConfig

    try:
        return SandboxConfig(
            layers=layer or [], upper=upper, network=network, ro_paths=ro or [], workdir=workdir
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _fail(message: str) -> None:
    typer.secho(f"minisandbox: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


TasksArg = typer.Argument(
    ..., help="A dataset: `examples` (bundled), a SWE-bench parquet/JSON/JSONL file, a task file."
)
StoreOpt = typer.Option(
    None, "--store", envvar="MINISANDBOX_STORE", help="Layer store directory (shared or local)."
)
CacheOpt = typer.Option(
    None, "--cache", envvar="MINISANDBOX_CACHE", help="Node cache of unpacked layers."
)
MirrorOpt = typer.Option(
    None,
    "--git-mirror",
    envvar="MINISANDBOX_GIT_MIRROR",
    help="Directory of git clones named <owner>__<name> (default: clone from GitHub).",
)
EnvsOpt = typer.Option(
    None, "--envs-dir", help="Per-instance conda environment exports (<instance_id>.yml)."
)
IdsOpt = typer.Option(None, "--instance-ids", "-i", help="Only these tasks (repeatable).")


def _builder(tasks: str, store: Path | None, cache: Path | None, mirror: Path | None) -> Builder:
    from .builder import Builder, BuildSettings

    settings = BuildSettings()
    updates: dict[str, object] = {}
    if store is not None:
        updates["store"] = store
    if cache is not None:
        updates["cache"] = cache
    if mirror is not None:
        updates["git_mirror"] = mirror
    return Builder(settings.model_copy(update=updates))


def _load(tasks: str, envs_dir: Path | None, ids: list[str] | None) -> list[Task]:
    from .loaders import load_tasks

    return load_tasks(tasks, envs_dir=envs_dir, instance_ids=ids or None)


@app.command()
def shell(
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    task: str = typer.Option(None, "--task", help="Open the environment of this task instead."),
    tasks: str = typer.Option("examples", "--tasks", help="The dataset --task comes from."),
    envs_dir: Path = EnvsOpt,
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
) -> None:
    """Open an interactive bash in a fresh sandbox. Everything is gone when you exit, unless you
    pass --upper DIR. With --task ID: in that task's environment (built first if needed)."""
    from .errors import MiniSandboxError
    from .sandbox import Sandbox

    try:
        if task:
            (spec,) = _load(tasks, envs_dir, [task])
            opened = _builder(tasks, store, cache, mirror).sandbox(spec)
        else:
            opened = Sandbox(_config(layer, upper, network, ro, workdir))
        code = asyncio.run(_interactive_shell(opened))
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _interactive_shell(opened: AbstractAsyncContextManager[Sandbox]) -> int:
    import termios
    import tty

    from .session import open_terminal

    cols, rows = shutil.get_terminal_size()
    env = {"TERM": os.environ.get("TERM", "xterm"), "PS1": r"(sandbox) \w\$ "}
    async with opened as sb:
        term = await open_terminal(
            sb, ["/bin/bash", "--noprofile", "--norc", "-i"], env=env, rows=rows, columns=cols
        )
        term.release_peer()  # bash holds the terminal: from now on EIO means it exited
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        stdin_fd, stdout_fd = sys.stdin.fileno(), sys.stdout.fileno()
        interactive = os.isatty(stdin_fd)
        saved = termios.tcgetattr(stdin_fd) if interactive else None

        def from_sandbox() -> None:
            try:
                data = os.read(term.master, 65536)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:
                if not done.done():
                    done.set_result(None)
                return
            os.write(stdout_fd, data)

        def from_user() -> None:
            data = os.read(stdin_fd, 65536)
            if not data:
                loop.remove_reader(stdin_fd)
                return
            os.write(term.master, data)

        def resize(*_: object) -> None:
            import fcntl
            import struct

            c, r = shutil.get_terminal_size()
            fcntl.ioctl(term.master, termios.TIOCSWINSZ, struct.pack("HHHH", r, c, 0, 0))

        try:
            if interactive:
                tty.setraw(stdin_fd)
                loop.add_signal_handler(signal.SIGWINCH, resize)
            loop.add_reader(term.master, from_sandbox)
            loop.add_reader(stdin_fd, from_user)
            await done
        finally:
            loop.remove_reader(term.master)
            with contextlib.suppress(Exception):
                loop.remove_reader(stdin_fd)
            if saved is not None:
                termios.tcsetattr(stdin_fd, termios.TCSADRAIN, saved)
            term.close()
    return 0


@app.command(name="exec", context_settings={"allow_interspersed_args": False})
def exec_(
    command: list[str] = typer.Argument(..., help="The command and its arguments, after --."),
    layer: list[Path] = LayerOpt,
    upper: Path = UpperOpt,
    network: bool = NetworkOpt,
    ro: list[Path] = RoOpt,
    workdir: str = WorkdirOpt,
    timeout: float = typer.Option(
        None, "--timeout", "-t", help="Kill the command after this many seconds (exit code 124)."
    ),
) -> None:
    """Run one command in a fresh sandbox, stream its output, and exit with its exit code.

    Example: minisandbox exec --layer ./env -- python -c 'print(1)'"""
    from .errors import CommandTimeoutError, MiniSandboxError

    config = _config(layer, upper, network, ro, workdir)
    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        code = asyncio.run(_exec(config, command, timeout, stdin))
    except CommandTimeoutError as e:
        typer.secho(f"minisandbox: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(124) from None
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _exec(
    config: SandboxConfig, command: list[str], timeout: float | None, stdin: bytes | None
) -> int:
    from .sandbox import Sandbox

    def stream(fd: int, chunk: bytes) -> None:
        out = sys.stdout.buffer if fd == 1 else sys.stderr.buffer
        out.write(chunk)
        out.flush()

    async with Sandbox(config) as sb:
        result = await sb.execute(command, timeout=timeout, stdin=stdin, on_output=stream)
    return result.exit_code


@app.command()
def demo(
    sandboxes: int = typer.Option(4, "--sandboxes", "-n", help="How many sandboxes to start."),
    tasks: bool = typer.Option(True, "--tasks/--no-tasks", help="Build and run the examples."),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
) -> None:
    """Build the bundled example tasks, grade them in sandboxes (reward 0 without a patch, 1
    with the gold patch), and show side by side what sandboxes can and cannot do."""
    from .errors import MiniSandboxError

    try:
        if tasks:
            asyncio.run(_demo_tasks(_builder("examples", store, cache, None)))
        asyncio.run(_demo(sandboxes))
    except MiniSandboxError as e:
        _fail(str(e))


async def _demo_tasks(builder: Builder) -> None:
    from rich.console import Console
    from rich.table import Table

    from .evaluation import Evaluator
    from .loaders import load_tasks

    console = Console()
    tasks = load_tasks("examples")
    with console.status("building the example tasks (once; later runs reuse the layers)"):
        results = await asyncio.gather(*(builder.build(t) for t in tasks))
    for r in results:
        if r.status == "failed":
            raise typer.BadParameter(f"building {r.task_id} failed: {r.error}")
    table = Table(title="example tasks: each patch graded in a fresh sandbox, as SWE-bench does")
    table.add_column("task", no_wrap=True)
    for col in ("build", "start ms", "reward: no patch", "gold patch", "eval s"):
        table.add_column(col)
    evaluator = Evaluator(builder, timeout=600)

    async def run(task: Task, result: BuildResult) -> list[str]:
        async with builder.sandbox(task):  # first start unpacks the layers on this node
            pass
        began = time.perf_counter()
        async with builder.sandbox(task) as sb:
            start_ms = (time.perf_counter() - began) * 1000
            await sb.execute("true")
        empty = await evaluator.evaluate(task, "")
        gold = await evaluator.evaluate(task, task.gold_patch)

        def shown(r: EvalResult) -> str:
            colour = "green" if r.reward else "red"
            return f"[{colour}]{r.reward:g}[/{colour}]"

        return [
            task.id,
            result.status,
            f"{start_ms:.0f}",
            shown(empty),
            shown(gold),
            f"{gold.duration_s:.2f}",
        ]

    for row in await asyncio.gather(*(run(t, r) for t, r in zip(tasks, results, strict=True))):
        table.add_row(*row)
    console.print(table)


async def _demo(n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from .sandbox import Sandbox

    console = Console()
    table = Table(title=f"{n} sandboxes, started concurrently")
    for col in ("sandbox", "start ms", "whoami", "hostname", "sees host home", "net", "session"):
        table.add_column(col)

    async def one(i: int) -> list[str]:
        began = time.perf_counter()
        async with Sandbox(hostname=f"demo-{i}") as sb:
            started_ms = (time.perf_counter() - began) * 1000
            who = await sb.execute("whoami; hostname")
            home = os.path.expanduser("~")
            probe = await sb.execute(["ls", home])
            net = await sb.execute(
                ["bash", "-c", "exec 3<>/dev/tcp/1.1.1.1/53 && echo reachable || echo blocked"]
            )
            session = await sb.create_session()
            await session.run(f"cd /tmp && export DEMO={i}")
            state = await session.run("echo $PWD $DEMO")
            user, host = [*who.stdout.split(), "?", "?"][:2]
            return [
                sb.id,
                f"{started_ms:.0f}",
                user,
                host,
                "yes" if probe.exit_code == 0 and probe.stdout.strip() else "no",
                net.stdout.strip().splitlines()[-1] if net.stdout.strip() else "blocked",
                state.output.strip(),
            ]

    rows = await asyncio.gather(*(one(i) for i in range(n)))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    console.print(
        "Each sandbox: its own user, pid, mount, ipc, uts and network namespaces, an overlay "
        "root, a seccomp filter; nothing of your home is visible and nothing it writes "
        "reaches the host."
    )


@app.command(name="tasks")
def tasks_(
    tasks: str = TasksArg,
    envs_dir: Path = EnvsOpt,
    ids: list[str] = IdsOpt,
    json_out: bool = typer.Option(False, "--json", help="One JSON object per task."),
) -> None:
    """List a dataset's tasks."""
    from rich.console import Console
    from rich.table import Table

    from .errors import MiniSandboxError

    try:
        loaded = _load(tasks, envs_dir, ids)
    except MiniSandboxError as e:
        _fail(str(e))
    if json_out:
        for t in loaded:
            typer.echo(
                json.dumps(
                    {
                        "id": t.id,
                        "repo": t.repo,
                        "base_commit": t.base_commit,
                        "python": t.env.python,
                        "fail_to_pass": len(t.fail_to_pass),
                    }
                )
            )
        return
    table = Table(title=f"{len(loaded)} tasks in {tasks}")
    for col in ("id", "repo", "base commit", "python", "requirements", "FAIL_TO_PASS"):
        table.add_column(col)
    for t in loaded:
        table.add_row(
            t.id,
            t.repo,
            t.base_commit[:10],
            t.env.python,
            str(len(t.env.requirements)),
            str(len(t.fail_to_pass)),
        )
    Console().print(table)


@app.command()
def build(
    tasks: str = TasksArg,
    ids: list[str] = IdsOpt,
    jobs: int = typer.Option(2, "--jobs", "-j", help="Tasks built at once."),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    envs_dir: Path = EnvsOpt,
    force: bool = typer.Option(
        False, "--force", help="Rebuild layers already in the store (and re-validate)."
    ),
    validate: bool = typer.Option(
        False,
        "--validate",
        help="Then check each task: its gold patch must resolve it, the empty patch must not. "
        "The verdict is recorded in the store; exit 1 when a task fails.",
    ),
    json_out: bool = typer.Option(False, "--json", help="End with one JSON summary line."),
) -> None:
    """Build the environment and task layers of a dataset's tasks into the layer store.

    Each environment (a uv venv with pinned requirements) is built once and shared by the tasks
    with the same recipe; each task adds its repository at the base commit, installed."""
    from .errors import MiniSandboxError

    try:
        loaded = _load(tasks, envs_dir, ids)
        builder = _builder(tasks, store, cache, mirror)

        async def run() -> tuple[list[BuildResult], dict[str, Validation]]:
            results = await _build_all(builder, loaded, jobs, force, quiet=json_out)
            verdicts: dict[str, Validation] = {}
            if validate:
                ok = [t for t, r in zip(loaded, results, strict=True) if r.status != "failed"]
                verdicts = await _validate_all(builder, ok, jobs, force, quiet=json_out)
            return results, verdicts

        results, verdicts = asyncio.run(run())
    except MiniSandboxError as e:
        _fail(str(e))
    if not json_out:
        _build_table(results, verdicts if validate else None)
    failed = [r for r in results if r.status == "failed"]
    invalid = sorted(i for i, v in verdicts.items() if not v.valid)
    if json_out:
        summary: dict[str, object] = {
            "total": len(results),
            "built": [r.task_id for r in results if r.status == "built"],
            "cached": [r.task_id for r in results if r.status == "cached"],
            "failed": {r.task_id: r.error for r in failed},
        }
        if validate:
            summary["valid"] = sorted(i for i, v in verdicts.items() if v.valid)
            summary["invalid"] = {i: verdicts[i].reason for i in invalid}
        typer.echo(json.dumps(summary))
    raise typer.Exit(1 if failed or invalid else 0)


def _progress(console: Console, quiet: bool) -> Progress:
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    return Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        disable=quiet,
    )


async def _build_all(
    builder: Builder, tasks: list[Task], jobs: int, force: bool, quiet: bool
) -> list[BuildResult]:
    from rich.console import Console

    limit = asyncio.Semaphore(max(1, jobs))
    with _progress(Console(stderr=quiet), quiet) as progress:
        overall = progress.add_task("building", total=len(tasks))

        async def one(task: Task) -> BuildResult:
            async with limit:
                result = await builder.build(task, force=force)
            progress.advance(overall)
            return result

        return list(await asyncio.gather(*(one(t) for t in tasks)))


async def _validate_all(
    builder: Builder, tasks: list[Task], jobs: int, force: bool, quiet: bool
) -> dict[str, Validation]:
    from rich.console import Console

    from .errors import MiniSandboxError
    from .validation import validate

    limit = asyncio.Semaphore(max(1, jobs))
    verdicts: dict[str, Validation] = {}
    with _progress(Console(stderr=quiet), quiet) as progress:
        overall = progress.add_task("validating", total=len(tasks))

        async def one(task: Task) -> None:
            async with limit:
                try:
                    verdicts[task.id] = await validate(builder, task, force=force)
                except MiniSandboxError as e:
                    verdicts[task.id] = _unvalidated(task, str(e))
            progress.advance(overall)

        await asyncio.gather(*(one(t) for t in tasks))
    return verdicts


def _unvalidated(task: Task, reason: str) -> Validation:
    from .validation import Check, Validation, validation_key

    none = Check(status="error", resolved=False, swebench_resolved=False, reason=reason)
    return Validation(
        task=task.id, key=validation_key(task), valid=False, reason=reason, gold=none, empty=none
    )


def _build_table(results: list[BuildResult], verdicts: dict[str, Validation] | None) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="build summary")
    columns = ["task", "status", "seconds", "detail"]
    for col in [*columns, "validation"] if verdicts is not None else columns:
        table.add_column(col)
    for r in results:
        colour = {"built": "green", "cached": "cyan", "failed": "red"}[r.status]
        detail = (r.error or "").splitlines()[0][:120] if r.error else (r.task_layer or "")[:12]
        row = [r.task_id, f"[{colour}]{r.status}[/{colour}]", f"{r.seconds:.1f}", detail]
        if verdicts is not None:
            v = verdicts.get(r.task_id)
            row.append(
                "-"
                if v is None
                else "[green]valid[/green]"
                if v.valid
                else f"[red]invalid[/red]: {v.reason[:160]}"
            )
        table.add_row(*row)
    Console().print(table)


@app.command(name="eval")
def eval_(
    tasks: str = TasksArg,
    predictions: str = typer.Option(
        ...,
        "--predictions",
        "-p",
        help="SWE-bench predictions (instance_id, model_name_or_path, model_patch) as a .json "
        "list or object keyed by instance id, or .jsonl; or `gold` (each task's gold patch) or "
        "`empty` (no patch).",
    ),
    ids: list[str] = IdsOpt,
    jobs: int = typer.Option(2, "--jobs", "-j", help="Instances built and evaluated at once."),
    report: Path = typer.Option(
        None,
        "--report",
        help="Directory of the reports, laid out as SWE-bench's (default: "
        "logs/run_evaluation/<run id>).",
    ),
    run_id: str = typer.Option("minisandbox", "--run-id", help="Names the run's summary file."),
    timeout: float = typer.Option(1800.0, "--timeout", help="Seconds the tests may take."),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
    mirror: Path = MirrorOpt,
    envs_dir: Path = EnvsOpt,
    json_out: bool = typer.Option(False, "--json", help="End with one JSON summary line."),
) -> None:
    """Evaluate predicted patches as SWE-bench's harness does, each in a fresh task sandbox.

    Only tasks with a prediction are evaluated (their layers are built first when missing).
    Writes SWE-bench's per-instance report.json, test_output.txt and patch.diff under
    --report/<model>/<instance_id>/, and its run summary at --report/<model>.<run id>.json.
    Exits 0 whatever the verdicts; 2 on bad input."""
    from .errors import MiniSandboxError
    from .loaders import TaskNotFoundError
    from .predictions import SPECIAL, PredictionsError, load_predictions, special_predictions

    try:
        if predictions in SPECIAL:
            loaded = _load(tasks, envs_dir, ids)
            preds = special_predictions(predictions, loaded)
        else:
            preds = load_predictions(Path(predictions))
            if ids:
                preds = {i: p for i, p in preds.items() if i in set(ids)}
            if not preds:
                raise PredictionsError(f"{predictions}: no predictions to evaluate")
            try:
                loaded = _load(tasks, envs_dir, ids or list(preds))
            except TaskNotFoundError as e:
                if ids:
                    raise  # an --instance-ids problem
                # Name the first unknown one where the file has it (the loader lists them all).
                unknown = [p for i, p in preds.items() if re.search(rf"\b{re.escape(i)}\b", str(e))]
                where = unknown[0].where if unknown else predictions
                raise PredictionsError(
                    f"{where}: a prediction for an unknown instance ({e})"
                ) from None
        if not preds:
            raise PredictionsError(f"no tasks to evaluate in {tasks}")
        builder = _builder(tasks, store, cache, mirror)
        report_dir = report or Path("logs") / "run_evaluation" / run_id
        results = asyncio.run(
            _eval_all(builder, loaded, preds, report_dir, jobs, timeout, quiet=json_out)
        )
    except MiniSandboxError as e:
        _fail(str(e))
    _eval_summary(loaded, preds, results, report_dir, run_id, json_out)


async def _eval_all(
    builder: Builder,
    tasks: list[Task],
    preds: dict[str, Prediction],
    report_dir: Path,
    jobs: int,
    timeout: float,
    quiet: bool,
) -> dict[str, EvalResult]:
    from rich.console import Console

    from .evaluation import EvalResult, Evaluator, evaluate_many
    from .predictions import write_instance_report

    todo = [t for t in tasks if t.id in preds]
    builds = await _build_all(builder, todo, jobs, False, quiet=quiet)
    results: dict[str, EvalResult] = {}
    ready = []
    for t, b in zip(todo, builds, strict=True):
        if b.status == "failed":
            reason = f"building the task failed: {(b.error or '').splitlines()[0][:300]}"
            results[t.id] = EvalResult(
                instance_id=t.id, status="error", resolved=False, reward=0.0, reason=reason
            )
        else:
            ready.append(t)
    by_id = {t.id: t for t in todo}
    for r in results.values():
        write_instance_report(report_dir, by_id[r.instance_id], preds[r.instance_id], r)
    with _progress(Console(stderr=quiet), quiet) as progress:
        overall = progress.add_task("evaluating", total=len(todo), completed=len(results))

        def done(r: EvalResult) -> None:
            write_instance_report(report_dir, by_id[r.instance_id], preds[r.instance_id], r)
            progress.advance(overall)

        evaluated = await evaluate_many(
            Evaluator(builder, timeout=timeout),
            [(t, preds[t.id].model_patch) for t in ready],
            jobs=jobs,
            on_done=done,
        )
    results.update({r.instance_id: r for r in evaluated})
    return {t.id: results[t.id] for t in todo}  # in the dataset's order


def _eval_summary(
    tasks: list[Task],
    preds: dict[str, Prediction],
    results: dict[str, EvalResult],
    report_dir: Path,
    run_id: str,
    json_out: bool,
) -> None:
    from rich.console import Console
    from rich.table import Table

    from .predictions import model_dir, run_report

    model = next(iter(preds.values())).model_name_or_path
    summary_path = report_dir / f"{model_dir(model)}.{run_id}.json"
    report_dir.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(run_report(tasks, preds, results), indent=4) + "\n")
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
                    "reasons": {i: r.reason for i, r in results.items() if r.reason},
                    "model": model,
                    "report": str(summary_path),
                }
            )
        )
        return
    console = Console()
    table = Table(title=f"evaluation of {model}")
    for col in ("instance", "status", "reward", "seconds", "reason"):
        table.add_column(col)
    for i, r in results.items():
        colour = {"resolved": "green", "unresolved": "yellow", "error": "red"}[r.status]
        reason = r.reason.splitlines()[0][:160] if r.reason else ""
        table.add_row(
            i, f"[{colour}]{r.status}[/{colour}]", f"{r.reward:g}", f"{r.duration_s:.1f}", reason
        )
    console.print(table)
    console.print(
        f"resolved {len(by_status['resolved'])}/{len(results)}, unresolved "
        f"{len(by_status['unresolved'])}, error {len(by_status['error'])}; "
        f"reports in {report_dir}, summary {summary_path}"
    )


cache_app = typer.Typer(no_args_is_help=True, help="Inspect and tidy the layer store.")
app.add_typer(cache_app, name="cache")


def _store(store: Path | None) -> LayerStore:
    from .builder import BuildSettings
    from .store import LayerStore

    return LayerStore(store or BuildSettings().store)


def _mb(n: int) -> str:
    return f"{n / 1e6:,.1f} MB"


@cache_app.command("ls")
def cache_ls(store: Path = StoreOpt) -> None:
    """List the stored layers: what each is, its unpacked size, what it added to the store."""
    from rich.console import Console
    from rich.table import Table

    s = _store(store)
    names: dict[str, list[str]] = {}
    for ref, layer in s.refs().items():
        names.setdefault(layer, []).append(ref)
    table = Table(title=f"layers in {s.root}")
    for col in ("layer", "kind", "for", "size", "stored", "files", "created"):
        table.add_column(col)
    for ref in sorted(s.list(), key=lambda r: r.created):
        meta = ref.meta or {}
        what = meta.get("task") or ", ".join(meta.get("recipe", {}).get("requirements", [])[:3])
        table.add_row(
            ref.id[:12],
            str(meta.get("kind", "?")),
            str(what)[:40],
            _mb(ref.size),
            _mb(ref.stored_bytes),
            str(ref.files),
            ref.created.strftime("%Y-%m-%d %H:%M"),
        )
    Console().print(table)


@cache_app.command("du")
def cache_du(store: Path = StoreOpt, cache: Path = CacheOpt) -> None:
    """Bytes stored against bytes the layers hold unpacked (the deduplication), and the node
    cache's use of its cap."""
    from .builder import Builder, BuildSettings

    settings = BuildSettings()
    if store is not None:
        settings = settings.model_copy(update={"store": store})
    if cache is not None:
        settings = settings.model_copy(update={"cache": cache})
    builder = Builder(settings)
    du = builder.store.du()
    usage = builder.cache.usage()
    typer.echo(
        f"store {builder.store.root}: {du['layers']} layers, {_mb(du['stored_bytes'])} "
        f"stored for {_mb(du['logical_bytes'])} of layer content "
        f"(x{du['ratio']}), {du['unique_blobs']} blobs"
    )
    typer.echo(
        f"node cache {builder.cache.root}: {usage.layers} layers unpacked, "
        f"{_mb(usage.bytes)} of {_mb(usage.max_bytes)}, {len(usage.pinned)} in use"
    )


@cache_app.command("verify")
def cache_verify(
    store: Path = StoreOpt,
    repair: bool = typer.Option(False, "--repair", help="Move corrupt blobs aside."),
) -> None:
    """Re-hash every blob and manifest; exit 1 when anything is corrupt or missing."""
    problems = _store(store).verify(repair=repair)
    for p in problems:
        typer.secho(p, fg=typer.colors.RED)
    typer.echo(f"{len(problems)} problems")
    raise typer.Exit(1 if problems else 0)


@cache_app.command("gc")
def cache_gc(store: Path = StoreOpt) -> None:
    """Remove unreferenced layers and blobs, and leftovers of interrupted publishes."""
    report = _store(store).gc()
    typer.echo(
        f"removed {len(report.removed_layers)} layers, {report.removed_blobs} blobs, "
        f"{report.removed_temps} temp files; freed {_mb(report.freed_bytes)}"
    )
    for p in report.problems:
        typer.secho(p, fg=typer.colors.YELLOW)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
