"""Keeping a store honest and small: `check` (re-hash everything, optionally repair), `gc` (remove
what nothing needs), `du` (what the store holds). The store's methods of those names call these.

Both are safe while others publish: gc removes a blob only when no layer references it *and* it
is older than the grace period (a publish touches every blob it reuses), and it never collects
blobs at all while a manifest cannot be read (it cannot tell what that layer needs).
"""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, Protocol

from pydantic import BaseModel

from minisandbox.layers.blobs import check_blob
from minisandbox.layers.errors import LayerNotFoundError, LayerStoreError
from minisandbox.layers.ids import is_layer_id
from minisandbox.layers.layout import remove_lock_file
from minisandbox.layers.manifest import Manifest
from minisandbox.layers.parallel import run_parallel
from minisandbox.utils.safefs import discard_tree


class _Sized(Protocol):
    @property
    def size(self) -> int: ...


class MaintainedStore(Protocol):
    """What checking, collecting and measuring need of a store (`LayerStore` is one): a
    protocol rather than an import of store.py, whose methods call these functions."""

    root: Path
    workers: int

    def blob_path(self, sha: str) -> Path: ...
    def manifest_path(self, layer_id: str) -> Path: ...
    def info_path(self, layer_id: str) -> Path: ...
    def ref_path(self, name: str) -> Path: ...
    def layer_ids(self) -> list[str]: ...
    def blob_files(self) -> Iterator[tuple[str, Path]]: ...
    def list(self) -> Sequence[_Sized]: ...
    def manifest(self, layer_id: str) -> dict[str, Any]: ...
    def read_manifest(self, layer_id: str) -> Manifest: ...
    def refs(self) -> dict[str, str]: ...


GC_GRACE_SECONDS = 3600.0


class VerifyReport(BaseModel):
    """What `verify` found: one line per problem, and with repair what it did about it."""

    problems: list[str] = []
    broken_layers: list[str] = []  # layers with a corrupt manifest or a corrupt/missing blob
    dropped_refs: list[str] = []  # refs of those layers that repair removed


class GcReport(BaseModel):
    removed_layers: list[str] = []
    removed_blobs: int = 0
    removed_temps: int = 0
    freed_bytes: int = 0
    problems: list[str] = []


# -- du ---------------------------------------------------------------------------------------


def disk_usage(store: MaintainedStore) -> dict[str, Any]:
    """Stored bytes against logical bytes: how well layers dedupe and compress."""
    blob_bytes = blobs = 0
    for _sha, path in store.blob_files():
        with contextlib.suppress(FileNotFoundError):
            blob_bytes += path.stat().st_size
            blobs += 1
    layer_bytes = 0
    for name in os.listdir(store.root / "layers"):
        with contextlib.suppress(FileNotFoundError):
            layer_bytes += (store.root / "layers" / name).stat().st_size
    layers = store.list()
    logical = sum(r.size for r in layers)
    stored = blob_bytes + layer_bytes
    return {
        "layers": len(layers),
        "unique_blobs": blobs,
        "blob_bytes": blob_bytes,
        "manifest_bytes": layer_bytes,
        "stored_bytes": stored,
        "logical_bytes": logical,
        "ratio": round(logical / stored, 3) if stored else None,
    }


# -- check ------------------------------------------------------------------------------------


class _Checker:
    """One `check` run: what it found so far (blob checks run on several threads)."""

    def __init__(self, store: MaintainedStore, repair: bool) -> None:
        self.store = store
        self.repair = repair
        self.report = VerifyReport()
        self.broken: set[str] = set()
        self.referenced: dict[str, list[str]] = {}  # blob -> layers using it
        self._lock = threading.Lock()

    def problem(self, line: str, layers: list[str], quarantine: Path | None = None) -> None:
        if quarantine is not None and self.repair:
            line += move_to_quarantine(self.store, quarantine)
        with self._lock:
            self.broken.update(layers)
            self.report.problems.append(line)

    def read_manifests(self) -> None:
        for layer_id in sorted(self.store.layer_ids()):
            try:
                manifest = self.store.read_manifest(layer_id)  # every row checked too
            except LayerNotFoundError:
                continue
            except LayerStoreError as exc:
                self.problem(str(exc), [layer_id], self.store.manifest_path(layer_id))
                continue
            for sha in manifest.blobs:
                self.referenced.setdefault(sha, []).append(layer_id)

    def check_blob(self, item: tuple[str, Path]) -> None:
        sha, path = item
        found = check_blob(path)
        if found.missing or found.digest == sha:
            return  # good, or removed by a concurrent gc
        users = self.referenced.get(sha, [])
        line = f"{path}: corrupt ({found.why()}); used by layers {', '.join(users) or '(none)'}"
        self.problem(line, users, path)

    def drop_broken_refs(self) -> None:
        for name, layer_id in sorted(self.store.refs().items()):
            if layer_id in self.broken and untag_if(self.store, name, layer_id):
                self.report.dropped_refs.append(name)
                self.report.problems.append(f"ref {name}: dropped (layer {layer_id} is broken)")


