"""What the cluster tests share: the test cluster's nodes, and ways to look for leftovers."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any

import pytest
import ray

from minisandbox.sandbox.runtime import runtime_root

CAPACITY = 3


class Nodes:
    """The test cluster; `add` starts one more sandbox node with a cache of its own."""

    def __init__(self, cluster: Any, home: Path, budget: int) -> None:
        self.cluster = cluster
        self.home = home
        self.budget = budget
        self.count = 0

    def add(self, slots: str = "minisandbox_slots", **resources: float) -> Any:
        self.count += 1
        node = self.cluster.add_node(
            num_cpus=1,
            object_store_memory=80 << 20,
            resources={slots: CAPACITY, **resources},
            env_vars={
                "MINISANDBOX_CACHE": str(self.home / f"node-{self.count}"),
                "MINISANDBOX_IO_BUDGET": str(self.budget),
            },
        )
        wait_until(
            lambda: any(n["NodeID"] == node.node_id and n["Alive"] for n in ray.nodes()),
            "the new node joined",
        )
        return node


def our_processes(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker`."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(int(pid))
    return found


def wait_until(check: Any, what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            pytest.fail(f"after {timeout:g} s: {what}")
        time.sleep(0.2)


def agent_leftovers(pid: int) -> list[str]:
    """What is left of the sandboxes of the agent process `pid`: its runtime directory, and
    processes naming it."""
    dirs = [str(p) for p in runtime_root().glob(f"p{pid}-*")]
    procs = [str(p) for d in dirs for p in our_processes(d)]
    return dirs + procs
