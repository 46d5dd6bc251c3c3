"""The `minisandbox` command line."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import json
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Coroutine
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import typer

from minisandbox.utils.aio import all_or_none

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from rich.progress import Progress, TaskID

    from minisandbox.evaluation.evaluator import EvalResult
    from minisandbox.evaluation.predictions import Prediction
    from minisandbox.evaluation.validation import Validation
    from minisandbox.layers.store import LayerStore
    from minisandbox.sandbox.config import SandboxConfig
    from minisandbox.sandbox.sandbox import Sandbox
    from minisandbox.tasks.builder import Builder, BuildResult
    from minisandbox.tasks.specs import Task

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
    from minisandbox.sandbox.config import SandboxConfig

    _place("upper", upper, "--upper")
    try:
        return SandboxConfig(
            layers=layer or [], upper=upper, network=network, ro_paths=ro or [], workdir=workdir
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def _fail(message: str) -> None:
    """Every error ends here: one line on stderr, exit status 2."""
    typer.secho(f"minisandbox: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


# ---------------------------------------------------------------- disk full and friends

# Where the CLI writes, and the setting that moves each place: filled in by the commands, so
# that an OSError is explained by the place it hit.
_PLACES: dict[str, tuple[Path, str]] = {}

_FIXES = {
    errno.ENOSPC: "free space on its filesystem, or point {knob} elsewhere",
    errno.EDQUOT: "free space within your quota there, or point {knob} elsewhere",
    errno.EROFS: "it is on a read-only filesystem: point {knob} elsewhere",
    errno.EACCES: "uid {uid} may not write there: fix its permissions, or point {knob} elsewhere",
    errno.EPERM: "uid {uid} may not write there: fix its permissions, or point {knob} elsewhere",
}


def _place(name: str, path: Path | None, knob: str) -> None:
    if path is not None:
        _PLACES[name] = (Path(os.path.abspath(path)), knob)


def _default_places() -> None:
    """The places every command may write to (the sandboxes' runtime directory)."""
    from minisandbox.sandbox.runtime import runtime_root

    _place("runtime", runtime_root(), "MINISANDBOX_RUNTIME (or TMPDIR)")


def _filesystem(path: Path) -> tuple[int, int] | None:
    """(device, bytes free) of the filesystem holding `path` or its nearest existing parent."""
    for candidate in (path, *path.parents):
        try:
            st = os.statvfs(candidate)
            dev = os.stat(candidate).st_dev
        except OSError:
            continue
        return dev, st.f_bavail * st.f_frsize
    return None


def _fullest(places: list[tuple[Path, str]]) -> tuple[list[tuple[Path, str]], int] | None:
    """The places on the filesystem with the least room left, and that room."""
    by_dev: dict[int, tuple[list[tuple[Path, str]], int]] = {}
    for root, knob in places:
        fs = _filesystem(root)
        if fs is not None:
            by_dev.setdefault(fs[0], ([], fs[1]))[0].append((root, knob))
    return min(by_dev.values(), key=lambda group: group[1]) if by_dev else None


def _explain_os_error(e: OSError) -> str:
    """One line for an OSError: the path it hit and what to do about it.

    A failed write() names no file: then the first error of its chain that does is used, or for
    ENOSPC the places on the fullest filesystem, or else every place the command writes to."""
    name = None
    seen: BaseException | None = e
    for _ in range(16):  # a clean-up's error hides the first one in its context: look there too
        if seen is None:
            break
        if (
            isinstance(seen, OSError)
            and seen.errno == e.errno
            and isinstance(seen.filename, (str, bytes, os.PathLike))
        ):
            name = seen.filename
            break
        seen = seen.__cause__ or seen.__context__
    path = Path(os.path.abspath(os.fsdecode(name))) if name is not None else None
    # The deepest place first: the node cache may live inside the store's folder.
    places = sorted(_PLACES.values(), key=lambda p: len(p[0].parts), reverse=True)
    knob = " / ".join(dict.fromkeys(k for _, k in places)) or "it"
    if path is not None:
        knob = next((k for root, k in places if path == root or root in path.parents), knob)
    what = e.strerror or str(e)
    where = f"{path}: " if path is not None else ""
    if path is None and places:
        where = f"writing under one of {', '.join(str(p) for p, _ in places)}: "
        fullest = _fullest(places) if e.errno == errno.ENOSPC else None
        if fullest is not None:  # the write named no file: the likeliest culprit
            group, free = fullest
            knob = " / ".join(dict.fromkeys(k for _, k in group))
            where = f"{', '.join(str(p) for p, _ in group)}: "
            what += f" (the fullest filesystem this command writes to; {free >> 20} MiB free now)"
    fix = _FIXES.get(e.errno or 0, "")
    line = f"{where}{what}"
    if fix:
        line += "; " + fix.format(knob=knob, uid=os.geteuid())
    return line.replace("\n", " ")


T = TypeVar("T")
_DRAIN_GRACE = 120.0  # seconds left to what a command's main coroutine leaves running


class _DaemonThreads(concurrent.futures.ThreadPoolExecutor):  # asyncio accepts only these
    """The CLI's default executor: each blocking call in a daemon thread of its own. asyncio.run
    (and the interpreter's exit) joins the threads of the standard executor without a timeout:
    one thread blocked for good (a read of a pipe whose writer never writes, a flock) made the
    CLI hang after an error instead of exiting. A call also never waits in a queue behind others,
    where the descriptor it was given could be closed (and its number reused) before it runs."""

    def submit(  # type: ignore[override]
        self, fn: Callable[..., T], /, *args: Any, **kwargs: Any
    ) -> concurrent.futures.Future[T]:
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(fn(*args, **kwargs))
            except BaseException as e:
                future.set_exception(e)

        threading.Thread(target=run, name="minisandbox-call", daemon=True).start()
        return future

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        pass  # nothing pooled; a thread still blocked is a daemon and does not hold the exit


def _run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run for the commands, made to end. What `main` leaves running (a shielded layer
    unpack goes on when its caller is cancelled) is awaited, its errors retrieved (not printed
    as tracebacks at shutdown), and cancelled after a grace period; threads are not joined."""

    async def body() -> T:
        asyncio.get_running_loop().set_default_executor(_DaemonThreads())
        try:
            return await main
        finally:
            await _drain(asyncio.current_task())

    return asyncio.run(body())


async def _drain(me: asyncio.Task[Any] | None) -> None:
    rest = [t for t in asyncio.all_tasks() if t is not me]
    if not rest:
        return
    _done, pending = await asyncio.wait(rest, timeout=_DRAIN_GRACE)
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.wait(pending, timeout=_DRAIN_GRACE)
    for t in rest:
        if t.done() and not t.cancelled():
            t.exception()  # retrieved: the command reports the error that ended it


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
QuietOpt = typer.Option(
    False, "--quiet", "-q", help="No progress on stderr (each instance's phases and verdict)."
)
IdsOpt = typer.Option(None, "--instance-ids", "-i", help="Only these tasks (repeatable).")
AbsPathsOpt = typer.Option(
    False,
    "--allow-absolute-paths",
    help="Let the dataset's records name files outside its folder and --envs-dir (absolute "
    "paths, ~, ..); refused by default.",
)


def _builder(tasks: str, store: Path | None, cache: Path | None, mirror: Path | None) -> Builder:
    from minisandbox.tasks.builder import Builder, BuildSettings

    settings = BuildSettings()
    updates: dict[str, object] = {}
    if store is not None:
        updates["store"] = store
    if cache is not None:
        updates["cache"] = cache
    if mirror is not None:
        updates["git_mirror"] = mirror
    settings = settings.model_copy(update=updates)
    _place("store", settings.store.parent, "MINISANDBOX_STORE (--store)")
    _place("cache", settings.cache, "MINISANDBOX_CACHE (--cache)")
    return Builder(settings)


def _load(
    tasks: str, envs_dir: Path | None, ids: list[str] | None, allow_abs: bool = False
) -> list[Task]:
    from minisandbox.tasks.loaders import load_tasks

    return load_tasks(
        tasks, envs_dir=envs_dir, instance_ids=ids or None, allow_absolute_paths=allow_abs
    )


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
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """Open an interactive bash in a fresh sandbox. Everything is gone when you exit, unless you
    pass --upper DIR. With --task ID: in that task's environment (built first if needed)."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.sandbox.sandbox import Sandbox

    try:
        if task:
            (spec,) = _load(tasks, envs_dir, [task], allow_abs)
            opened = _builder(tasks, store, cache, mirror).sandbox(spec)
        else:
            opened = Sandbox(_config(layer, upper, network, ro, workdir))
        code = _run(_interactive_shell(opened))
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _interactive_shell(opened: AbstractAsyncContextManager[Sandbox]) -> int:
    import termios
    import tty

    from minisandbox.sandbox.session import open_terminal

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
    from minisandbox.errors import CommandTimeoutError, MiniSandboxError

    config = _config(layer, upper, network, ro, workdir)
    stdin = None if sys.stdin.isatty() else sys.stdin.buffer.read()
    try:
        code = _run(_exec(config, command, timeout, stdin))
    except CommandTimeoutError as e:
        typer.secho(f"minisandbox: {e}", fg=typer.colors.RED, err=True)
        raise typer.Exit(124) from None
    except MiniSandboxError as e:
        _fail(str(e))
    raise typer.Exit(code)


async def _exec(
    config: SandboxConfig, command: list[str], timeout: float | None, stdin: bytes | None
) -> int:
    from minisandbox.sandbox.sandbox import Sandbox

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
    from minisandbox.errors import MiniSandboxError

    try:
        if tasks:
            _run(_demo_tasks(_builder("examples", store, cache, None)))
        _run(_demo(sandboxes))
    except MiniSandboxError as e:
        _fail(str(e))


async def _demo_tasks(builder: Builder) -> None:
    from rich.console import Console
    from rich.table import Table

    from minisandbox.evaluation.evaluator import Evaluator
    from minisandbox.tasks.loaders import load_tasks

    console = Console()
    tasks = load_tasks("examples")
    with console.status("building the example tasks (once; later runs reuse the layers)"):
        results = await all_or_none(builder.build(t) for t in tasks)
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

    for row in await all_or_none(run(t, r) for t, r in zip(tasks, results, strict=True)):
        table.add_row(*row)
    console.print(table)


async def _demo(n: int) -> None:
    from rich.console import Console
    from rich.table import Table

    from minisandbox.sandbox.sandbox import Sandbox

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

    rows = await all_or_none(one(i) for i in range(n))
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
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """List a dataset's tasks."""
    from rich.console import Console
    from rich.table import Table

    from minisandbox.errors import MiniSandboxError

    try:
        loaded = _load(tasks, envs_dir, ids, allow_abs)
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

    try:
        loaded = _load(tasks, envs_dir, ids, allow_abs)
        builder = _builder(tasks, store, cache, mirror)

        async def run() -> tuple[list[BuildResult], dict[str, Validation]]:
            with _Progress("building", len(loaded), quiet) as progress:
                results = await _build_all(builder, loaded, jobs, force, progress)
            verdicts: dict[str, Validation] = {}
            if validate:
                ok = [t for t, r in zip(loaded, results, strict=True) if r.status != "failed"]
                with _Progress("validating", len(ok), quiet) as progress:
                    verdicts = await _validate_all(builder, ok, jobs, force, progress)
            return results, verdicts

        results, verdicts = _run(run())
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
            "warnings": {r.task_id: r.warnings for r in results if r.warnings},
            # Environments whose pins conflict as pip packages, installed as they are.
            "unresolved": [r.task_id for r in results if r.unresolved],
            # Pins an environment stepped down to install (relax.py), per task.
            "relaxed": {
                r.task_id: [x.model_dump(exclude={"conflict"}) for x in r.relaxed]
                for r in results
                if r.relaxed
            },
        }
        if validate:
            summary["valid"] = sorted(i for i, v in verdicts.items() if v.valid)
            summary["invalid"] = {i: verdicts[i].reason for i in invalid}
        typer.echo(json.dumps(summary))
    raise typer.Exit(1 if failed or invalid else 0)


