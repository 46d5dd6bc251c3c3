"""`demo`: the example tasks graded in sandboxes, and what sandboxes can and cannot do."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from minisandbox.cli.aiorun import run_async
from minisandbox.cli.app import (
    CacheOpt,
    StoreOpt,
    add_columns,
    count,
    fail,
    make_builder,
    out_console,
    print_table,
)
from minisandbox.cli.progress import Progress
from minisandbox.utils.aio import all_or_none

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.evaluation.evaluator import EvalResult, Evaluator
    from minisandbox.tasks.builder import Builder, BuildResult
    from minisandbox.tasks.specs import Task


def demo(
    sandboxes: int = typer.Option(
        4, "--sandboxes", "-n", min=1, metavar="N", help="How many sandboxes to start."
    ),
    tasks: bool = typer.Option(True, "--tasks/--no-tasks", help="Build and run the examples."),
    store: Path = StoreOpt,
    cache: Path = CacheOpt,
) -> None:
    """Build the bundled example tasks, grade them in sandboxes (reward 0 without a patch, 1
    with the gold patch), and show side by side what sandboxes can and cannot do."""
    from minisandbox.errors import MiniSandboxError

    try:
        if tasks:
            run_async(_demo_tasks(make_builder(store, cache, None)))
        run_async(_demo_sandboxes(sandboxes))
    except MiniSandboxError as e:
        fail(str(e))


async def _demo_tasks(builder: Builder) -> None:
    from rich.table import Table

    from minisandbox.errors import TaskBuildError
    from minisandbox.evaluation.evaluator import Evaluator
    from minisandbox.tasks.loaders import load_tasks

    tasks = load_tasks("examples")
    progress = Progress(
        "the example tasks (built once; later runs reuse the layers)", len(tasks), False
    )
    with progress:
        results = await all_or_none(builder.build(t, on_phase=progress.phase) for t in tasks)
        for r in results:
            if r.status == "failed":
                raise TaskBuildError(f"building {r.task_id} failed: {r.error}")
        evaluator = Evaluator(builder, timeout=600, on_phase=progress.phase)
        rows = await all_or_none(
            _demo_task(builder, evaluator, t, r, progress)
            for t, r in zip(tasks, results, strict=True)
        )
    table = Table(title="example tasks: each patch graded in a fresh sandbox, as SWE-bench does")
    columns = ("task", "build", "start ms", "reward: no patch", "gold patch", "eval s")
    add_columns(table, columns, [t.id for t in tasks])
    for row in rows:
        table.add_row(*row)
    print_table(table)


async def _demo_task(
    builder: Builder, evaluator: Evaluator, task: Task, result: BuildResult, progress: Progress
) -> list[str]:
    """The example task's row: its build, a sandbox's start time, and both patches' rewards."""
    progress.phase(task.id, "unpacking its layers")
    async with builder.sandbox(task):  # first start unpacks the layers on this node
        pass
    began = time.perf_counter()
    async with builder.sandbox(task) as sb:
        start_ms = (time.perf_counter() - began) * 1000
        await sb.execute("true")
    empty = await evaluator.evaluate(task, "")
    gold = await evaluator.evaluate(task, task.gold_patch)
    progress.done(task.id, f"no patch: reward {empty.reward:g}, gold patch: {gold.reward:g}")

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


async def _demo_sandboxes(n: int) -> None:
    from rich.table import Table

    console = out_console()
    table = Table(title=f"{count(n, 'sandbox', 'sandboxes')}, started concurrently")
    for col in ("sandbox", "start ms", "whoami", "hostname", "sees host home", "net", "session"):
        table.add_column(col)
    rows = await all_or_none(_demo_sandbox(i) for i in range(n))
    for row in rows:
        table.add_row(*row)
    print_table(table)
    console.print(
        "Each sandbox: its own user, pid, mount, ipc, uts and network namespaces, an overlay "
        "root, a seccomp filter; nothing of your home is visible and nothing it writes "
        "reaches the host."
    )


async def _demo_sandbox(i: int) -> list[str]:
    """Sandbox `i`'s row: its start time, who it runs as, what it sees, its session's state."""
    from minisandbox.sandbox.sandbox import Sandbox

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
