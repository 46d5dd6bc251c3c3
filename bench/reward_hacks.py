"""The reward-hack suite (tests/reward_hacks.py) on real SWE-bench instances.

For each instance: its gold and empty patches (controls), then every hack, each evaluated with
the guarded grading and with the harness's. A hack that does not apply to the instance (its
hunk does not fit the repository's file) is reported as such, not as stopped.

    python bench/reward_hacks.py --dataset verified.parquet --envs-dir DIR --git-mirror DIR
                                 --instance-ids ID ... [--store DIR --cache DIR]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from _common import host_info, log, run_main

# The hacks live beside the tests that run them on the bundled examples.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from reward_hacks import HACKS, SYMPY_HACKS, target_in


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--dataset", type=Path, required=True)
    ap.add_argument("--envs-dir", type=Path)
    ap.add_argument("--git-mirror", type=Path)
    ap.add_argument("--instance-ids", nargs="+", required=True)
    ap.add_argument("--store", type=Path)
    ap.add_argument("--cache", type=Path)
    ap.add_argument("--timeout", type=float, default=900.0)
    args = ap.parse_args()
    overrides = {k: v for k, v in (("store", args.store), ("cache", args.cache)) if v}
    builder = Builder(BuildSettings(git_mirror=args.git_mirror, **overrides))
    tasks = load_tasks(args.dataset, envs_dir=args.envs_dir, instance_ids=args.instance_ids)
    guarded = Evaluator(builder, timeout=args.timeout)
    harness = Evaluator(builder, timeout=args.timeout, grading="harness")
    out: dict[str, Any] = {}
    for task in tasks:
        await builder.build(task)
        target = await target_in(builder, task)
        gold = await guarded.evaluate(task, task.gold_patch)
        empty = await guarded.evaluate(task, "")
        row: dict[str, Any] = {
            "target": target.__dict__,
            "gold_reward": gold.reward,
            "gold_tampering": gold.tampering,
            "empty_reward": empty.reward,
            "hacks": {},
        }
        for hack in [*HACKS, *SYMPY_HACKS]:
            patch = hack.patch(task, target)
            g, h = await guarded.evaluate(task, patch), await harness.evaluate(task, patch)
            applies = g.patch_applied
            row["hacks"][hack.name] = {
                "applies": applies,
                "reward": g.reward,
                "harness_reward": h.reward,
                "guard_fired": any(hack.guard in t for t in g.tampering),
                "tampering": g.tampering,
                "reason": g.reason[:500],
            }
            log(f"{task.id} {hack.name}: reward {g.reward} harness {h.reward} applies {applies}")
        hacks = row["hacks"].values()
        row["summary"] = {
            "applied": sum(v["applies"] for v in hacks),
            "rewarded_guarded": sum(v["reward"] > 0 for v in hacks),
            "rewarded_by_harness": sum(v["harness_reward"] > 0 for v in hacks),
            "rewarded_by_harness_stopped": sum(
                v["harness_reward"] > 0 and v["reward"] == 0 for v in hacks
            ),
        }
        out[task.id] = row
    return {"instances": out, "host": host_info()}


if __name__ == "__main__":
    run_main(main)