class _Progress:
    """Progress on stderr (stdout is for results, `--json`'s included), one entry per
    instance: on a terminal, a live row per instance in flight (its phase and time) under an
    overall bar, and a line as each one finishes; elsewhere (a pipe, a log file) a line per
    phase and per finished instance. Nothing when `quiet`."""

    def __init__(self, what: str, total: int, quiet: bool) -> None:
        from rich.console import Console

        self.total, self.quiet, self.finished = total, quiet, 0
        self.console = Console(stderr=True, highlight=False)
        self._began: dict[str, float] = {}
        self._rows: dict[str, TaskID] = {}
        self._live: Progress | None = None
        if not quiet and self.console.is_terminal:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._live = Progress(
                TextColumn("{task.description}", markup=False),
                BarColumn(),
                TextColumn("{task.fields[count]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._overall = self._live.add_task(what, total=total, count=f"0/{total}")

    def __enter__(self) -> _Progress:
        if self._live is not None:
            self._live.start()
        return self

    def __exit__(self, *_: object) -> None:
        if self._live is not None:
            self._live.stop()

    def phase(self, task_id: str, phase: str) -> None:
        """`task_id` is now at `phase` (an `on_phase` hook of the builder and evaluator)."""
        if self.quiet:
            return
        self._began.setdefault(task_id, time.monotonic())
        text = f"{task_id}: {phase}"
        if self._live is None:
            self.console.print(text, markup=False, soft_wrap=True)
        elif task_id in self._rows:
            self._live.update(self._rows[task_id], description=text)
        else:
            self._rows[task_id] = self._live.add_task(text, total=None, count="")

    def done(self, task_id: str, verdict: str) -> None:
        """`task_id` finished with `verdict` (its first line is shown)."""
        if self.quiet:
            return
        self.finished += 1
        seconds = time.monotonic() - self._began.pop(task_id, time.monotonic())
        first = verdict.splitlines()[0] if verdict else ""
        text = f"[{self.finished}/{self.total}] {task_id}: {first} ({seconds:.1f} s)"
        if self._live is None:
            self.console.print(text, markup=False, soft_wrap=True)
            return
        row = self._rows.pop(task_id, None)
        if row is not None:
            self._live.remove_task(row)
        self._live.console.print(text, markup=False, soft_wrap=True)
        self._live.update(
            self._overall, advance=1, count=f"{self.finished}/{self.total}", refresh=True
        )


def _build_verdict(r: BuildResult) -> str:
    return f"failed: {r.error}" if r.status == "failed" else r.status


async def _build_all(
    builder: Builder,
    tasks: list[Task],
    jobs: int,
    force: bool,
    progress: _Progress,
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
    builder: Builder, tasks: list[Task], jobs: int, force: bool, progress: _Progress
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
        if r.unresolved:
            detail += " (pins installed unresolved"
            detail += f", {len(r.relaxed)} relaxed)" if r.relaxed else ")"
        for warning in r.warnings:
            detail += f"\nwarning: {warning}"
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
    quiet: bool = QuietOpt,
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """Evaluate predicted patches as SWE-bench's harness does, each in a fresh task sandbox.

    Only tasks with a prediction are evaluated (their layers are built first when missing).
    Writes SWE-bench's per-instance report.json, test_output.txt and patch.diff under
    --report/<model>/<instance_id>/ as each instance finishes, and its run summary at
    --report/<model>.<run id>.json at the end. Exits 0 whatever the verdicts; 2 on bad input
    or when a write fails (disk full, quota, read-only, permission): then the run stops, the
    reports of the instances finished so far stay, and no summary is written."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.evaluation.predictions import (
        SPECIAL,
        PredictionsError,
        load_predictions,
        special_predictions,
    )
    from minisandbox.tasks.loaders import TaskNotFoundError
    from minisandbox.tasks.specs import path_name_problem

    problem = path_name_problem(run_id)
    if problem is not None:
        _fail(f"--run-id {run_id!r} {problem}: it names the run's directory and summary file")
    report_dir = report or Path("logs") / "run_evaluation" / run_id
    _place("report", report_dir, "--report")
    written: list[str] = []
    try:
        if predictions in SPECIAL:
            loaded = _load(tasks, envs_dir, ids, allow_abs)
            preds = special_predictions(predictions, loaded)
        else:
            preds = load_predictions(Path(predictions))
            if ids:
                preds = {i: p for i, p in preds.items() if i in set(ids)}
            if not preds:
                raise PredictionsError(f"{predictions}: no predictions to evaluate")
            try:
                loaded = _load(tasks, envs_dir, ids or list(preds), allow_abs)
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
        _check_writable(report_dir)  # before hours of evaluation, not after
        results = _run(_eval_all(builder, loaded, preds, report_dir, jobs, timeout, quiet, written))
        _eval_summary(loaded, preds, results, report_dir, run_id, json_out)
    except MiniSandboxError as e:
        _fail(str(e))
    except OSError as e:
        kept = f" (the run stopped; {len(written)} finished reports are kept)" if written else ""
        _fail(f"{_explain_os_error(e)}{kept}")


def _check_writable(directory: Path) -> None:
    """Create `directory` and write a file in it, or raise the OSError that says why not."""
    from minisandbox.evaluation.predictions import write_file

    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".minisandbox-probe-{os.getpid()}"
    write_file(probe, "probe\n")
    probe.unlink()


async def _eval_all(
    builder: Builder,
    tasks: list[Task],
    preds: dict[str, Prediction],
    report_dir: Path,
    jobs: int,
    timeout: float,
    quiet: bool,
    written: list[str],
) -> dict[str, EvalResult]:
    """Build, then evaluate, writing each instance's report as soon as it is known (into
    `written`, the ids whose report is complete). The first failed write stops the run: the
    running evaluations are cancelled (their sandboxes stopped), and the OSError is raised.
    Each instance's phases and verdict go to stderr unless `quiet`."""
    todo = [t for t in tasks if t.id in preds]
    with _Progress("evaluating", len(todo), quiet) as progress:
        return await _build_and_eval(
            builder, todo, preds, report_dir, jobs, timeout, written, progress
        )


async def _build_and_eval(
    builder: Builder,
    todo: list[Task],
    preds: dict[str, Prediction],
    report_dir: Path,
    jobs: int,
    timeout: float,
    written: list[str],
    progress: _Progress,
) -> dict[str, EvalResult]:
    from minisandbox.evaluation.evaluator import EvalResult, Evaluator, evaluate_many
    from minisandbox.evaluation.predictions import write_instance_report

    builds = await _build_all(builder, todo, jobs, False, progress, final=False)
    results: dict[str, EvalResult] = {}
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
    by_id = {t.id: t for t in todo}

    def write(r: EvalResult) -> None:
        write_instance_report(report_dir, by_id[r.instance_id], preds[r.instance_id], r)
        written.append(r.instance_id)

    for r in results.values():
        write(r)

    def done(r: EvalResult) -> None:
        write(r)
        progress.done(r.instance_id, f"{r.status}: {r.reason}" if r.reason else r.status)

    evaluated = await evaluate_many(
        Evaluator(builder, timeout=timeout, on_phase=progress.phase),
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

    from minisandbox.evaluation.predictions import model_dir, run_report, write_file

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
    from minisandbox.layers.store import LayerStore
    from minisandbox.tasks.builder import BuildSettings

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
    from minisandbox.tasks.builder import Builder, BuildSettings

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
    cache: Path = CacheOpt,
    repair: bool = typer.Option(
        False,
        "--repair",
        help="Move corrupt blobs aside and drop the refs of broken layers (the next build "
        "rebuilds them).",
    ),
) -> None:
    """Re-hash every blob and manifest, and every file of the node's pool against the store;
    exit 1 when anything is corrupt or missing."""
    from minisandbox.layers.pool import FilePool
    from minisandbox.tasks.builder import BuildSettings

    s = _store(store)
    report = s.check(repair=repair)
    problems = list(report.problems)
    pool_root = (cache or BuildSettings().cache) / "pool"
    if pool_root.is_dir():
        pool_problems = FilePool(pool_root).verify(s.read_blob)
        problems += pool_problems
        if pool_problems:
            problems.append(
                f"the node cache's pool at {pool_root} holds bad files: clear the node cache "
                "(remove it while no sandbox runs) and its layers are unpacked anew"
            )
    for p in problems:
        typer.secho(p, fg=typer.colors.RED)
    typer.echo(f"{len(problems)} problems")
    if report.dropped_refs:
        typer.echo(
            f"dropped {len(report.dropped_refs)} refs of broken layers: "
            "`minisandbox build` rebuilds them"
        )
    raise typer.Exit(1 if problems else 0)


@cache_app.command("gc")
def cache_gc(store: Path = StoreOpt) -> None:
    """Remove unreferenced layers and blobs, leftovers of interrupted publishes, and the work
    directories of builds whose process is gone (killed builds)."""
    from minisandbox.tasks.builder import BuildSettings, build_tmp, sweep_build_tmp

    s = _store(store)
    report = s.gc()
    settings = BuildSettings() if store is None else BuildSettings(store=store)
    swept = sweep_build_tmp(build_tmp(settings))
    freed = report.freed_bytes + sum(size for _path, size in swept)
    typer.echo(
        f"removed {len(report.removed_layers)} layers, {report.removed_blobs} blobs, "
        f"{report.removed_temps} temp files, {len(swept)} stale build directories; "
        f"freed {_mb(freed)}"
    )
    for path, size in swept:
        typer.echo(f"  removed {path} ({_mb(size)})")
    for p in report.problems:
        typer.secho(p, fg=typer.colors.YELLOW)


def main() -> None:
    """The `minisandbox` command. An OSError that reaches here (disk full, quota, read-only
    filesystem, permission...) ends it with one line naming the path and the fix, exit 2."""
    try:
        _default_places()
        app()
    except OSError as e:
        typer.secho(f"minisandbox: {_explain_os_error(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
