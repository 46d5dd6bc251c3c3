"""A repository's tasks on one node: only the past in each checkout, its history stored once,
each file once per node, and the start of a task when another of its repository is there.

On SWE-bench tasks of one repository (sympy's by default; its mirror must be given):
- `objects_unreachable_max`, `gold_blobs_present`: the history check of `build --validate`, run
  in each task's sandbox (0 and 0: nothing from after the base commit is reachable by git);
- `stored_bytes_all_task_layers`: what the store holds for all the task layers together (their
  blobs, each once, and manifests), against `one_full_pack_bytes`, the mirror's pack and index
  (what every task layer carried before its history was cut);
- `node_bytes_all_tasks`: disk blocks of a fresh node cache after starting every task (hard
  links counted once), with `env_layer_bytes` of it in environment layers;
- `cold_start_next_task_s`: p50 start (to the first command's result) of a task whose previous
  task (of the list) is already on the node, against the paper approach's start of the same
  task in the same run (extracting its venv.tar.gz and testbed.tar.gz, see prep_time.py).

    python bench/node_cache.py --swebench verified.parquet --envs-dir DIR --git-mirror DIR \\
        [--instance-ids ID ...] [--work-dir ~/.cache/minisandbox-bench/node-cache]
"""

from __future__ import annotations

import argparse
import itertools
import os
import stat
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, percentile, run_main
from prep_time import (
    Job,
    add_task_args,
    build_jobs,
    load_jobs,
    make_all_tarballs,
    make_builder,
    scratch_dir,
    start_paper,
)

from minisandbox.evaluation.validation import check_history
from minisandbox.layers.store import LayerStore

SYMPY_IDS = [
    "sympy__sympy-11618",
    "sympy__sympy-12096",
    "sympy__sympy-12419",
    "sympy__sympy-13031",
    "sympy__sympy-13480",
    "sympy__sympy-13647",
    "sympy__sympy-14711",
    "sympy__sympy-15345",
    "sympy__sympy-16766",
    "sympy__sympy-17655",
    "sympy__sympy-18763",
    "sympy__sympy-19495",
]
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/node-cache")


def du_blocks(root: Path) -> int:
    """Bytes of disk blocks under `root`, each inode once (as `du`)."""
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirs, files in os.walk(root):
        for name in [*dirs, *files]:
            st = os.lstat(os.path.join(dirpath, name))
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_blocks * 512
    return total


def stored_bytes(store: LayerStore, layer_ids: list[str]) -> int:
    """Store bytes of these layers together: their distinct blobs and their manifests."""
    blobs: set[str] = set()
    total = 0
    for layer_id in layer_ids:
        blobs.update(store.manifest(layer_id)["blobs"])
        total += store.manifest_path(layer_id).stat().st_size
    return total + sum(store.blob_path(sha).stat().st_size for sha in blobs)


def mirror_pack_bytes(mirror: Path, repo: str) -> int:
    pack_dir = mirror / repo.replace("/", "__") / "objects" / "pack"
    if not pack_dir.is_dir():
        pack_dir = mirror / repo.replace("/", "__") / ".git" / "objects" / "pack"
    return sum(
        p.stat().st_size
        for p in pack_dir.iterdir()
        if p.suffix in (".pack", ".idx") and stat.S_ISREG(p.stat().st_mode)
    )


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_task_args(ap)
    ap.set_defaults(instance_ids=SYMPY_IDS, no_examples=True, work_dir=DEFAULT_WORK_DIR)
    args = ap.parse_args()
    if not args.swebench or not args.git_mirror:
        raise SystemExit("pass --swebench, --envs-dir and --git-mirror (with the repository)")
    work_dir = args.work_dir.expanduser()
    jobs: list[Job] = load_jobs(args, work_dir)
    repos = {job.task.repo for job in jobs}
    if len(repos) != 1:
        raise SystemExit(f"the tasks must share one repository, not {sorted(repos)}")
    began = time.monotonic()
    builders = await build_jobs(jobs, work_dir)
    build_s = time.monotonic() - began
    builder = next(iter(builders.values()))
    store = builder.store

    unreachable, gold_present, problems = [], 0, {}
    for job in jobs:
        check = await check_history(builder, job.task)
        unreachable.append(check.unreachable_objects)
        gold_present += sum("gold patch" in p for p in check.problems)
        if check.problems:
            problems[job.task.id] = check.problems[:3]
        log(f"{job.task.id}: {check.objects} objects, {check.unreachable_objects} unreachable")

    task_layers = [job.task_layer for job in jobs]
    env_layers = sorted({job.env_layer for job in jobs})
    full_pack = mirror_pack_bytes(args.git_mirror, jobs[0].task.repo)
    stored = stored_bytes(store, task_layers)

    scratch = work_dir / "scratch"
    with scratch_dir(scratch, "node-") as cache:
        node = make_builder(work_dir, args.git_mirror, cache=cache)
        for job in jobs:
            async with node.sandbox(job.task, build=False) as sb:
                await sb.execute("true")
        node_bytes = du_blocks(cache)
        # The environment layers' own trees (their files come from the pool too: counted
        # here once per layer, which can only make the target looser by what they share).
        env_bytes = sum(du_blocks(cache / "layers" / layer) for layer in env_layers)
        pool_files, pool_bytes = node.cache.pool.usage()

    make_all_tarballs(jobs, work_dir)
    ours, paper = [], []
    for prev, job in itertools.pairwise(jobs):
        with scratch_dir(scratch, "next-") as cache:
            node = make_builder(work_dir, args.git_mirror, cache=cache)
            async with node.sandbox(prev.task, build=False) as sb:  # untimed: the neighbour
                await sb.execute("true")
            t0 = time.perf_counter()
            async with node.sandbox(job.task, build=False) as sb:
                await sb.execute("true")
                ours.append(time.perf_counter() - t0)
        paper.append((await start_paper(job, builder, scratch)).seconds)
        log(f"{job.task.id}: next-task start {ours[-1]:.2f} s, paper {paper[-1]:.2f} s")

    ours_p50, paper_p50 = percentile(ours, 50), percentile(paper, 50)
    return {
        "benchmark": "node_cache",
        "repo": jobs[0].task.repo,
        "tasks": len(jobs),
        "objects_unreachable_max": max(unreachable),
        "gold_blobs_present": gold_present,
        "history_problems": problems,
        "one_full_pack_bytes": full_pack,
        "stored_bytes_all_task_layers": stored,
        "stored_ratio_vs_full_pack": round(stored / full_pack, 3),
        "stored_target_bytes": int(1.5 * full_pack + len(jobs) * 2**20),
        "node_bytes_all_tasks": node_bytes,
        "env_layer_bytes": env_bytes,
        "node_target_bytes": int(1.5 * full_pack + env_bytes),
        "pool_files": pool_files,
        "pool_bytes": pool_bytes,
        "cold_start_next_task_s": round(ours_p50, 3),
        "paper_start_s": round(paper_p50, 3),
        "cold_start_ratio": round(ours_p50 / paper_p50, 3),
        "env_layers": len(env_layers),
        "build_s": round(build_s, 1),
        "meets_target": (
            max(unreachable) == 0
            and gold_present == 0
            and stored <= 1.5 * full_pack + len(jobs) * 2**20
            and node_bytes <= 1.5 * full_pack + env_bytes
            and ours_p50 <= 0.25 * paper_p50
        ),
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
