"""What a sandbox of a task is for decides what it is made of: one table, read by the Runtime
(and by `Evaluator.evaluate`, its local shortcut), so that an agent's, a grader's and a build's
sandbox of the same task differ only where this table says.

- "agent": the task as the agent works on it: the repository at /testbed, no network, nothing of
  the fix; refused for a task without a passing validation when the policy asks for one.
- "evaluation": what grading needs on top: the gold patch's wheels (EVAL_WHEELHOUSE), offline
  pip (EVAL_ENV), and the task as graded (a bug task's hidden tests come back:
  `Builder.evaluation_task`). No validation policy: grading a task is how it gets validated.
- "build": the agent's layers with a build's network (its own namespace, through the egress
  proxy to the package indexes) and the host's index and CA settings (`LayerBuilder.build_config`):
  for steps a recipe does not know, run as the builder runs its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Literal, get_args

from minisandbox.envs.layout import WHEELHOUSE
from minisandbox.tasks.builder import Builder, TaskLayers
from minisandbox.tasks.specs import Task

Purpose = Literal["agent", "evaluation", "build"]
PURPOSES: tuple[Purpose, ...] = get_args(Purpose)

# Offline pip: the eval scripts of some repositories reinstall the package (`pip install -e .`);
# with no index it uses what the environment holds, and for pip's isolated build the wheels of
# the build requirements that the builder kept (WHEELHOUSE), instead of waiting on a network the
# sandbox does not have.
EVAL_ENV: Mapping[str, str] = MappingProxyType(
    {
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": WHEELHOUSE,
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
)


@dataclass(frozen=True)
class PurposeSpec:
    """What a sandbox of one purpose is given."""

    validation_policy: bool
    """Refused for a task without a passing validation when the policy asks for one
    (BuildSettings.require_validated, $MINISANDBOX_REQUIRE_VALIDATED)."""
    eval_layers: bool
    """The layers only evaluation may see (the gold patch's wheels)."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Variables added to the recipe's."""
    build_network: bool = False
    """A build's network and host settings instead of none."""


SPECS: Mapping[Purpose, PurposeSpec] = MappingProxyType(
    {
        "agent": PurposeSpec(validation_policy=True, eval_layers=False),
        "evaluation": PurposeSpec(validation_policy=False, eval_layers=True, env=EVAL_ENV),
        "build": PurposeSpec(validation_policy=False, eval_layers=False, build_network=True),
    }
)


def spec(purpose: str) -> PurposeSpec:
    """The table's row for `purpose`.

    Raises:
        ValueError: not a purpose (the message lists them).
    """
    if purpose not in SPECS:
        raise ValueError(f"purpose must be one of {', '.join(PURPOSES)}, not {purpose!r}")
    return SPECS[purpose]  # type: ignore[index]  # (checked just above: a Purpose)


async def purpose_layers(
    builder: Builder,
    task: Task,
    purpose: Purpose,
    *,
    build: bool = True,
    extra_env: Mapping[str, str] | None = None,
    on_phase: Callable[[str, str], None] | None = None,
) -> TaskLayers:
    """The task's layers for a sandbox of `purpose` (`Builder.task_layers`, as the table says).

    Raises:
        ValueError: not a purpose; and what `Builder.task_layers` raises.
    """
    layers, _ = await purpose_sandbox(
        builder, task, purpose, build=build, extra_env=extra_env, on_phase=on_phase
    )
    return layers


async def purpose_sandbox(
    builder: Builder,
    task: Task,
    purpose: Purpose,
    *,
    build: bool = True,
    extra_env: Mapping[str, str] | None = None,
    on_phase: Callable[[str, str], None] | None = None,
) -> tuple[TaskLayers, dict[str, object]]:
    """`purpose_layers`, and the SandboxConfig fields a sandbox of `purpose` needs beyond
    its layers (a build's network and limits; none for the others).

    Raises:
        ValueError: not a purpose; and what `Builder.task_layers` raises.
    """
    row = spec(purpose)
    layers = await builder.task_layers(
        task,
        build=build,
        evaluation=row.eval_layers,
        extra_env={**row.env, **(extra_env or {})},
        on_phase=on_phase,
    )
    if not row.build_network:
        return layers, {}
    config = builder.build_config(builder.interpreter(task), upper=None)
    layers = layers.model_copy(
        update={
            "env_vars": {**config.env, **layers.env_vars},
            "ro_paths": sorted({*layers.ro_paths, *config.ro_paths}),
        }
    )
    return layers, {"egress": config.egress, "limits": config.limits}


def graded_task(builder: Builder, task: Task, purpose: Purpose) -> Task:
    """`task` as a sandbox of `purpose` runs it: evaluation's brings back hidden tests."""
    return builder.evaluation_task(task) if purpose == "evaluation" else task
