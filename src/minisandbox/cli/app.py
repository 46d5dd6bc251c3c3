"""The typer app, the options several commands share, and the helpers every command uses: the
one-line error exit, a sandbox's configuration, the builder, and loading a dataset."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from minisandbox.cli.oserrors import place

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from collections.abc import Iterable, Sequence

    from rich.console import Console
    from rich.table import Table

    from minisandbox.sandbox.config import SandboxConfig
    from minisandbox.tasks.builder import Builder
    from minisandbox.tasks.loaders import TaskFormatError
    from minisandbox.tasks.specs import Task

# Plain click help: typer's rich help shows every flag as `<bool>` (typer 0.29), and plain
# help does not need rich, so `--help` stays fast.
HELP_MARKUP = None

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    rich_markup_mode=HELP_MARKUP,
    help=(
        "Container-free sandboxes for software-engineering agents: unprivileged Linux "
        "namespaces (bubblewrap), an overlay root over read-only layers, seccomp and resource "
        "limits. No root, no daemon."
    ),
)


def _print_version(value: bool) -> None:
    if value:
        from minisandbox import __version__

        typer.echo(f"minisandbox {__version__}")
        raise typer.Exit(0)


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        "-V",
        callback=_print_version,
        is_eager=True,
        help="Print the version and exit.",
    ),
) -> None:
    """Container-free sandboxes for software-engineering agents: unprivileged Linux namespaces
    (bubblewrap), an overlay root over read-only layers, seccomp and resource limits. No root,
    no daemon."""


# ---------------------------------------------------------------- a sandbox's options

LayerOpt = typer.Option(
    None,
    "--layer",
    "-l",
    metavar="DIR",
    help="A read-only directory whose content is overlaid at / (repeatable; first is lowest).",
)
UpperOpt = typer.Option(
    None,
    "--upper",
    metavar="DIR",
    help="Keep everything the sandbox writes in this directory (default: discard).",
)
NetworkOpt = typer.Option(False, "--network", help="Give the sandbox the host's network.")
RoOpt = typer.Option(
    None,
    "--ro",
    metavar="DIR",
    help="A host directory to show read-only at its own path, e.g. a Python install (repeatable).",
)
WORKDIR_DEFAULT = "/testbed"
WorkdirOpt = typer.Option(
    WORKDIR_DEFAULT, "--workdir", "-w", metavar="PATH", help="Working directory inside."
)

# ---------------------------------------------------------------- a dataset's and store's options

TasksArg = typer.Argument(
    ...,
    metavar="DATASET",
    help="A dataset: `examples` (bundled), a SWE-bench parquet/JSON/JSONL file, a task file.",
)
StoreOpt = typer.Option(
    None,
    "--store",
    envvar="MINISANDBOX_STORE",
    metavar="DIR",
    help="Layer store directory (shared or local).",
)
CacheOpt = typer.Option(
    None,
    "--cache",
    envvar="MINISANDBOX_CACHE",
    metavar="DIR",
    help="Node cache of unpacked layers.",
)
MirrorOpt = typer.Option(
    None,
    "--git-mirror",
    metavar="DIR",
    envvar="MINISANDBOX_GIT_MIRROR",
    help="Directory of git clones named <owner>__<name> (default: clone from GitHub).",
)
EnvsOpt = typer.Option(
    None,
    "--envs-dir",
    metavar="DIR",
    help="Per-instance conda environment exports (<instance_id>.yml).",
)
QuietOpt = typer.Option(
    False, "--quiet", "-q", help="No progress on stderr (each instance's phases and verdict)."
)
IdsOpt = typer.Option(
    None, "--instance-ids", "-i", metavar="ID", help="Only these tasks (repeatable)."
)
AbsPathsOpt = typer.Option(
    False,
    "--allow-absolute-paths",
    help="Let the dataset's records name files outside its folder and --envs-dir (absolute "
    "paths, ~, ..); refused by default.",
)


def fail(message: str) -> NoReturn:
    """Every error ends here: one line on stderr, exit status 2."""
    typer.secho(f"minisandbox: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def count(n: int, noun: str, plural: str | None = None) -> str:
    """`n` and `noun`, plural unless n is 1: "1 task", "3 tasks", "2 entries"."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"


