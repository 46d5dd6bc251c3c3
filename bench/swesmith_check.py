"""Grades SWE-smith-format tasks as an RL run would trust them: each task's gold patch (its bug
reversed) must resolve and an empty patch must not. Also the stored size of each task's own
layer. Run after swesmith_generate.py, with the same --work-dir (its layers are reused).

    python bench/swesmith_check.py tasks.jsonl [--work-dir ~/.cache/minisandbox-bench/swesmith]

Prints one JSON object: per repository n / gold / empty, totals, bug-layer stored bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path
from typing import Any

import _common

from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument(
        "--work-dir", type=Path, default=Path.home() / ".cache" / "minisandbox-bench" / "swesmith"
    )
    parser.add_argument("--timeout", type=float, default=90.0)
    args = parser.parse_args()
    work = args.work_dir
    settings = BuildSettings(
        store=work / "store", cache=work / "layers", git_mirror=work / "mirrors"
    )
    tasks = load_tasks(args.tasks)
    builder = Builder(settings)
    evaluator = Evaluator(builder, timeout=args.timeout)
    gate = asyncio.Semaphore(2)

    async def one(task: Task) -> tuple[str, bool, bool]:
        async with gate:
            gold = await evaluator.evaluate(task, task.gold_patch)
            empty = await evaluator.evaluate(task, "")
        if not gold.resolved:
            _common.log(f"{task.id}: gold unresolved: {gold.reason}")
        return task.id, gold.resolved, empty.resolved

    began = time.monotonic()
    results = await asyncio.gather(*(one(t) for t in tasks))
    repos: dict[str, dict[str, int]] = {}
    for iid, gold, empty in results:
        r = repos.setdefault(iid.split(".")[0], {"n": 0, "gold": 0, "empty": 0})
        r["n"], r["gold"], r["empty"] = r["n"] + 1, r["gold"] + gold, r["empty"] + empty
    layers = [builder.built_layers(t) for t in tasks]
    sizes = [builder.store.info(found[-1]).stored_bytes for found in layers if found]
    return {
        "tasks": len(tasks),
        "gold_resolved": sum(g for _, g, _ in results),
        "empty_resolved": sum(e for _, _, e in results),
        "repos": repos,
        "bug_layer_stored_bytes_mean": round(sum(sizes) / max(len(sizes), 1)),
        "bug_layer_stored_bytes_max": max(sizes, default=0),
        "seconds": round(time.monotonic() - began, 1),
        "host": _common.host_info(),
    }


if __name__ == "__main__":
    _common.run_main(main)
