"""Evaluation fidelity: gold patches must resolve and empty patches must not, on SWE-bench tasks.

Each task is built (or found in the store), then evaluated twice with `Evaluator`, each time in a
fresh sandbox with the network off: with the dataset's gold patch and with an empty patch. A
gold run that is not resolved, or an empty run that is, is a failure of our reproduction of the
official harness (environment, services, grading), never of the task.

`--infer` withholds what describes the instances' environments: their conda exports, and the
spec of their version (each version gets a local label, "2.0+nospec", which the spec table does
not have, as a release nobody described): every recipe is inferred from its repository
(tasks.repo_recipes). Our own per-version overrides (test services: httpbin for requests < 2.9)
still apply, as they would to a new release of a repository they name.

    python bench/fidelity.py --dataset verified.parquet --envs-dir DIR --git-mirror DIR
                             [--repos psf/requests pytest-dev/pytest pallets/flask]
                             [--instance-ids ID ...] [--jobs 2] [--infer] [--done-only|--rerun]
                             [--work-dir DIR | --store DIR --cache DIR]

Each task's result goes to `<work-dir>/per_instance.jsonl` as it finishes; a later run of the
same dataset and mode with the same work dir reuses them (a stopped run resumes; `--rerun` runs
every task again), and `--done-only` summarizes those alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import Any

from _common import dataset_records, host_info, log, percentile, portable, run_main

from minisandbox.evaluation.evaluator import EvalResult, Evaluator
from minisandbox.tasks.builder import Builder, BuildResult, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

DEFAULT_REPOS = ["psf/requests", "pytest-dev/pytest", "pallets/flask"]
DEFAULT_WORK_DIR = Path("~/.cache/minisandbox-bench/fidelity")


def select(args: argparse.Namespace) -> list[Task]:
    """The dataset's tasks of `--repos` (or exactly `--instance-ids`), in dataset order."""
    ids = args.instance_ids
    if ids is None:
        ids = [
            r["instance_id"] for r in dataset_records(args.dataset) if r["repo"] in set(args.repos)
        ]
    if not ids:
        raise SystemExit(f"no task of {', '.join(args.repos)} in {args.dataset}")
    if args.infer:  # no exports, and versions no spec has ("2.0+nospec"): every recipe inferred
        wanted = set(ids)
        rows = [
            {**r, "version": f"{r['version']}+nospec" if r.get("version") else None}
            for r in _all_columns(args.dataset)
            if r["instance_id"] in wanted
        ]
        withheld = args.work_dir.expanduser() / "records-without-spec.jsonl"
        withheld.parent.mkdir(parents=True, exist_ok=True)
        withheld.write_text("".join(json.dumps(r, default=str) + "\n" for r in rows))
        return load_tasks(withheld, instance_ids=ids)
    return load_tasks(args.dataset, envs_dir=args.envs_dir, instance_ids=ids)


def _all_columns(dataset: Path) -> list[dict[str, Any]]:
    if dataset.suffix == ".parquet":
        import pyarrow.parquet as pq

        return list(pq.read_table(dataset).to_pylist())
    return dataset_records(dataset)


def _verdict(r: EvalResult) -> dict[str, Any]:
    return {
        "status": r.status,
        "resolved": r.resolved,
        "swebench_resolved": r.swebench_resolved,
        "reason": r.reason,
        "test_exit_code": r.test_exit_code,
        "seconds": r.duration_s,
        "grading": r.grading,
        "tampering": r.tampering,
    }


