"""Starting a sandbox from a task's layers: the launcher takes the layers as data."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from minisandbox.envs.compat import compat_layer
from minisandbox.envs.layerbuild import LayerBuilder
from minisandbox.envs.layout import TESTBED, VENV
from minisandbox.envs.portable import interpreter_layer, travels
from minisandbox.sandbox.config import SandboxConfig
from minisandbox.sandbox.sandbox import Sandbox


class TaskLayers(BaseModel):
    """What a sandbox of a task is made of, bottom to top (all of them in the store)."""

    env: str
    """The environment layer (the venv at /opt/venv)."""
    base: list[str] = Field(default_factory=list)
    """Layers the task shares with others, between the two (a bug task's repository layer)."""
    task: str
    """The task's own layer (the repository at /testbed, as installed; or its bug, committed)."""
    eval: list[str] = Field(default_factory=list)
    """Layers only evaluation sandboxes see (the wheels the gold patch needs)."""
    tools: list[str] = Field(default_factory=list)
    """The tools environments of the task's test services."""
    ro_paths: list[Path] = Field(default_factory=list)
    """Host directories mounted read-only at their own paths (interpreters)."""
    interpreters: list[str] = Field(default_factory=list)
    """Interpreters as layers, at their own paths (`portable`: for nodes without them)."""
    env_vars: dict[str, str] = Field(default_factory=dict)
    """The sandbox's environment variables (the recipe's, and the caller's)."""

    @property
    def ids(self) -> list[str]:
        return [*self.interpreters, self.env, *self.base, self.task, *self.eval, *self.tools]


async def portable(lb: LayerBuilder, layers: TaskLayers) -> TaskLayers:
    """`layers` for a node that may not have this host's interpreters: each host path that can
    travel becomes a layer of the store (published once, envs.portable).

    Raises:
        OSError: an interpreter's prefix could not be read.
    """
    moving = [p for p in layers.ro_paths if travels(p)]
    ids = [await interpreter_layer(lb, p) for p in moving]
    return layers.model_copy(
        update={
            "interpreters": list(dict.fromkeys([*layers.interpreters, *ids])),
            "ro_paths": [p for p in layers.ro_paths if p not in moving],
        }
    )


@contextlib.asynccontextmanager
async def launch(lb: LayerBuilder, layers: TaskLayers, **overrides: Any) -> AsyncIterator[Sandbox]:
    """A sandbox of `layers`: made present in the node cache (once per node, under the I/O
    budget), the repository at /testbed, its venv active, SWE-bench's conda activation
    provided (envs.compat). `overrides` are more SandboxConfig fields.

    Raises:
        SandboxStartError: the sandbox could not be set up (and the node cache's errors).
    """
    compat = compat_layer(lb.settings.cache / "compat", lb.cache.owner)
    async with lb.cache.use(layers.ids) as paths:
        config = SandboxConfig(
            layers=[compat, *paths],
            ro_paths=sorted(set(layers.ro_paths)),
            venv=VENV,
            workdir=TESTBED,
            env=layers.env_vars,
            **overrides,
        )
        async with Sandbox(config) as sb:
            yield sb
