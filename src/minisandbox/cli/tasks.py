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
    count,
    fail,
    load_dataset,
    print_table,
)


def tasks_(
    tasks: str = TasksArg,
    envs_dir: Path = EnvsOpt,
    ids: list[str] = IdsOpt,
    json_out: bool = typer.Option(False, "--json", help="One JSON object per task."),
    allow_abs: bool = AbsPathsOpt,
) -> None:
    """List a dataset's tasks: id, repository, base commit, Python, and how many failing tests
    each must fix (with --json, also how many packages its environment pins)."""
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
                        "python": t.env.python or "inferred",
                        "fail_to_pass": len(t.fail_to_pass),
                        "packages": len(t.env.requirements),
                    }
                )
            )
        return
    table = Table(title=f"{count(len(loaded), 'task')} in {tasks}")
    # What fits 80 columns whole; --json has more (the packages of the environment).
    columns = ("id", "repo", "base commit", "python", "failing")
    add_columns(table, columns, [t.id for t in loaded], wrap=("repo",))
    for t in loaded:
        table.add_row(
            t.id, t.repo, t.base_commit[:10], t.env.python or "inferred", str(len(t.fail_to_pass))
        )
    print_table(table)
