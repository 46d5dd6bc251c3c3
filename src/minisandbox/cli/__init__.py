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
import typer.main

from minisandbox.cli import aiorun, build, cache, demo, evaluate, sandboxes, tasks
from minisandbox.cli.app import app
from minisandbox.cli.oserrors import explain_os_error
from minisandbox.cli.usage import UsageError, usage_line

__all__ = ["app", "main"]

# The commands, in the order --help lists them.
app.command()(sandboxes.shell)
app.command(name="exec", context_settings={"allow_interspersed_args": False})(sandboxes.exec_)
app.command()(demo.demo)
app.command(name="tasks")(tasks.tasks_)
app.command()(build.build)
app.command(name="eval")(evaluate.eval_)
app.add_typer(cache.cache_app, name="cache")


def _metavars_only(command: object) -> None:
    """Help names each value by its metavar (DIR, SECONDS, DATASET): typer 0.29 adds the type
    behind an argument's (`COMMAND <list[str]>`), which says nothing more."""
    for sub in getattr(command, "commands", {}).values():
        _metavars_only(sub)
    for param in getattr(command, "params", []):
        if getattr(param, "metavar", None) and hasattr(param, "display_type_rich"):
            param.display_type_rich = lambda ctx: None


def main() -> None:
    """The `minisandbox` command. Every error ends it with one line on stderr and exit 2: a
    usage error (naming the option to use instead, where a neighbouring tool has the one
    typed), and an OSError that reaches here (disk full, quota, read-only filesystem,
    permission...) with the path and the fix. Ctrl-C ends it with one line and exit 130 once
    what it started is stopped."""
    command = typer.main.get_command(app)
    _metavars_only(command)
    try:
        code = command.main(prog_name="minisandbox", standalone_mode=False)
    except UsageError as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare command: its help, as click does
            e.show()  # type: ignore[attr-defined]  # click's UsageError, found at run time
        else:
            typer.secho(f"minisandbox: {usage_line(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    except typer.Abort:  # click's on EOF at a prompt; the CLI asks none
        typer.secho("minisandbox: aborted", fg=typer.colors.RED, err=True)
        sys.exit(1)
    except OSError as e:
        typer.secho(f"minisandbox: {explain_os_error(e)}", fg=typer.colors.RED, err=True)
        sys.exit(2)
    if code == 130 and aiorun.interrupted():
        typer.secho(
            "minisandbox: interrupted: its sandboxes are stopped and nothing is left running",
            fg=typer.colors.RED,
            err=True,
        )
    sys.exit(code if isinstance(code, int) else 0)
