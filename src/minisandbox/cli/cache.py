"""`cache ls|du|verify|gc`: inspect and tidy the layer store (and the node cache). Sizes are
shown in binary units (KiB, MiB, GiB); with --json each command prints one JSON value on
stdout, sizes in bytes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from minisandbox.cli.app import (
    HELP_MARKUP,
    CacheOpt,
    StoreOpt,
    add_columns,
    count,
    fail,
    print_table,
)

if TYPE_CHECKING:  # the CLI imports its modules lazily, so that --help stays fast
    from minisandbox.layers.store import LayerStore

cache_app = typer.Typer(
    no_args_is_help=True, rich_markup_mode=HELP_MARKUP, help="Inspect and tidy the layer store."
)


def _store(store: Path | None) -> LayerStore:
    """The store these commands inspect: the default one (made if missing, as a build would),
    or the one given, which must be a store already: a typo must not make a new one."""
    from minisandbox.layers.store import LayerStore
    from minisandbox.tasks.builder import BuildSettings

    if store is not None:
        _check_store(store)
    return LayerStore(store or BuildSettings().store)


def _check_store(path: Path) -> None:
    """Fail (one line, exit 2) unless `path` is a layer store or an empty directory."""
    fix = "give the store's directory with --store or MINISANDBOX_STORE"
    if not path.exists():
        fail(f"{path}: no layer store there (no such directory): {fix}; builds make one")
    if not path.is_dir():
        fail(f"{path}: not a layer store (not a directory): {fix}")
    try:
        entries = {p.name for p in path.iterdir()}
    except OSError as e:
        fail(f"{path}: cannot list it ({e.strerror}): {fix}")
    if entries and not {"blobs", "refs"} <= entries:
        fail(f"{path}: not a layer store (it has no blobs/ and refs/): {fix}")


JsonOpt = typer.Option(False, "--json", help="Print one JSON value on stdout (sizes in bytes).")


def human_size(n: float) -> str:
    """`n` bytes in binary units: "512 B", "1.5 KiB", "100.0 GiB"."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if abs(n) < 1024 or unit == "TiB":
            break
    return f"{n:,.1f} {unit}"


def _print_json(value: Any) -> None:
    typer.echo(json.dumps(value))


@cache_app.command("ls")
def cache_ls(store: Path = StoreOpt, json_out: bool = JsonOpt) -> None:
    """List the stored layers: what each is, its unpacked size, what it added to the store."""
    from rich.table import Table

    s = _store(store)
    names: dict[str, list[str]] = {}
    for name, layer in s.refs().items():
        names.setdefault(layer, []).append(name)
    if json_out:
        _print_json(
            [
                {
                    "id": ref.id,
                    "refs": sorted(names.get(ref.id, [])),
                    "kind": (ref.meta or {}).get("kind"),
                    "size_bytes": ref.size,
                    "stored_bytes": ref.stored_bytes,
                    "files": ref.files,
                    "created": ref.created.isoformat(),
                    "meta": ref.meta,
                }
                for ref in sorted(s.list(), key=lambda r: r.created)
            ]
        )
        return
    table = Table(title=f"layers in {s.root}")
    layers = sorted(s.list(), key=lambda r: r.created)
    columns = ("layer", "kind", "for", "size", "stored", "files", "created")
    add_columns(table, columns, [ref.id[:12] for ref in layers], wrap=("for",))
    for ref in layers:
        meta = ref.meta or {}
        what = meta.get("task") or ", ".join(meta.get("recipe", {}).get("requirements", [])[:3])
        table.add_row(
            ref.id[:12],
            str(meta.get("kind", "?")),
            str(what)[:40],
            human_size(ref.size),
            human_size(ref.stored_bytes),
            str(ref.files),
            ref.created.strftime("%Y-%m-%d %H:%M"),
        )
    print_table(table)


@cache_app.command("du")
def cache_du(store: Path = StoreOpt, cache: Path = CacheOpt, json_out: bool = JsonOpt) -> None:
    """Bytes stored against bytes the layers hold unpacked (the deduplication), and the node
    cache's use of its cap."""
    from minisandbox.tasks.builder import Builder, BuildSettings

    given = {"store": store, "cache": cache}
    settings = BuildSettings(**{k: v for k, v in given.items() if v is not None})
    if store is not None:
        _check_store(store)
    builder = Builder(settings)
    du = builder.store.du()
    usage = builder.cache.usage()
    if json_out:
        _print_json(
            {
                "store": {"root": str(builder.store.root), **du},
                "node_cache": {"root": str(builder.cache.root), **usage.model_dump()},
            }
        )
        return
    typer.echo(
        f"store {builder.store.root}: {count(du['layers'], 'layer')}, "
        f"{human_size(du['stored_bytes'])} "
        f"stored for {human_size(du['logical_bytes'])} of layer content"
        + (f" (x{du['ratio']})" if du["ratio"] is not None else "")
        + f", {count(du['unique_blobs'], 'blob')}"
    )
    typer.echo(
        f"node cache {builder.cache.root}: {count(usage.layers, 'layer')} unpacked, "
        f"{human_size(usage.bytes)} of {human_size(usage.max_bytes)}, "
        f"{len(usage.pinned)} in use"
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
    json_out: bool = JsonOpt,
) -> None:
    """Re-hash every blob and manifest, and every file of the node's pool against the store;
    exit 1 when anything is corrupt or missing."""
    from minisandbox.layers.filepool import FilePool
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
    if json_out:
        _print_json(
            {
                "ok": not problems,
                "problems": problems,
                "broken_layers": report.broken_layers,
                "dropped_refs": report.dropped_refs,
            }
        )
        raise typer.Exit(1 if problems else 0)
    for p in problems:
        typer.secho(p, fg=typer.colors.RED)
    typer.echo(count(len(problems), "problem"))
    if report.dropped_refs:
        typer.echo(
            f"dropped {count(len(report.dropped_refs), 'ref')} of broken layers: "
            "`minisandbox build` rebuilds them"
        )
    raise typer.Exit(1 if problems else 0)


@cache_app.command("gc")
def cache_gc(store: Path = StoreOpt, json_out: bool = JsonOpt) -> None:
    """Remove unreferenced layers and blobs, leftovers of interrupted publishes, and the work
    directories of builds whose process is gone (killed builds)."""
    from minisandbox.envs.workdirs import build_tmp, sweep_build_tmp
    from minisandbox.tasks.builder import BuildSettings

    s = _store(store)
    report = s.gc()
    settings = BuildSettings() if store is None else BuildSettings(store=store)
    swept = sweep_build_tmp(build_tmp(settings))
    freed = report.freed_bytes + sum(size for _path, size in swept)
    if json_out:
        _print_json(
            {
                "removed_layers": report.removed_layers,
                "removed_blobs": report.removed_blobs,
                "removed_temps": report.removed_temps,
                "removed_build_dirs": [{"path": str(p), "bytes": n} for p, n in swept],
                "freed_bytes": freed,
                "problems": report.problems,
            }
        )
        return
    typer.echo(
        f"removed {count(len(report.removed_layers), 'layer')}, "
        f"{count(report.removed_blobs, 'blob')}, {count(report.removed_temps, 'temp file')}, "
        f"{count(len(swept), 'stale build directory', 'stale build directories')}; "
        f"freed {human_size(freed)}"
    )
    for path, size in swept:
        typer.echo(f"  removed {path} ({human_size(size)})")
    for p in report.problems:
        typer.secho(p, fg=typer.colors.YELLOW)
