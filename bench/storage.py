"""Bytes stored per task: our content-addressed layer store vs the paper's tarballs per task.

Ours: every selected task's environment layer and task layer published into a new, empty
`LayerStore` (unpacked from the work store, then published: what a fresh store holding just these
tasks would take). Tasks whose recipe is the same share one environment layer, and identical files
(or packs of small files) across all layers are stored once. Theirs: per task a `venv.tar.gz` and a
`testbed.tar.gz` (`tar czf`, gzip level 6), made from the same layers.

    python bench/storage.py [--swebench verified.parquet --envs-dir DIR --git-mirror DIR]
                            [--instance-ids ID ...] [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main
from prep_time import Job, add_task_args, build_jobs, load_jobs, make_all_tarballs, scratch_dir

from minisandbox.layers.store import LayerStore
from minisandbox.utils.safefs import discard_tree

TARGET_RATIO = 0.1


def _size(path: Path) -> tuple[int, int]:
    """(apparent bytes, bytes allocated on disk) of one file; (0, 0) if it is absent."""
    try:
        st = path.stat()
    except FileNotFoundError:
        return 0, 0
    return st.st_size, st.st_blocks * 512


def layer_bytes(store: LayerStore, layer_ids: set[str]) -> tuple[int, int]:
    """(apparent, on-disk) bytes that these layers take in `store`: their blobs, each counted
    once however many of them use it, plus their manifests and info files."""
    blobs: set[str] = set()
    apparent = disk = 0
    for layer_id in layer_ids:
        blobs.update(store.manifest(layer_id)["blobs"])
        for path in (store.manifest_path(layer_id), store.root / "layers" / f"{layer_id}.json"):
            a, d = _size(path)
            apparent, disk = apparent + a, disk + d
    for sha in blobs:
        a, d = _size(store.blob_path(sha))
        apparent, disk = apparent + a, disk + d
    return apparent, disk


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_task_args(ap)
    args = ap.parse_args()
    work_dir = args.work_dir.expanduser().resolve()
    jobs = load_jobs(args, work_dir)
    log(f"{len(jobs)} tasks; building (cached in {work_dir / 'store'})")
    await build_jobs(jobs, work_dir)
    make_all_tarballs(jobs, work_dir)
    source = LayerStore(work_dir / "store")

    # Environment layers first: a task layer's stored_bytes is then what it adds on top.
    env_ids = list(dict.fromkeys(j.env_layer for j in jobs))
    task_ids = list(dict.fromkeys(j.task_layer for j in jobs))
    added: dict[str, int] = {}
    with scratch_dir(work_dir / "tmp", "storage-") as scratch:
        fresh = LayerStore(scratch / "store")
        began = time.monotonic()
        fresh_id: dict[str, str] = {}
        for layer_id in env_ids + task_ids:
            tree = scratch / "tree"
            source.unpack(layer_id, tree)
            try:
                ref = fresh.publish(tree)
            finally:
                discard_tree(tree)
            if ref.id != layer_id:
                # Published by an earlier publisher (a checkout's files stored as files, say):
                # the same tree, so the new layer must unpack to a tree that republishes as it.
                fresh.unpack(ref.id, tree)
                try:
                    again = fresh.publish(tree).id
                finally:
                    discard_tree(tree)
                if again != ref.id:
                    raise SystemExit(f"layer {ref.id} does not round-trip ({again})")
            fresh_id[layer_id] = ref.id
            added[layer_id] = ref.stored_bytes
        publish_s = time.monotonic() - began
        changed = sum(1 for a, b in fresh_id.items() if a != b)
        log(f"published {len(added)} layers into a fresh store in {publish_s:.1f} s")
        if changed:
            log(f"{changed} layers got new ids (the publisher changed since they were built)")
        for j in jobs:
            j.env_layer, j.task_layer = fresh_id[j.env_layer], fresh_id[j.task_layer]
        du = fresh.du()

        def group(mine: list[Job]) -> dict[str, Any]:
            n = len(mine)
            ours, disk = layer_bytes(
                fresh, {j.env_layer for j in mine} | {j.task_layer for j in mine}
            )
            # As if every task kept its own two layers: no sharing between tasks.
            alone = sum(layer_bytes(fresh, {j.env_layer, j.task_layer})[0] for j in mine)
            paper = sum(j.tarballs.bytes for j in mine if j.tarballs)
            logical = sum(j.tarballs.logical_bytes for j in mine if j.tarballs)
            return {
                "tasks": n,
                "unique_env_layers": len({j.env_layer for j in mine}),
                "stored_bytes_per_task": round(ours / n),
                "paper_bytes_per_task": round(paper / n),
                "ratio": round(ours / paper, 4),
                "logical_bytes_per_task": round(logical / n),
                "stored_disk_bytes_per_task": round(disk / n),
                "unshared_bytes_per_task": round(alone / n),
            }

        total = group(jobs)
        # Nothing else is in the store.
        if layer_bytes(fresh, set(fresh_id.values()))[0] != du["stored_bytes"]:
            log(f"note: du() counts {du['stored_bytes']} bytes, the layers' files differ")
        by_repo = {
            repo: group([j for j in jobs if j.task.repo == repo])
            for repo in dict.fromkeys(j.task.repo for j in jobs)
        }
        swebench = [j for j in jobs if j.source == "swebench"]
        swe = group(swebench) if swebench else None

    n = len(jobs)
    result: dict[str, Any] = {"benchmark": "storage", "task_ids": [j.task.id for j in jobs]}
    result |= total
    result |= {
        "stored_bytes_env_layers": sum(added[i] for i in env_ids),
        "stored_bytes_task_layers": sum(added[i] for i in task_ids),
        "unique_blobs": du["unique_blobs"],
        "paper_venv_bytes_per_task": round(
            sum(j.tarballs.venv.stat().st_size for j in jobs if j.tarballs) / n
        ),
        "by_repo": by_repo,
    }
    if swe is not None:
        result |= {f"{k}_swebench": v for k, v in swe.items() if k != "tasks"}
    result |= {
        "publish_s": round(publish_s, 1),
        "target_ratio": round(TARGET_RATIO, 4),
        "meets_target": result["ratio"] <= TARGET_RATIO,
        "host": host_info(),
    }
    return result


if __name__ == "__main__":
    run_main(main)
