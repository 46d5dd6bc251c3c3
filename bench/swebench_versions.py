"""Tasks and verdicts do not depend on which swebench is installed.

Every record of each `--dataset` is loaded into a task twice, in two processes: with the swebench
of this environment (4.1, the dev extra's) and with a current release (`--swebench`, installed
with uv into a throwaway directory put first on the path). A task is everything a build and an
evaluation read (recipe, eval script, tests, parser), so equal tasks mean equal layers and equal
test runs. Then every kept test log (`--logs`: fidelity.py's `<id>.gold.log` / `<id>.empty.log`)
is graded by both: our verdict and swebench's own.

    python bench/swebench_versions.py --dataset verified.parquet --envs-dir DIR
        [--dataset lite.parquet ...] [--logs DIR ...] [--swebench 'swebench>=5,<6']
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main

from minisandbox.utils.uv import uv_binary

# Runs in the child: prints {"swebench": version, "tasks": {id: digest}, "verdicts": {log: [..]}}.
_CHILD = """
import hashlib, importlib.metadata, json, sys
from pathlib import Path
from minisandbox.evaluation.evaluator import grade
from minisandbox.tasks.loaders import load_tasks
req = json.loads(sys.stdin.read())
tasks = {}
for ds in req["datasets"]:
    for t in load_tasks(ds, envs_dir=req["envs_dir"]):
        tasks[t.id] = t
digests = {
    i: hashlib.sha256(json.dumps(t.model_dump(mode="json"), sort_keys=True).encode()).hexdigest()
    for i, t in tasks.items()
}
verdicts = {}
for d in req["logs"]:
    for f in sorted(Path(d).glob("*.log")):
        task = tasks.get(f.name.removesuffix(".log").rsplit(".", 1)[0])
        if task is not None:
            g = grade(task, f.read_text(errors="replace"))
            verdicts[f"{Path(d).name}/{f.name}"] = [g.resolved, g.swebench_resolved]
print(json.dumps({
    "swebench": importlib.metadata.version("swebench"),
    "tasks": digests,
    "verdicts": verdicts,
}))
"""


def _child(request: dict[str, Any], pythonpath: Path | None) -> dict[str, Any]:
    env = dict(os.environ)
    if pythonpath is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath), env.get("PYTHONPATH")]))
    r = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(request),
        capture_output=True,
        text=True,
        env=env,
    )
    if r.returncode != 0:
        raise SystemExit(f"loading under {pythonpath or 'this environment'} failed:\n{r.stderr}")
    out: dict[str, Any] = json.loads(r.stdout)
    return out


def _differences(a: dict[str, Any], b: dict[str, Any]) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) != b.get(k))


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", type=Path, action="append", required=True)
    ap.add_argument("--envs-dir", type=Path, help="per-instance conda exports (<id>.yml)")
    ap.add_argument("--logs", type=Path, action="append", default=[], help="kept test logs")
    ap.add_argument("--swebench", default="swebench>=5,<6", help="the release to compare with")
    args = ap.parse_args()
    request = {
        "datasets": [str(d) for d in args.dataset],
        "envs_dir": str(args.envs_dir) if args.envs_dir else None,
        "logs": [str(d) for d in args.logs],
    }
    with tempfile.TemporaryDirectory(prefix="swebench-other-") as tmp:
        target = Path(tmp) / "site"
        uv = [str(uv_binary()), "pip", "install", "-q", "--no-deps", "--python", sys.executable]
        uv += ["--target", str(target)]
        r = subprocess.run([*uv, args.swebench], capture_output=True, text=True)
        if r.returncode != 0:
            raise SystemExit(f"installing {args.swebench} failed: {r.stderr.strip()}")
        log("loading and grading with this environment's swebench")
        here = await asyncio.to_thread(_child, request, None)
        log(f"loading and grading with {args.swebench}")
        other = await asyncio.to_thread(_child, request, target)
    task_diff = _differences(here["tasks"], other["tasks"])
    verdict_diff = _differences(here["verdicts"], other["verdicts"])
    gold = [v for k, v in here["verdicts"].items() if k.endswith(".gold.log")]
    return {
        "benchmark": "swebench_versions",
        "swebench_here": here["swebench"],
        "swebench_other": other["swebench"],
        "datasets": [d.name for d in args.dataset],
        "tasks": len(here["tasks"].keys() | other["tasks"].keys()),
        "tasks_identical": len(here["tasks"].keys() | other["tasks"].keys()) - len(task_diff),
        "tasks_different": task_diff,
        "logs_graded": len(here["verdicts"].keys() | other["verdicts"].keys()),
        "verdicts_identical": len(here["verdicts"].keys() | other["verdicts"].keys())
        - len(verdict_diff),
        "verdicts_different": {
            k: [here["verdicts"].get(k), other["verdicts"].get(k)] for k in verdict_diff
        },
        "gold_logs_resolved_here": sum(1 for v in gold if v[0]),
        "digest_of_all_tasks": hashlib.sha256(
            json.dumps(here["tasks"], sort_keys=True).encode()
        ).hexdigest()[:16],
        "host": host_info(),
    }


if __name__ == "__main__":
    run_main(main)
