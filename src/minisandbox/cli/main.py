"""The `minisandbox` command's typer app and its entry: every command registered, every error
ended with one line (see `main`). `minisandbox.cli.main` runs it in this process;
`minisandbox.cli.warm` may run it in a fork of a process that has all of this imported."""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any

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


@functools.cache
def _command() -> Any:
    """The click command of the app, made once per process (a warm process makes it for all
    its workers)."""
    command = typer.main.get_command(app)
    _metavars_only(command)
    return command


def preload() -> None:
    """Import what the commands a warm process runs (cli.warm.ROUTED) would import on their
    first use, and make the click command: each of its workers then starts with them."""
    import asyncio  # noqa: F401

    import minisandbox.cli.termfilter
    import minisandbox.runtime
    import minisandbox.sandbox.sandbox
    import minisandbox.tasks.builder
    import minisandbox.tasks.loaders  # noqa: F401
    from minisandbox.errors import MiniSandboxError
    from minisandbox.sandbox import bwrap, hostpython

    _warm_parse(_command())
    # Per-process lookups that stay valid while the warm process's key does (its environment,
    # its packages) or that check themselves at each use (/usr's stamp).
    with contextlib.suppress(MiniSandboxError, OSError):
        bwrap.find_bwrap()
    with contextlib.suppress(OSError):
        hostpython.usr_package_dirs()
    refresh()


def refresh() -> None:
    """Look the system layer up again (a warm process does every few seconds, between
    commands): host /etc changed, or the layer was removed, its workers get the new one, as a
    new process would."""
    from minisandbox.errors import MiniSandboxError
    from minisandbox.sandbox import runtime, startup
    from minisandbox.sandbox.config import SandboxConfig

    with contextlib.suppress(MiniSandboxError, OSError):
        root = runtime.runtime_root()
        runtime.private_root(root)
        startup.forget_system_layers()
        startup.system_layer(root, SandboxConfig().layer_owner())


def _warm_parse(command: Any) -> None:
    """Parse an `exec` command line once without running it: typer builds each parameter's
    converters on first use (10 ms), which every worker would otherwise pay again."""
    with (
        contextlib.suppress(Exception),
        command.make_context("minisandbox", ["exec", "--", "true"]) as ctx,
    ):
        protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])
        name, sub, rest = command.resolve_command(ctx, [*protected, *ctx.args])
        with sub.make_context(name, rest, parent=ctx):
            pass


def main() -> None:
    """The `minisandbox` command. Every error ends it with one line on stderr and exit 2: a
    usage error (naming the option to use instead, where a neighbouring tool has the one
    typed), and an OSError that reaches here (disk full, quota, read-only filesystem,
    permission...) with the path and the fix. Ctrl-C ends it with one line and exit 130 once
    what it started is stopped."""
    command = _command()
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
