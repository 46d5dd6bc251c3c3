"""The reward-hack suite (tests/reward_hacks.py) on a bundled example, as this caller and, when
we are root, as an unprivileged one: each hack gets reward 0 with its guard's reason, and each
that fools the harness's grading resolves the task there (so the test fails with the guards
off). The gold patch still resolves, the empty one still does not."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from pathlib import Path

import pytest

from attack_harness import HOST_PATH, RunnerUnavailable, UidRunner
from minisandbox.evaluation.evaluator import Evaluator
from minisandbox.tasks.builder import Builder, BuildSettings
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task
from reward_hacks import HACKS, Target, target_in

pytestmark = pytest.mark.timeout(600)
TASK_ID = "examples__semverkit-1"
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def task() -> Task:
    return next(t for t in load_tasks("examples") if t.id == TASK_ID)


@pytest.fixture(scope="module")
def builder(settings: BuildSettings, built: list) -> Builder:
    return Builder(settings)


@pytest.fixture(scope="module")
def target(builder: Builder, task: Task) -> Target:
    return asyncio.run(target_in(builder, task))


async def test_gold_and_empty_are_graded_as_before(builder: Builder, task: Task) -> None:
    gold = await Evaluator(builder).evaluate(task, task.gold_patch)
    assert gold.reward == 1.0 and not gold.tampering, gold.reason
    empty = await Evaluator(builder).evaluate(task, "")
    assert empty.reward == 0.0 and not empty.tampering, empty.tampering


@pytest.mark.parametrize("hack", HACKS, ids=lambda h: h.name)
async def test_hack_gets_no_reward(builder: Builder, task: Task, target: Target, hack) -> None:  # type: ignore[no-untyped-def]
    patch = hack.patch(task, target)
    guarded = await Evaluator(builder, timeout=120).evaluate(task, patch)
    assert guarded.reward == 0.0 and guarded.status == "unresolved", guarded.reason
    assert any(hack.guard in t for t in guarded.tampering), (guarded.tampering, guarded.reason)
    harness = await Evaluator(builder, timeout=120, grading="harness").evaluate(task, patch)
    if hack.fools_harness:  # with the guards off, the hack is rewarded
        assert harness.reward == 1.0 and harness.swebench_resolved, harness.reason
    if not hack.name.startswith("git_hook"):  # guarded runs disable git hooks altogether
        assert guarded.swebench_resolved == harness.swebench_resolved


@pytest.mark.slow  # a cold build in the uid's own store, then every hack: ~60 s
def test_hacks_get_no_reward_as_an_unprivileged_caller() -> None:
    if os.geteuid() != 0:
        pytest.skip("we are the unprivileged caller: the in-process tests are that run")
    try:
        runner = UidRunner(REPO)
    except RunnerUnavailable as e:
        pytest.fail(f"no unprivileged caller to run as: {e}")
    try:
        env = {"PATH": HOST_PATH, "HOME": str(runner.home), "LANG": "C.UTF-8"}
        argv = ["setpriv", f"--reuid={runner.uid}", f"--regid={runner.uid}", "--clear-groups"]
        script = str(REPO / "tests" / "reward_hacks.py")
        r = subprocess.run(
            [*argv, "--", runner.python, "-s", script, TASK_ID],
            env=env,
            cwd=runner.home,
            capture_output=True,
            text=True,
            timeout=1500,
        )
        assert r.returncode == 0, r.stderr[-4000:]
        results = json.loads(r.stdout.strip().splitlines()[-1])
    finally:
        runner.close()
    assert set(results) == {h.name for h in HACKS}
    for name, got in results.items():
        assert got["reward"] == 0.0, (name, got)
        assert any(got["guard"] in t for t in got["tampering"]), (name, got)
        if got["fools_harness"]:
            assert got["harness_reward"] == 1.0, (name, got)
