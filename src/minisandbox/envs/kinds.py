"""The kinds of layer a task image is made of, in one table: what each is keyed on, its format
version, how it is built and who sees it. Each module that names or builds a kind takes its
format from here, so a bump is one line of this table (and a new key for every layer of the
kind: they are rebuilt on first use).

A task's sandbox stacks them bottom up: [python] env [task] [bug] [evaldeps] [tools], with the
node's compat layer under all of them; hidden-tests layers are never mounted.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType


@dataclass(frozen=True)
class LayerKind:
    """One kind of layer."""

    name: str
    """Its `meta["kind"]` in the store, and its ref's prefix."""
    format: int | str
    """Part of every key of the kind: bumped when what such a layer holds changes."""
    keyed_on: str
    """What its key is a digest of (besides the format)."""
    built_by: str
    """How it is made: in a build sandbox by `LayerBuilder.build_layer` (network through the
    egress proxy), or, for what needs no sandbox, a copy published as it is."""
    seen_by: str
    """Which sandboxes mount it."""
    module: str
    """Where its key and its build are written."""


_KINDS = (
    LayerKind(
        name="python",
        format=2,
        keyed_on="the interpreter's prefix and the names in its bin/",
        built_by="a copy of the prefix without its installed packages (site-packages, "
        "dist-packages, a conda root's envs and package cache; no sandbox: nothing runs)",
        seen_by="every sandbox of a task built with it, on a node without that interpreter",
        module="envs/portable.py",
    ),
    LayerKind(
        name="env",
        format="v5",
        keyed_on="the recipe (python version, pins, pip/setuptools, variables), the interpreter's "
        "exact version, the environment commit (EnvRecipe.key: its own format 1)",
        built_by="build sandbox: uv venv at /opt/venv, pins installed (relaxed if they must)",
        seen_by="agent, evaluation, build",
        module="envs/envlayer.py",
    ),
    LayerKind(
        name="task",
        format=7,
        keyed_on="repository, base commit, environment layer, install commands, install date "
        "(with envs/asof.py's format), the eval script's extra requirements",
        built_by="build sandbox: the checkout (only the base commit's past) and the install "
        "commands' changes over the env layer",
        seen_by="agent, evaluation, build",
        module="tasks/builder.py",
    ),
    LayerKind(
        name="bug",
        format=3,
        keyed_on="the repository layer, the bug patch, the hidden test files",
        built_by="build sandbox: the bug applied and committed as the one commit",
        seen_by="agent, evaluation, build (a SWE-smith task's top layer)",
        module="tasks/builder.py",
    ),
    LayerKind(
        name="evaldeps",
        format=1,
        keyed_on="the task layer and the gold patch (only when it changes dependency files)",
        built_by="build sandbox: the wheels a patched checkout needs, downloaded",
        seen_by="evaluation only",
        module="tasks/builder.py",
    ),
    LayerKind(
        name="tools",
        format=1,
        keyed_on="the test service, the tools Python's version, its requirements",
        built_by="build sandbox: a venv of the service's tools (httpbin, ...)",
        seen_by="sandboxes of tasks that name the service",
        module="envs/tools.py",
    ),
    LayerKind(
        name="hidden-tests",
        format="content",
        keyed_on="its content (the patch restoring a bug task's hidden test files)",
        built_by="published by the bug layer's build from its output (no sandbox of its own)",
        seen_by="none: read on the host to grade",
        module="tasks/hidden_tests.py",
    ),
    LayerKind(
        name="compat",
        format="content",
        keyed_on="its content (conda activation shims, git identity)",
        built_by="written once per node into its cache (not in the store)",
        seen_by="every task sandbox",
        module="envs/compat.py",
    ),
)
KINDS = MappingProxyType({k.name: k for k in _KINDS})


def format_of(kind: str) -> int | str:
    """The format version of `kind` (KeyError: not a kind)."""
    return KINDS[kind].format
