"""`cache ls|du|verify|gc`: inspect and tidy the layer store (and the node cache)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer

from minisandbox.cli.app import CacheOpt, StoreOpt

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.layers.store import LayerStore

cache_app = typer.Typer(no_args_is_help=True, help="Inspect and tidy the layer store.")


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
    for name, layer in s.refs().items():
        names.setdefault(layer, []).append(name)
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
    from minisandbox.envs.workdirs import build_tmp, sweep_build_tmp
    from minisandbox.tasks.builder import BuildSettings

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
