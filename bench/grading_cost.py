"""What the guarded grading costs: evaluation time with and without its guards, side by side.

The same patches (each task's gold) are evaluated in turns, guarded then harness then harness
then guarded..., each in a fresh sandbox, so that the machine's drift falls on both alike. The
bundled examples by default; with --dataset, also --instance-ids of a SWE-bench file (their
layers must be in --store/--cache, e.g. fidelity.py's).

    python bench/grading_cost.py [--rounds 5] [--dataset verified.parquet --envs-dir DIR
                                 --store DIR --cache DIR --instance-ids ID ...]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

from _common import host_info, log, percentile, run_main

from minisandbox.evaluation.evaluator import GRADINGS, Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--rounds", type=int, default=5, help="evaluations per task and grading")
    ap.add_argument("--dataset", type=Path, help="a SWE-bench file, for --instance-ids")
    ap.add_argument("--envs-dir", type=Path)
    ap.add_argument("--git-mirror", type=Path)
    ap.add_argument("--instance-ids", nargs="*", default=[])
    ap.add_argument("--store", type=Path)
    ap.add_argument("--cache", type=Path)
    args = ap.parse_args()
    if args.rounds < 1:
        raise SystemExit("--rounds must be at least 1")
    overrides = {k: v for k, v in (("store", args.store), ("cache", args.cache)) if v}
    builder = Builder(BuildSettings(git_mirror=args.git_mirror, **overrides))
    tasks = load_tasks("examples")
    if args.instance_ids:
        if args.dataset is None:
            raise SystemExit("--instance-ids needs --dataset")
        tasks += load_tasks(args.dataset, envs_dir=args.envs_dir, instance_ids=args.instance_ids)
    for t in tasks:
        built = await builder.build(t)
        if built.status == "failed":
            raise SystemExit(f"{t.id} does not build: {built.error}")
    evaluators = {g: Evaluator(builder, grading=g) for g in GRADINGS}
    for t in tasks:  # untimed: each task's first sandbox warms the node cache and imports
        await evaluators["harness"].evaluate(t, t.gold_patch)
    seconds: dict[str, dict[str, list[float]]] = {t.id: {g: [] for g in GRADINGS} for t in tasks}
    wrong: list[str] = []
    for i in range(args.rounds):
        order = GRADINGS if i % 2 == 0 else tuple(reversed(GRADINGS))
        for t in tasks:
            for g in order:
                began = time.monotonic()
                r = await evaluators[g].evaluate(t, t.gold_patch)
                seconds[t.id][g].append(time.monotonic() - began)
                if r.reward != 1.0:
                    wrong.append(f"{t.id} {g}: {r.reason}")
        log(f"round {i + 1}/{args.rounds} done")
    per_task = {
        tid: {f"{g}_p50_s": round(percentile(s[g], 50), 3) for g in GRADINGS}
        | {"ratio": round(percentile(s["guarded"], 50) / percentile(s["harness"], 50), 3)}
        for tid, s in seconds.items()
    }
    every = {g: [x for s in seconds.values() for x in s[g]] for g in GRADINGS}
    return {
        "rounds": args.rounds,
        "tasks": len(tasks),
        "guarded_p50_s": round(percentile(every["guarded"], 50), 3),
        "harness_p50_s": round(percentile(every["harness"], 50), 3),
        "guarded_over_harness_p50": round(
            percentile(every["guarded"], 50) / percentile(every["harness"], 50), 3
        ),
        "guarded_minus_harness_p50_s": round(
            percentile(every["guarded"], 50) - percentile(every["harness"], 50), 3
        ),
        "ratio_p50_over_tasks": round(percentile([p["ratio"] for p in per_task.values()], 50), 3),
        "per_task": per_task,
        "gold_not_resolved": wrong,
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
