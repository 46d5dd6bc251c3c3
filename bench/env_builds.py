"""Environment builds: does every environment of a SWE-bench dataset build, for every Python
version it asks for, including repositories whose tasks are not run here (too large to fetch)?

One task per distinct recipe of the chosen repositories, in dataset order; only its environment
layer is built (`Builder.build_env`), from an empty store unless one is given. Prints one JSON
object: per recipe its Python, status, seconds, the pins relaxed (relax.py) and, on failure, the
step and the error's tail.

    python bench/env_builds.py --dataset verified.parquet --envs-dir DIR
                               [--repos django/django ...] [--instance-ids ID ...] [--jobs 2]
                               [--work-dir DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main

from minisandbox.errors import MiniSandboxError
from minisandbox.tasks.builder import Builder, BuildError, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

DEFAULT_REPOS = ["django/django", "scikit-learn/scikit-learn", "matplotlib/matplotlib"]


def one_per_recipe(tasks: list[Task]) -> list[Task]:
    """One task per environment layer (the key the builder names it by, for the recipe's own
    Python version)."""
    seen: dict[str, Task] = {}
    for t in tasks:
        seen.setdefault(t.environment_key(t.env.python), t)
    return list(seen.values())


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--envs-dir", type=Path, required=True)
    ap.add_argument("--repos", nargs="+", default=DEFAULT_REPOS)
    ap.add_argument("--instance-ids", nargs="+", help="only the recipes of these tasks")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--work-dir", type=Path, default=Path("~/.cache/minisandbox-bench/envs"))
    args = ap.parse_args()
    import pyarrow.parquet as pq

    rows = pq.read_table(args.dataset, columns=["instance_id", "repo"]).to_pylist()
    ids = args.instance_ids or [r["instance_id"] for r in rows if r["repo"] in set(args.repos)]
    tasks = one_per_recipe(load_tasks(args.dataset, envs_dir=args.envs_dir, instance_ids=ids))
    work = args.work_dir.expanduser()
    builder = Builder(BuildSettings(store=work / "store", cache=work / "cache"))
    log(f"{len(tasks)} recipes of {len(ids)} tasks")
    gate = asyncio.Semaphore(max(1, args.jobs))

    async def one(task: Task) -> dict[str, Any]:
        out: dict[str, Any] = {
            "repo": task.repo,
            "version": task.version,
            "python": task.env.python,
        }
        async with gate:
            began = time.monotonic()
            try:
                layer = await builder.build_env(task)
                out |= {"status": "built", "relaxed": [r.package for r in builder.relaxed(layer)]}
            except MiniSandboxError as e:
                out |= {"status": "failed", "error": str(e).splitlines()[0][:300]}
                if isinstance(e, BuildError):
                    out |= {"step": e.step, "tail": e.tail[-1500:]}
        out["seconds"] = round(time.monotonic() - began, 1)
        log(f"{task.id} (python {task.env.python}): {out['status']} in {out['seconds']} s")
        return out

    results = dict(zip((t.id for t in tasks), await asyncio.gather(*map(one, tasks)), strict=True))
    by_python: dict[str, dict[str, int]] = {}
    for r in results.values():
        minor = ".".join(r["python"].split(".")[:2])
        row = by_python.setdefault(minor, {"recipes": 0, "built": 0})
        row["recipes"] += 1
        row["built"] += r["status"] == "built"
    return {
        "repos": args.repos,
        "recipes": len(tasks),
        "built": sum(r["status"] == "built" for r in results.values()),
        "by_python": by_python,
        "per_recipe": results,
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