def positive_seconds(value: float | None) -> float | None:
    """A duration option: more than 0 seconds (or not given).

    Raises:
        typer.BadParameter: it is 0 or less (nothing could run in it), or not a number.
    """
    if value is not None and not value > 0:  # `not >`: NaN too
        raise typer.BadParameter(f"{value:g} seconds: give a duration of more than 0 seconds")
    return value


def add_columns(
    table: Table, columns: Sequence[str], ids: Iterable[str] = (), wrap: Sequence[str] = ()
) -> None:
    """Add `columns` to `table`. The first holds ids (`ids`, the ones it will show): it is as
    wide as the longest and never cut. Columns named in `wrap` hold free text, which wraps at
    spaces and folds a word longer than the column; the others hold short values (a status, a
    size, a date), which wrap only at spaces (see print_table), so a narrow terminal narrows
    the free text first."""
    id_width = max((len(i) for i in ids), default=0)
    for n, col in enumerate(columns):
        if n == 0:
            table.add_column(col, no_wrap=True, min_width=max(id_width, len(col)))
        else:
            table.add_column(col, overflow="fold", min_width=_FREE_MIN if col in wrap else None)


def print_table(table: Table) -> None:
    """Print `table` on stdout (out_console) whole: a short value's words are never folded
    (each column of short values is as wide as its longest word), and a table wider than the
    terminal first drops its borders and padding, then wraps its free text."""
    from rich import box
    from rich.text import Text

    console = out_console()
    for column in table.columns[1:]:
        if column.min_width is None:  # short values: as wide as their longest word
            cells = [column.header, *column.cells]
            texts = [Text.from_markup(c).plain if isinstance(c, str) else str(c) for c in cells]
            column.min_width = max((len(w) for t in texts for w in t.split()), default=1)
    natural = table.__rich_measure__(console, console.options).maximum
    if natural > console.width:
        table.box, table.pad_edge, table.show_edge = box.SIMPLE_HEAD, False, False
        table.padding = (0, 0)  # one space between columns: the box's
    console.print(table)


def out_console() -> Console:
    """The console for results on stdout. On a terminal, its width; elsewhere (a pipe, a
    file) unbounded unless COLUMNS says otherwise, so that no cell, id or path is wrapped or
    cut where nobody reads it on a screen (rich would assume 80 columns)."""
    from rich.console import Console

    console = Console()
    if console.is_terminal or os.environ.get("COLUMNS"):  # a width asked for is kept
        return console
    return Console(width=_UNBOUNDED, soft_wrap=True)


_UNBOUNDED = 10_000
_FREE_MIN = 16  # columns a free-text column keeps on a narrow terminal


def sandbox_config(
    layer: list[Path] | None,
    upper: Path | None,
    network: bool,
    ro: list[Path] | None,
    workdir: str,
) -> SandboxConfig:
    from minisandbox.sandbox.config import SandboxConfig

    place("upper", upper, "--upper")
    try:
        return SandboxConfig(
            layers=layer or [], upper=upper, network=network, ro_paths=ro or [], workdir=workdir
        )
    except ValueError as e:
        raise typer.BadParameter(str(e)) from None


def make_builder(store: Path | None, cache: Path | None, mirror: Path | None) -> Builder:
    from minisandbox.tasks.builder import Builder, BuildSettings

    given = {"store": store, "cache": cache, "git_mirror": mirror}
    # Validated (model_copy would not be): relative paths made absolute here.
    settings = BuildSettings(**{k: v for k, v in given.items() if v is not None})
    place("store", settings.store.parent, "MINISANDBOX_STORE (--store)")
    place("cache", settings.cache, "MINISANDBOX_CACHE (--cache)")
    return Builder(settings)


def load_dataset(
    tasks: str,
    envs_dir: Path | None,
    ids: list[str] | None,
    allow_abs: bool = False,
    rejected: list[TaskFormatError] | None = None,
) -> list[Task]:
    """The dataset's tasks (`ids` only, when given); with `rejected`, its malformed records go
    there instead of failing the run (loaders.load_tasks), each named on stderr at once."""
    from minisandbox.tasks.loaders import load_tasks

    loaded = load_tasks(
        tasks,
        envs_dir=envs_dir,
        instance_ids=ids or None,
        allow_absolute_paths=allow_abs,
        rejected=rejected,
    )
    for e in rejected or []:
        typer.secho(f"minisandbox: skipped (the others go on): {e}", fg=typer.colors.RED, err=True)
    return loaded
