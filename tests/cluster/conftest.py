"""A real multi-node Ray cluster on this machine, started once for these tests (starting Ray
costs seconds): a head (the driver's node, no sandboxes) and two sandbox nodes, each with its own
node cache and I/O budget, as each node of a real cluster has. Tests add and remove more nodes."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from cluster_helpers import Nodes  # noqa: E402

from minisandbox.tasks.builder import Builder, BuildSettings  # noqa: E402
from minisandbox.tasks.launch import portable  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402
from minisandbox.tasks.specs import Task  # noqa: E402


@pytest.fixture(scope="package")
def tasks() -> list[Task]:
    return load_tasks("examples")


@pytest.fixture(scope="package")
def nodes(settings: BuildSettings, built: list, tasks: list[Task], home: Path) -> Iterator[Nodes]:
    # Each node's budget: the largest layer a sandbox of an example needs (the interpreter's),
    # so that two unpacks that do not fit together must wait for each other.
    builder = Builder(settings)

    async def sizes() -> list[int]:
        out = []
        for task in tasks:
            layers = await portable(builder, await builder.layers(task, build=False))
            out += [builder.store.info(i).size for i in layers.ids]
        return out

    budget = max(asyncio.run(sizes()))
    from ray.cluster_utils import Cluster

    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "object_store_memory": 100 << 20,
            "include_dashboard": False,
        },
    )
    made = Nodes(cluster, home / "cluster", budget)
    try:
        ray.init(address=cluster.address)
        made.add()
        made.add()
        yield made
    finally:
        ray.shutdown()
        cluster.shutdown()
