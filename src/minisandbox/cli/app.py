"""The typer app, the options several commands share, and the helpers every command uses: the
one-line error exit, a sandbox's configuration, the builder, and loading a dataset."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from minisandbox.cli.oserrors import place

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from collections.abc import Iterable, Sequence

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

# ---------------------------------------------------------------- a dataset's and store's options

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


def fail(message: str) -> NoReturn:
    """Every error ends here: one line on stderr, exit status 2."""
    typer.secho(f"minisandbox: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def add_columns(table: Table, columns: Sequence[str], ids: Iterable[str] = ()) -> None:
    """Add `columns` to `table`; the first holds ids (`ids`, the ones it will show), which are
    never cut: it is as wide as the longest, and other cells fold rather than end in "…"."""
    id_width = max((len(i) for i in ids), default=0)
    for n, col in enumerate(columns):
        if n == 0:
            table.add_column(col, no_wrap=True, min_width=max(id_width, len(col)))
        else:
            table.add_column(col, overflow="fold")


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

    settings = BuildSettings()
    updates: dict[str, object] = {}
    if store is not None:
        updates["store"] = store
    if cache is not None:
        updates["cache"] = cache
    if mirror is not None:
        updates["git_mirror"] = mirror
    settings = settings.model_copy(update=updates)
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
