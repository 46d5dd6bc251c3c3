"""SWE-smith at scale: many bug tasks over one environment and one repository layer per
repository, from an empty store and an empty node cache.

    python bench/swesmith_scale.py tasks.jsonl --mirrors DIR [--work-dir DIR] [--jobs 2]

`tasks.jsonl` is SWE-smith-format records (swesmith_generate.py writes them); `--mirrors` holds
a git repository per GitHub repository (`owner__repo`). The work directory's `scale/` is
emptied first. Phases, each timed:
1. per repository, its first task: the environment, repository and bug layers;
2. every other task, one at a time: its own layer only (`build_s_per_task`; a task whose bug
   patch is an earlier task's shares that task's layer and builds nothing);
3. a sandbox of every task started and stopped, its own layer unpacked on that first start
   (`start_p50_ms`; the repository's layers are on the node from phase 1), then again
   (`warm_start_p50_ms`); `node_cache_bytes` after all of them;
4. each task graded with its gold patch (the bug reversed) and with an empty one.
With `--as-published`, the records keep only the fields SWE-smith publishes, so each
repository's recipe comes from SWE-smith's profile, installed as of its commit's date.
`stored_bytes_per_task` is the store's own accounting (blobs and manifests of every layer, the
shared ones included) over the number of tasks, against the SWE-smith paper's ~270 KB per task
(295 GB of images over ~50k tasks -> 13.5 GB). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import _common

from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

PAPER_BYTES_PER_TASK = 270_000
# The fields of a record in SWE-smith's published dataset.
PUBLISHED = (
    "instance_id",
    "repo",
    "patch",
    "FAIL_TO_PASS",
    "PASS_TO_PASS",
    "image_name",
    "problem_statement",
)


def repository(task: Task) -> str:
    return task.id.split(".")[0]


def summary_s(samples: list[float]) -> dict[str, float]:
    return {
        "mean": round(statistics.fmean(samples), 3),
        "p50": round(_common.percentile(samples, 50), 3),
        "p95": round(_common.percentile(samples, 95), 3),
    }


async def build_all(builder: Builder, tasks: list[Task]) -> dict[str, Any]:
    """Phases 1 and 2: the first task of each repository, then the others one at a time."""
    firsts: dict[str, float] = {}
    bug_only: list[float] = []
    shared = 0
    for repo, group in itertools.groupby(sorted(tasks, key=repository), key=repository):
        first, *rest = group
        began = time.monotonic()
        result = await builder.build(first)
        if result.status == "failed":
            raise SystemExit(f"error: {first.id}: {result.error}")
        firsts[repo] = round(time.monotonic() - began, 2)
        _common.log(f"{repo}: its layers in {firsts[repo]} s; {len(rest)} more bugs")
        for task in rest:
            began = time.monotonic()
            result = await builder.build(task)
            if result.status == "failed":
                raise SystemExit(f"error: {task.id}: {result.error}")
            made = [ref.split("/")[0] for ref in result.built_layers]
            if made == []:  # the same bug as an earlier task's: its layer is shared
                shared += 1
                continue
            if made != ["bug"]:
                raise SystemExit(f"error: {task.id} built {result.built_layers}, not one layer")
            bug_only.append(time.monotonic() - began)
    return {
        "repository_first_task_s": firsts,
        "build_s_per_task": summary_s(bug_only),
        "tasks_sharing_an_earlier_bug_layer": shared,
    }


async def start_all(builder: Builder, tasks: list[Task]) -> dict[str, Any]:
    """Phase 3: each task's sandbox started (timed to a running sandbox) and stopped, twice:
    first with its own layer still to unpack (the repository's are on the node), then with
    everything on the node."""
    out: dict[str, Any] = {}
    for prefix in ("start", "warm_start"):
        starts: list[int] = []
        for task in tasks:
            began = time.perf_counter_ns()
            async with builder.sandbox(task) as sb:
                starts.append(time.perf_counter_ns() - began)
                r = await sb.execute("test -d /testbed/.git && echo ok")
                if r.stdout != "ok\n":
                    raise SystemExit(f"error: {task.id}: no repository in its sandbox: {r.output}")
        out |= _common.summarize_ms(prefix, starts)
    usage = builder.cache.usage()
    return {**out, "node_cache_bytes": usage.bytes, "node_cache_layers": usage.layers}


async def grade_all(builder: Builder, tasks: list[Task], jobs: int, timeout: float) -> dict:
    """Phase 4: gold and empty patches, `jobs` tasks at a time."""
    evaluator = Evaluator(builder, timeout=timeout)
    gate = asyncio.Semaphore(jobs)
    unresolved: dict[str, str] = {}
    tampered: dict[str, list[str]] = {}  # a guard that fired on a gold or an empty patch

    async def one(task: Task) -> tuple[bool, bool]:
        async with gate:
            gold = await evaluator.evaluate(task, task.gold_patch)
            empty = await evaluator.evaluate(task, "")
        if not gold.resolved:
            unresolved[task.id] = gold.reason or gold.status
            _common.log(f"{task.id}: gold unresolved: {gold.reason}")
        for kind, result in (("gold", gold), ("empty", empty)):
            if result.tampering:
                tampered[f"{task.id} {kind}"] = result.tampering
        return gold.resolved, empty.resolved

    results = await asyncio.gather(*(one(t) for t in tasks))
    gold = sum(g for g, _ in results)
    return {
        "gold_resolved": gold,
        "gold_rate": round(gold / len(tasks), 4),
        "empty_resolved": sum(e for _, e in results),
        "gold_unresolved": unresolved,
        "grading": evaluator.grading,
        "tampered": tampered,
    }


async def main() -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tasks", type=Path)
    parser.add_argument("--mirrors", type=Path, required=True, help="owner__repo git mirrors")
    parser.add_argument(
        "--work-dir", type=Path, default=Path.home() / ".cache" / "minisandbox-bench" / "swesmith"
    )
    parser.add_argument("--jobs", type=int, default=2, help="tasks graded at once")
    parser.add_argument("--timeout", type=float, default=90.0, help="per test run")
    parser.add_argument("--no-grade", action="store_true", help="skip phase 4")
    parser.add_argument(
        "--as-published",
        action="store_true",
        help="keep only the fields SWE-smith's dataset publishes: recipes then come from "
        "SWE-smith's profiles, installed as of the commit's date (needs the swesmith extra)",
    )
    args = parser.parse_args()
    work = args.work_dir / "scale"
    shutil.rmtree(work, ignore_errors=True)  # an empty store and node cache
    work.mkdir(parents=True)
    source = args.tasks
    if args.as_published:
        source = work / "published.jsonl"
        records = [json.loads(line) for line in args.tasks.read_text().splitlines() if line]
        source.write_text("".join(json.dumps({k: r[k] for k in PUBLISHED}) + "\n" for r in records))
    tasks = load_tasks(source)
    settings = BuildSettings(store=work / "store", cache=work / "layers", git_mirror=args.mirrors)
    builder = Builder(settings)
    repos = sorted({repository(t) for t in tasks})
    _common.log(f"{len(tasks)} tasks over {len(repos)} repositories into {work}")
    seconds: dict[str, float] = {}

    began = time.monotonic()
    built = await build_all(builder, tasks)
    seconds["build"] = round(time.monotonic() - began, 1)
    du = builder.store.du()
    bug_layers = [
        builder.store.info(found[-1]).stored_bytes
        for t in tasks
        if (found := builder.built_layers(t))
    ]
    began = time.monotonic()
    started = await start_all(builder, tasks)
    seconds["start"] = round(time.monotonic() - began, 1)
    graded: dict[str, Any] = {}
    if not args.no_grade:
        began = time.monotonic()
        graded = await grade_all(builder, tasks, args.jobs, args.timeout)
        seconds["grade"] = round(time.monotonic() - began, 1)
    per_task = du["stored_bytes"] / len(tasks)
    return {
        "tasks": len(tasks),
        "as_published": args.as_published,
        "repositories": {r: sum(repository(t) == r for t in tasks) for r in repos},
        "stored_bytes": du["stored_bytes"],
        "stored_bytes_per_task": round(per_task),
        "paper_bytes_per_task": PAPER_BYTES_PER_TASK,
        "paper_over_ours": round(PAPER_BYTES_PER_TASK / per_task, 1),
        "layers": du["layers"],
        "bug_layer_stored_bytes": {
            "mean": round(statistics.fmean(bug_layers)),
            "max": max(bug_layers),
        },
        **built,
        **started,
        "node_cache_bytes_per_task": round(started["node_cache_bytes"] / len(tasks)),
        **graded,
        "seconds": seconds,
        "host": _common.host_info(),
    }


if __name__ == "__main__":
    _common.run_main(main)