async def run_task(
    builder: Builder, evaluator: Evaluator, task: Task, logs: Path | None
) -> dict[str, Any]:
    began = time.monotonic()
    built: BuildResult = await builder.build(task)
    out: dict[str, Any] = {"build": built.status, "build_s": round(time.monotonic() - began, 1)}
    if built.inferred:
        out["inferred"] = built.inferred
    if built.status == "failed":
        out["failure"] = f"build failed: {built.error}"
        return out
    for kind, patch in (("gold", task.gold_patch), ("empty", "")):
        r = await evaluator.evaluate(task, patch)
        out[kind] = _verdict(r)
        if logs is not None:
            (logs / f"{task.id}.{kind}.log").write_text(r.log)
    gold, empty = out["gold"], out["empty"]
    problems = []
    if not gold["resolved"]:
        problems.append(f"gold not resolved ({gold['status']}): {gold['reason']}")
    if empty["swebench_resolved"] or empty["resolved"]:
        problems.append(
            "empty patch resolved by swebench's grading: the FAIL_TO_PASS tests pass without "
            "the fix"
        )
    if problems:
        out["failure"] = "; ".join(problems)
    return out


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", type=Path, required=True, help="SWE-bench records (.parquet...)")
    ap.add_argument("--envs-dir", type=Path, help="per-instance conda exports (<id>.yml)")
    ap.add_argument("--git-mirror", type=Path, help="directory of <owner>__<name> clones")
    ap.add_argument("--repos", nargs="+", default=DEFAULT_REPOS)
    ap.add_argument("--instance-ids", nargs="+", help="exactly these tasks (overrides --repos)")
    ap.add_argument("--jobs", type=int, default=2, help="tasks built and evaluated at once")
    ap.add_argument("--timeout", type=float, default=1800.0, help="per test run, seconds")
    ap.add_argument("--work-dir", type=Path, default=DEFAULT_WORK_DIR)
    ap.add_argument("--store", type=Path, help="layer store (default <work-dir>/store)")
    ap.add_argument("--cache", type=Path, help="node cache (default <work-dir>/cache)")
    ap.add_argument("--logs", type=Path, help="write each run's test log here")
    ap.add_argument("--infer", action="store_true", help="withhold exports and specs: infer")
    ap.add_argument(
        "--done-only", action="store_true", help="summarize the tasks done so far, run none"
    )
    ap.add_argument("--rerun", action="store_true", help="run every task, journaled or not")
    args = ap.parse_args()

    work = args.work_dir.expanduser()
    settings = BuildSettings(
        store=(args.store or work / "store").expanduser(),
        cache=(args.cache or work / "cache").expanduser(),
        git_mirror=args.git_mirror,
    )
    if args.logs:
        args.logs.mkdir(parents=True, exist_ok=True)
    tasks = select(args)
    log(f"{len(tasks)} tasks; store {settings.store}")
    builder = Builder(settings)
    evaluator = Evaluator(builder, timeout=args.timeout)
    gate = asyncio.Semaphore(max(1, args.jobs))
    began = time.monotonic()
    # Each task's result as it finishes: a run stopped half way keeps what it did, and the
    # next run with the same work dir starts where it stopped.
    journal = work / "per_instance.jsonl"
    # Reused only by a run of the same dataset and mode (and not with --rerun).
    mode = f"{args.dataset.name}:{'infer' if args.infer else 'spec'}"
    done = {} if args.rerun else _journal(journal, mode)
    if done:
        log(f"{sum(t.id in done for t in tasks)} tasks already done ({journal}): reused")
    if args.done_only:
        tasks = [t for t in tasks if t.id in done]

    async def one(task: Task) -> dict[str, Any]:
        if task.id in done:
            return done[task.id]
        async with gate:
            try:
                out = await run_task(builder, evaluator, task, args.logs)
            except Exception as e:  # one task's crash must not hide the others' results
                out = {"failure": f"{type(e).__name__}: {e}"}
        g, em = out.get("gold", {}), out.get("empty", {})
        log(
            f"{task.id}: gold {g.get('status', '-')} empty {em.get('status', '-')}"
            + (f" FAILURE {out['failure']}" if "failure" in out else "")
        )
        with journal.open("a") as fh:
            fh.write(json.dumps({"id": task.id, "mode": mode, "result": out}) + "\n")
        return out

    outs = await asyncio.gather(*map(one, tasks))
    results = {t.id: out for t, out in zip(tasks, outs, strict=True)}
    n = len(tasks)
    gold_runs = [r["gold"] for r in results.values() if "gold" in r]
    empty_runs = [r["empty"] for r in results.values() if "empty" in r]
    runs = gold_runs + empty_runs
    gold_ok = sum(r["resolved"] for r in gold_runs)
    empty_ok = sum(r["resolved"] or r["swebench_resolved"] for r in empty_runs)
    # Where our strict verdict and swebench's differ on the same log (empty runs never count as
    # resolved for us, so only gold runs are compared).
    disagree = {
        tid: r["gold"]["reason"]
        for tid, r in results.items()
        if "gold" in r and r["gold"]["resolved"] != r["gold"]["swebench_resolved"]
    }
    summary = {
        "instances": n,
        "gold_resolved": gold_ok,
        "empty_resolved": empty_ok,
        "gold_rate": round(gold_ok / n, 4) if n else 0.0,
        "empty_rate": round(empty_ok / n, 4) if n else 0.0,
        "failures": {tid: r["failure"] for tid, r in results.items() if "failure" in r},
        "swebench_gold_resolved": sum(r["swebench_resolved"] for r in gold_runs),
        "strict_vs_swebench_agreement": (
            round(
                sum(r["resolved"] == r["swebench_resolved"] for r in gold_runs) / len(gold_runs), 4
            )
            if gold_runs
            else None
        ),
        "strict_vs_swebench_disagreements": disagree,
        "by_repo": _by_repo(tasks, results),
        "build_s_total": round(sum(r.get("build_s", 0.0) for r in results.values()), 1),
        "eval_s_total": round(sum(r["seconds"] for r in runs), 1),
        "eval_s_p50": round(percentile([r["seconds"] for r in runs], 50), 1) if runs else 0.0,
        "eval_s_max": round(max((r["seconds"] for r in runs), default=0.0), 1),
        "wall_s": round(time.monotonic() - began, 1),
        "jobs": args.jobs,
        "per_instance": results,
        "host": host_info(),
    }
    places = {
        work: "<work-dir>",
        settings.store: "<store>",
        settings.cache: "<cache>",
        args.git_mirror: "<git-mirror>",
        args.logs: "<logs>",
    }
    return portable(summary, places)


def _journal(path: Path, mode: str) -> dict[str, dict[str, Any]]:
    """The results a journal holds for `mode` (the last for each task); a torn line is
    ignored."""
    out: dict[str, dict[str, Any]] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
            if entry.get("mode") == mode:
                out[str(entry["id"])] = entry["result"]
        except (ValueError, KeyError, TypeError, AttributeError):
            continue
    return out


def _by_repo(tasks: list[Task], results: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in tasks:
        r = results[t.id]
        row = out.setdefault(t.repo, {"instances": 0, "gold_resolved": 0, "empty_resolved": 0})
        row["instances"] += 1
        row["gold_resolved"] += bool(r.get("gold", {}).get("resolved"))
        e = r.get("empty", {})
        row["empty_resolved"] += bool(e.get("resolved") or e.get("swebench_resolved"))
    return out


if __name__ == "__main__":
    run_main(main)
