"""One summary of the fidelity runs kept under bench/results/ (fidelity-*.json, each one
repository or a few, run by bench/fidelity.py): per repository and in all, instances, gold and
empty patches resolved, swebench's agreement, and evaluation time per run (p50, max).

A task run again in a later run (after a fix) counts with its latest result (by the time each
run finished, `host.finished`).

    python bench/fidelity_summary.py [bench/results/fidelity-*.json ...]
    python bench/fidelity_summary.py bench/results/lite/spec-*.json \
        --versus bench/results/lite/infer-*.json

With `--versus`, the two sets side by side (e.g. the same instances with their spec and with
their recipe inferred): per repository both summaries' counts, and the instances whose gold
verdict differs.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from _common import percentile


def summarize(files: list[Path]) -> dict[str, Any]:
    latest: dict[str, dict[str, Any]] = {}
    runs_in_order = sorted(
        ((json.loads(p.read_text()), p) for p in files),
        key=lambda dp: (dp[0].get("host", {}).get("finished", ""), dp[1].name),
    )
    for data, path in runs_in_order:
        for tid, result in data["per_instance"].items():
            latest[tid] = {**result, "file": path.name}
    repos: dict[str, dict[str, Any]] = {}
    for tid, r in sorted(latest.items()):
        repo = tid.rsplit("-", 1)[0].replace("__", "/")
        row = repos.setdefault(
            repo, {"instances": 0, "gold_resolved": 0, "empty_resolved": 0, "failures": {}}
        )
        row["instances"] += 1
        row["gold_resolved"] += bool(r.get("gold", {}).get("resolved"))
        empty = r.get("empty", {})
        row["empty_resolved"] += bool(empty.get("resolved") or empty.get("swebench_resolved"))
        if "failure" in r:
            row["failures"][tid] = r["failure"][:300]
    runs = [r[k] for r in latest.values() for k in ("gold", "empty") if k in r]
    gold = [r["gold"] for r in latest.values() if "gold" in r]
    seconds = [r["seconds"] for r in runs]
    return {
        "instances": len(latest),
        "built": sum(r.get("build") != "failed" for r in latest.values()),
        "gold_resolved": sum(r["resolved"] for r in gold),
        "empty_resolved": sum(row["empty_resolved"] for row in repos.values()),
        "swebench_agrees": sum(r["resolved"] == r["swebench_resolved"] for r in gold),
        "gold_runs": len(gold),
        "eval_s_p50": round(percentile(seconds, 50), 1) if seconds else None,
        "eval_s_max": round(max(seconds), 1) if seconds else None,
        "by_repo": repos,
        "files": sorted(p.name for p in files),
    }


def versus(a: list[Path], b: list[Path]) -> dict[str, Any]:
    """Two sets of runs side by side: per repository (instances, gold and empty resolved of
    each), and the instances whose gold is resolved in one only."""
    left, right = summarize(a), summarize(b)
    repos = {}
    for repo in sorted(left["by_repo"].keys() | right["by_repo"].keys()):
        la, rb = left["by_repo"].get(repo, {}), right["by_repo"].get(repo, {})
        repos[repo] = {
            "instances": [la.get("instances", 0), rb.get("instances", 0)],
            "gold_resolved": [la.get("gold_resolved", 0), rb.get("gold_resolved", 0)],
            "empty_resolved": [la.get("empty_resolved", 0), rb.get("empty_resolved", 0)],
        }
    gold_a, gold_b = _gold(a), _gold(b)
    return {
        "columns": ["first", "versus"],
        "instances": [left["instances"], right["instances"]],
        "gold_resolved": [left["gold_resolved"], right["gold_resolved"]],
        "empty_resolved": [left["empty_resolved"], right["empty_resolved"]],
        "swebench_agrees": [left["swebench_agrees"], right["swebench_agrees"]],
        "by_repo": repos,
        "resolved_in_first_only": sorted(k for k, v in gold_a.items() if v and not gold_b.get(k)),
        "resolved_in_versus_only": sorted(k for k, v in gold_b.items() if v and not gold_a.get(k)),
        "files": [left["files"], right["files"]],
    }


def _gold(files: list[Path]) -> dict[str, bool]:
    """Each task's gold verdict in its latest run (as `summarize` counts it)."""
    runs = sorted(
        (json.loads(p.read_text()) for p in files),
        key=lambda d: d.get("host", {}).get("finished", ""),
    )
    out: dict[str, bool] = {}
    for data in runs:
        for tid, r in data["per_instance"].items():
            out[tid] = bool(r.get("gold", {}).get("resolved"))
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    if "--versus" in args:
        i = args.index("--versus")
        first, second = [Path(x) for x in args[:i]], [Path(x) for x in args[i + 1 :]]
        print(json.dumps(versus(first, second), indent=1))
        raise SystemExit(0)
    files = [Path(a) for a in args] or sorted(
        (Path(__file__).parent / "results").glob("fidelity-*.json")
    )
    print(json.dumps(summarize(files), indent=1))