def check_store(store: MaintainedStore, *, repair: bool = False) -> VerifyReport:
    """See `LayerStore.check`."""
    checker = _Checker(store, repair)
    checker.read_manifests()
    present = dict(store.blob_files())
    for sha in sorted(set(checker.referenced) - set(present)):
        users = checker.referenced[sha]
        checker.problem(
            f"{store.blob_path(sha)}: missing (used by layers {', '.join(users)})", users
        )
    run_parallel(checker.check_blob, sorted(present.items()), store.workers)
    checker.report.broken_layers = sorted(checker.broken)
    if repair and checker.broken:
        checker.drop_broken_refs()
    return checker.report


def move_to_quarantine(layout: MaintainedStore, path: Path) -> str:
    """Move a corrupt file to quarantine/; what to add to the problem's line."""
    qdir = layout.root / "quarantine"
    qdir.mkdir(exist_ok=True)
    target = qdir / f"{path.name}.{int(time.time())}.{secrets.token_hex(2)}"
    try:
        os.rename(path, target)
    except FileNotFoundError:
        return ""
    return f"; moved to {target}"


def untag_if(layout: MaintainedStore, name: str, layer_id: str) -> bool:
    """Remove ref `name` if it still names `layer_id` (a build may have just re-pointed it at a
    good layer: that one stays)."""
    path = layout.ref_path(name)
    try:
        if path.read_text().strip() != layer_id:
            return False
        os.unlink(path)
        return True
    except FileNotFoundError:
        return False


# -- gc ---------------------------------------------------------------------------------------


def _remove_if_old(path: Path, cutoff: float) -> int:
    """Remove `path` (a file or a tree) unless touched since `cutoff`: the bytes freed, or -1
    when it was kept (or is gone)."""
    try:
        st = path.lstat()
        if st.st_mtime >= cutoff:
            return -1
        if stat.S_ISDIR(st.st_mode):
            discard_tree(path)
        else:
            path.unlink()
        return st.st_size
    except FileNotFoundError:
        return -1


def _count(report: GcReport, freed: int) -> bool:
    if freed < 0:
        return False
    report.freed_bytes += freed
    return True


def _collect_layers(
    store: MaintainedStore, keep: set[str], cutoff: float, report: GcReport
) -> None:
    protected = set(keep) | set(store.refs().values())
    for layer_id in store.layer_ids():
        if layer_id in protected:
            continue
        if _count(report, _remove_if_old(store.manifest_path(layer_id), cutoff)):
            report.removed_layers.append(layer_id)
            with contextlib.suppress(FileNotFoundError):
                report.freed_bytes += store.info_path(layer_id).stat().st_size
                store.info_path(layer_id).unlink()


def _collect_temps(store: MaintainedStore, cutoff: float, report: GcReport) -> None:
    for path in (store.root / "tmp").iterdir():
        if _count(report, _remove_if_old(path, cutoff)):
            report.removed_temps += 1


def _collect_orphans(store: MaintainedStore, cutoff: float, report: GcReport) -> None:
    """Info files without their manifest (a publish crashed between the two) and the lock
    files of layers that are gone, older than the grace."""
    layers, locks = store.root / "layers", store.root / "locks"
    orphans = [
        layers / name
        for name in os.listdir(layers)
        if name.endswith(".json") and not store.manifest_path(name[:-5]).exists()
    ]
    for path in orphans:
        if _count(report, _remove_if_old(path, cutoff)):
            report.removed_temps += 1
    # A lock file is touched whenever it is taken: an old one is nobody's. Removed under its
    # own flock, so that a locker that opened it meanwhile keeps it (layout.meta_lock).
    for name in os.listdir(locks) if locks.is_dir() else []:
        path = locks / name
        if is_layer_id(name) and not store.manifest_path(name).exists():
            with contextlib.suppress(FileNotFoundError):
                if path.lstat().st_mtime < cutoff and remove_lock_file(path):
                    report.removed_temps += 1


def collect_garbage(
    store: MaintainedStore, keep: set[str] | None = None, *, grace: float = GC_GRACE_SECONDS
) -> GcReport:
    """See `LayerStore.gc`."""
    report = GcReport()
    cutoff = time.time() - grace
    _collect_temps(store, cutoff, report)
    if keep is not None:
        _collect_layers(store, keep, cutoff, report)
    _collect_orphans(store, cutoff, report)

    referenced: set[str] = set()
    for layer_id in store.layer_ids():
        try:
            referenced.update(store.manifest(layer_id)["blobs"])
        except LayerNotFoundError:
            continue
        except LayerStoreError as exc:
            # Cannot tell what this layer needs: deleting blobs now could destroy its data.
            report.problems.append(f"{exc}; blobs were not collected")
            return report
    for sha, path in list(store.blob_files()):
        if sha in referenced:
            continue
        # stat right before unlink: the window is tiny
        if _count(report, _remove_if_old(path, cutoff)):
            report.removed_blobs += 1
    return report
