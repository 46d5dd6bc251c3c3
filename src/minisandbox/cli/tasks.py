"""`tasks`: list a dataset's tasks."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from minisandbox.cli.app import (
    AbsPathsOpt,
    EnvsOpt,
    IdsOpt,
    TasksArg,
    add_columns,
    fail,
    load_dataset,
)


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
        loaded = load_dataset(tasks, envs_dir, ids, allow_abs)
    except MiniSandboxError as e:
        fail(str(e))
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
    columns = ("id", "repo", "base commit", "python", "requirements", "FAIL_TO_PASS")
    add_columns(table, columns, [t.id for t in loaded])
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
