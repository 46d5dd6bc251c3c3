"""The `minisandbox` command line.

- `app`: the typer app, the options commands share, the one-line error exit, the builder;
- `sandboxes`: `shell` and `exec`; `demo`; `tasks`; `build` (and `build_all`, which `eval`
  uses); `evaluate`: `eval`; `cache`: the `cache` commands;
- `progress`: per-instance progress on stderr; `aiorun`: asyncio.run made to end;
- `oserrors`: an OSError (disk full, quota, permission) explained by the place it hit.

Heavy modules are imported inside the commands, so that `minisandbox --help` stays fast.
"""

from __future__ import annotations

import sys

import typer

from minisandbox.cli import build, cache, demo, evaluate, sandboxes, tasks
from minisandbox.cli.app import app
from minisandbox.cli.oserrors import explain_os_error

__all__ = ["app", "main"]

# The commands, in the order --help lists them.
app.command()(sandboxes.shell)
app.command(name="exec", context_settings={"allow_interspersed_args": False})(sandboxes.exec_)
app.command()(demo.demo)
app.command(name="tasks")(tasks.tasks_)
app.command()(build.build)
app.command(name="eval")(evaluate.eval_)
app.add_typer(cache.cache_app, name="cache")


def main() -> None:
    """The `minisandbox` command. An OSError that reaches here (disk full, quota, read-only
    filesystem, permission...) ends it with one line naming the path and the fix, exit 2."""
    try:
        app()
    except OSError as e:
        typer.secho(f"minisandbox: {explain_os_error(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)
