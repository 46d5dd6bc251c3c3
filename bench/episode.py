"""Per-episode overhead of an RL episode on minisandbox: what a rollout pays besides the agent's
own steps and the tests themselves.

An episode is: start the task's sandbox, reset the repository (SWE-agent's `git` reset), let the
agent work (here: the gold patch applied with `git apply`, untimed), take its diff, evaluate it
in a fresh sandbox (apply, eval script, grading), stop. Side by side in the same run, the tests
alone (the eval script run in an already started sandbox) give the part no harness can avoid:

    overhead = start + reset + (evaluate - tests alone) + stop

The same start is also measured through the integrations (SWE-ReX deployment + session,
mini-swe-agent environment), when their packages are installed.

    python bench/episode.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from _common import host_info, log, percentile, run_main

from minisandbox.evaluation.evaluator import EVAL_ENV, Evaluator
from minisandbox.integrations.tasks import TaskSandbox
from minisandbox.runtime import Runtime
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.eval_script import make_eval_script
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

# What SWE-agent runs to reset the repository at the start of an episode.
RESET = "git status >/dev/null && git restore . && git reset --hard -q && git clean -fdq"


async def _timed(fn: Callable[[], Awaitable[Any]]) -> tuple[float, Any]:
    t0 = time.perf_counter()
    value = await fn()
    return time.perf_counter() - t0, value


async def core_episode(builder: Builder, task: Task) -> dict[str, float]:
    ts = TaskSandbox(task, runtime=Runtime(builder=builder))
    start_s, sb = await _timed(ts.start)
    try:
        reset_s, r = await _timed(lambda: sb.execute(RESET, cwd="/testbed"))
        assert r.exit_code == 0, r.output
        await sb.write_file("/tmp/agent.patch", task.gold_patch)  # the agent's work: untimed
        assert (await sb.execute("git apply /tmp/agent.patch", cwd="/testbed")).exit_code == 0
        diff_s, patch = await _timed(ts.diff)
        # The tests alone, in this running sandbox: the eval script as evaluation runs it.
        await sb.write_file("/eval.sh", make_eval_script(task))
        tests_s, run = await _timed(
            lambda: sb.execute(["/bin/bash", "/eval.sh"], cwd="/testbed", env=EVAL_ENV)
        )
        assert run.exit_code == 0, run.output[-2000:]
    finally:
        stop_s, _ = await _timed(ts.stop)
    eval_s, result = await _timed(lambda: Evaluator(builder, timeout=600).evaluate(task, patch))
    assert result.reward == 1.0, result.reason
    return {
        "start_s": start_s,
        "reset_s": reset_s,
        "diff_s": diff_s,
        "tests_s": tests_s,
        "evaluate_s": eval_s,
        "stop_s": stop_s,
        "overhead_s": start_s + reset_s + diff_s + max(0.0, eval_s - tests_s) + stop_s,
    }


async def swerex_start(task: Task) -> float | None:
    try:
        from swerex.runtime.abstract import BashAction, CreateBashSessionRequest

        from minisandbox.integrations.swerex import MiniSandboxDeployment
    except ImportError:
        return None
    d = MiniSandboxDeployment(task=task.id, dataset="examples")
    t0 = time.perf_counter()
    await d.start()
    await d.runtime.create_session(CreateBashSessionRequest())
    await d.runtime.run_in_session(BashAction(command="cd /testbed && git status", check="raise"))
    seconds = time.perf_counter() - t0
    await d.stop()
    return seconds


def minisweagent_start(task: Task) -> float | None:
    try:
        from minisandbox.integrations.minisweagent import MiniSandboxEnvironment
    except ImportError:
        return None
    t0 = time.perf_counter()
    env = MiniSandboxEnvironment(task=task.id, dataset="examples")
    out = env.execute({"command": "git status"})
    seconds = time.perf_counter() - t0
    assert out["returncode"] == 0, out
    env.cleanup()
    return seconds


async def main() -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5, help="episodes per task")
    args = ap.parse_args()
    builder = Builder(BuildSettings())
    tasks = load_tasks("examples")
    log("building the example tasks (untimed)")
    for r in await asyncio.gather(*(builder.build(t) for t in tasks)):
        assert r.status != "failed", r.error
    for t in tasks:  # first starts unpack the layers on this node: untimed
        await core_episode(builder, t)
    samples: dict[str, list[float]] = {}
    for i in range(args.rounds):
        log(f"round {i + 1}/{args.rounds}")
        for t in tasks:
            for key, value in (await core_episode(builder, t)).items():
                samples.setdefault(key, []).append(value)
            s = await swerex_start(t)
            if s is not None:
                samples.setdefault("swerex_start_s", []).append(s)
            m = await asyncio.to_thread(lambda t=t: minisweagent_start(t))  # type: ignore[misc]
            if m is not None:
                samples.setdefault("minisweagent_start_s", []).append(m)
    result: dict[str, Any] = {"benchmark": "episode", "tasks": len(tasks), "rounds": args.rounds}
    for key, values in samples.items():
        result[f"{key.removesuffix('_s')}_p50_s"] = round(percentile(values, 50), 4)
    result["overhead_ratio_vs_tests"] = round(result["overhead_p50_s"] / result["tests_p50_s"], 3)
    result["host"] = host_info()
    return result


if __name__ == "__main__":
    run_main(main)
