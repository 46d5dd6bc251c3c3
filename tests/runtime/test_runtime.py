"""The Runtime: one entry for every sandbox of a task, by purpose, over a backend that only starts
what it is given. Real sandboxes of the built example tasks, on this host's backend."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import pytest

from minisandbox.errors import TaskNotValidatedError
from minisandbox.evaluation.evaluator import EvalResult, Evaluator
from minisandbox.evaluation.purposes import PURPOSES
from minisandbox.integrations.tasks import TaskSandbox
from minisandbox.runtime import LocalBackend, Runtime
from minisandbox.sandbox.api import SandboxAPI
from minisandbox.tasks.builder import Builder, BuildSettings, TaskLayers
from minisandbox.tasks.loaders import load_tasks
from minisandbox.tasks.specs import Task

_ENV = "env | grep -E '^(PIP_NO_INDEX|UV_NATIVE_TLS|https?_proxy)=' | sort"


class _Recording(LocalBackend):
    """This host's backend, noting what it was asked to start (a real sandbox each time)."""

    def __init__(self, builder: Builder) -> None:
        super().__init__(builder)
        self.opened: list[TaskLayers] = []
        self.graded: list[tuple[str, str | None]] = []

    @contextlib.asynccontextmanager
    async def _open(self, layers: TaskLayers, **overrides: Any) -> AsyncIterator[SandboxAPI]:
        self.opened.append(layers)
        async with super().open(layers, **overrides) as sb:
            yield sb

    def open(self, layers: TaskLayers, **overrides: Any) -> Any:
        return self._open(layers, **overrides)

    async def grade(
        self, layers: TaskLayers, task: Task, patch: str | None, evaluator: Evaluator, **kw: Any
    ) -> EvalResult:
        self.graded.append((task.id, patch))
        return await super().grade(layers, task, patch, evaluator, **kw)


@pytest.fixture
def strict(settings: BuildSettings, built: list) -> Runtime:
    """A runtime whose agents get only validated tasks (none of the examples is, here: each
    test's own copy of a task has a test spec of its own, so no verdict of another test)."""
    return Runtime(BuildSettings(**{**settings.model_dump(), "require_validated": True}))


def _unvalidated(task: Task) -> Task:
    return task.model_copy(update={"pass_to_pass": [*task.pass_to_pass, "tests/none.py::x"]})


async def test_each_purpose_gets_what_the_table_says(strict: Runtime) -> None:
    task = _unvalidated(load_tasks("examples")[0])
    with pytest.raises(TaskNotValidatedError, match="has no validation"):
        async with strict.sandbox(task):  # an agent's: the policy is on
            pass
    seen = {}
    async with strict.sandbox(task, require_validated=False) as sb:
        seen["agent"] = (await sb.execute(_ENV)).stdout.split()
    async with strict.sandbox(task, purpose="evaluation") as sb:  # a grader's: no policy
        seen["evaluation"] = (await sb.execute(_ENV)).stdout.split()
    async with strict.sandbox(task, purpose="build") as sb:
        seen["build"] = (await sb.execute(_ENV)).stdout.split()
        # The build's network: its own namespace with the egress proxy, not none.
        assert any(v.startswith("https_proxy=http://") for v in seen["build"]), seen
        assert (await sb.execute("test -d /testbed/.git")).exit_code == 0
    assert seen["agent"] == [], seen
    assert seen["evaluation"] == ["PIP_NO_INDEX=1"], seen
    assert "UV_NATIVE_TLS=1" in seen["build"] and "PIP_NO_INDEX=1" not in seen["build"], seen
    assert set(PURPOSES) == {"agent", "evaluation", "build"}
    with pytest.raises(ValueError, match="purpose must be one of agent, evaluation, build"):
        async with strict.sandbox(task, purpose="grading"):  # type: ignore[arg-type]
            pass


async def test_an_integration_reaches_any_backend_through_the_runtime(
    settings: BuildSettings, built: list
) -> None:
    # A TaskSandbox never asks which backend it has: what it starts and grades goes through
    # the one its runtime was given, whichever that is.
    builder = Builder(settings)
    backend = _Recording(builder)
    task = load_tasks("examples")[1]
    box = TaskSandbox(task, runtime=Runtime(backend=backend))
    sb = await box.start()
    try:
        await sb.write_file("/tmp/gold.patch", task.gold_patch)
        assert (await sb.execute("git apply /tmp/gold.patch", cwd="/testbed")).exit_code == 0
        result = await box.evaluate(timeout=300)  # the agent's changes, graded
    finally:
        await box.stop()
    assert result.reward == 1.0, result.reason
    empty = await box.evaluate("", timeout=300)
    assert empty.reward == 0.0 and empty.status == "unresolved", empty.reason
    # The agent's sandbox, then one fresh evaluation sandbox per grade (offline pip).
    assert [layers.env_vars.get("PIP_NO_INDEX") for layers in backend.opened] == [None, "1", "1"]
    assert len({layers.task for layers in backend.opened}) == 1
    assert [t for t, _ in backend.graded] == [task.id, task.id]
    assert backend.graded[1] == (task.id, "")


def test_a_runtime_has_one_store(settings: BuildSettings) -> None:
    a, b = Builder(settings), Builder(settings)
    assert Runtime(backend=LocalBackend(a)).builder is a
    with pytest.raises(ValueError, match="a Runtime's builder is its backend's"):
        Runtime(builder=a, backend=LocalBackend(b))
