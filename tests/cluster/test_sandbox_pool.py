"""The sandbox pool on a real multi-node Ray cluster on this machine (conftest.py): real
sandboxes, real unpacks under each node's budget, nodes removed for real, a driver killed."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from cluster_helpers import CAPACITY, Nodes, agent_leftovers, our_processes, wait_until  # noqa: E402

from minisandbox.cluster import NodeLostError, PoolConfig, SandboxPool  # noqa: E402
from minisandbox.errors import CommandTimeoutError, SandboxFileError  # noqa: E402
from minisandbox.tasks.builder import BuildSettings  # noqa: E402
from minisandbox.tasks.specs import Task  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
async def pool(settings: BuildSettings, nodes: Nodes) -> Any:
    pool = await SandboxPool(PoolConfig(store=settings.store)).start()
    try:
        yield pool
    finally:
        await pool.close()


# --------------------------------------------------------------------------- budgets


async def test_unpacks_stay_within_each_nodes_budget_and_happen_once_per_node(
    settings: BuildSettings, tasks: list[Task], nodes: Nodes
) -> None:
    # Two fresh nodes of a pool of their own (their own slots resource): empty caches.
    fresh = [nodes.add(slots="fresh_slots"), nodes.add(slots="fresh_slots")]
    pool = await SandboxPool(PoolConfig(store=settings.store, slots_resource="fresh_slots")).start()
    try:
        assert len(pool.nodes) == 2 and all(not n.cached for n in pool.nodes)

        # Two sandboxes of each task at once: every layer is wanted twice on some node, at once.
        async def one(task: Task) -> None:
            async with pool.sandbox(task) as sb:
                assert (await sb.execute("python -c 'print(6 * 7)'")).stdout == "42\n"

        await asyncio.gather(*(one(t) for t in tasks * 2))
        stats = await pool.stats()
    finally:
        await pool.close()
        for node in fresh:
            nodes.cluster.remove_node(node)
    assert len(stats["nodes"]) == 2
    unpacked = 0
    for node in stats["nodes"].values():
        assert node["budget_bytes"] == nodes.budget
        assert 0 < node["max_bytes_in_flight"] <= nodes.budget or not node["unpacks"]
        assert all(count == 1 for count in node["unpacks"].values()), node["unpacks"]
        unpacked += sum(node["unpacks"].values())
    assert unpacked >= 7  # the interpreter, three venvs and three repositories, at least once
    assert stats["misses"] >= unpacked


# --------------------------------------------------------------------------- the sandbox API


async def test_a_pool_sandbox_has_the_local_api(pool: SandboxPool, tasks: list[Task]) -> None:
    async with pool.sandbox(tasks[0]) as sb:
        r = await sb.execute("cd /testbed && python -m pytest -q 2>&1 | tail -1; echo $HOSTNAME")
        assert "passed" in r.stdout
        await sb.write_file("/tmp/x.txt", "hello")
        assert await sb.read_text("/tmp/x.txt") == "hello"
        shell = await sb.create_session("main")
        await shell.run("cd /tmp && export X=41")
        assert (await shell.run("echo $PWD $((X + 1))")).output.strip() == "/tmp 42"
        await sb.close_session("main")
        # The local API's errors, as they were raised on the node.
        with pytest.raises(CommandTimeoutError) as timed_out:
            await sb.execute("echo started; sleep 30", timeout=1)
        assert "started" in timed_out.value.output
        with pytest.raises(SandboxFileError):
            await sb.read_file("/no/such/file")
        # The interpreter came as a layer: the node mounts no host path for it.
        prefix = pool.builder.interpreter(tasks[0]).prefix
        assert (await sb.execute(["test", "-x", f"{prefix}/bin/python3"])).exit_code == 0
        layers, _ = await pool._task_layers(tasks[0], False)
        assert layers.ro_paths == [] and layers.interpreters


async def test_gold_patches_resolve_and_empty_ones_do_not(
    pool: SandboxPool, tasks: list[Task]
) -> None:
    gold = await asyncio.gather(*(pool.evaluate(t, t.gold_patch, timeout=120) for t in tasks))
    empty = await asyncio.gather(*(pool.evaluate(t, "", timeout=120) for t in tasks))
    assert [r.reward for r in gold] == [1.0] * 3, [r.reason for r in gold]
    assert [r.reward for r in empty] == [0.0] * 3


# --------------------------------------------------------------------------- placement


async def test_a_sandbox_goes_where_its_layers_are(pool: SandboxPool, tasks: list[Task]) -> None:
    # Make one task's layers present on one node only: a node that has them is preferred.
    task = tasks[1]
    layers, _ = await pool._task_layers(task, False)
    holder = next((n for n in pool.nodes if set(layers.ids) <= n.cached), None)
    if holder is None:
        async with pool.sandbox(task) as sb:
            holder = next(n for n in pool.nodes if n.node_id == sb.node_id)
    for _ in range(3):
        async with pool.sandbox(task) as sb:
            assert sb.node_id == holder.node_id
            assert sb.facts["misses"] == 0 and sb.facts["hits"] == len(set(layers.ids))


async def test_no_node_is_given_more_sandboxes_than_its_capacity(
    pool: SandboxPool, tasks: list[Task]
) -> None:
    total = CAPACITY * len(pool.nodes)
    most = {n.node_id: 0 for n in pool.nodes}
    now = dict(most)
    release = asyncio.Event()
    opened = 0

    async def one() -> None:
        nonlocal opened
        async with pool.sandbox(tasks[0]) as sb:
            now[sb.node_id] += 1
            most[sb.node_id] = max(most[sb.node_id], now[sb.node_id])
            opened += 1
            await release.wait()
            now[sb.node_id] -= 1

    episodes = [asyncio.ensure_future(one()) for _ in range(total + 2)]
    deadline = time.monotonic() + 120
    while opened < total and time.monotonic() < deadline:
        await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    assert opened == total  # the last two wait for a slot
    release.set()
    await asyncio.gather(*episodes)
    assert opened == total + 2
    assert max(most.values()) == CAPACITY


# --------------------------------------------------------------------------- faults


async def test_a_lost_node_fails_its_episode_and_the_pool_keeps_serving(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    doomed = nodes.add()
    pool = await SandboxPool(PoolConfig(store=settings.store)).start()
    try:
        victim = next(n for n in pool.nodes if n.node_id == doomed.node_id)
        victim.others = CAPACITY  # (as if full) the survivor goes to another node
        async with pool.sandbox(tasks[2]) as survivor_sb:
            assert survivor_sb.node_id != victim.node_id
            for n in pool.nodes:  # the others as if full: the next sandbox goes to the victim
                n.others = CAPACITY if n is not victim else 0
            async with pool.sandbox(tasks[0]) as sb:
                assert sb.node_id == victim.node_id
                agent_pid = (await pool._call(victim, "info"))["pid"]
                await sb.execute("sleep 8675309 >/dev/null 2>&1 &")
                assert our_processes("8675309")
                nodes.cluster.remove_node(doomed)
                with pytest.raises(NodeLostError, match="was lost"):
                    await sb.execute("true", timeout=30)
            # The other nodes' sandboxes run on; the pool places the next one elsewhere.
            assert (await survivor_sb.execute("echo alive")).stdout == "alive\n"
        for n in pool.nodes:
            n.others = 0
        async with pool.sandbox(tasks[0]) as sb:
            assert sb.node_id != victim.node_id
        # Nothing of the lost node's sandboxes is left running or on disk.
        wait_until(lambda: not agent_leftovers(agent_pid), "the lost node's sandboxes remain")
        assert not our_processes("8675309")
        stats = await pool.stats()
        assert all(s["open"] == 0 for s in stats["nodes"].values())
    finally:
        await pool.close()


async def test_an_episode_retries_elsewhere_when_asked(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    doomed = nodes.add()
    pool = await SandboxPool(PoolConfig(store=settings.store)).start()
    try:
        victim = next(n for n in pool.nodes if n.node_id == doomed.node_id)
        for n in pool.nodes:  # the doomed node first: the others look busy
            if n is not victim:
                n.others = CAPACITY - 1
        where: list[str] = []

        async def run(sb: Any) -> str:
            where.append(sb.node_id)
            if sb.node_id == victim.node_id:
                nodes.cluster.remove_node(doomed)
            return (await sb.execute("echo done", timeout=30)).stdout

        assert await pool.episode(tasks[0], run, retries=1) == "done\n"
        assert where[0] == victim.node_id and where[1] != victim.node_id
        # The pool serves on.
        for n in pool.nodes:
            n.others = 0
        result = await pool.evaluate(tasks[0], tasks[0].gold_patch, timeout=120)
        assert result.reward == 1.0
    finally:
        await pool.close()


def test_a_dead_driver_leaves_no_sandboxes(settings: BuildSettings, nodes: Nodes) -> None:
    script = textwrap.dedent(
        f"""
        import asyncio, os, sys
        os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
        import ray
        from minisandbox.cluster import PoolConfig, SandboxPool
        from minisandbox.tasks.loaders import load_tasks

        async def main():
            pool = await SandboxPool(PoolConfig(store={str(settings.store)!r})).start()
            task = load_tasks("examples")[0]
            async with pool.sandbox(task) as sb:
                await sb.execute("sleep 8675310 >/dev/null 2>&1 &")
                print("ready", flush=True)
                await asyncio.sleep(600)

        ray.init(address={nodes.cluster.address!r})
        asyncio.run(main())
        """
    )
    driver = subprocess.Popen(
        [sys.executable, "-c", script], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL
    )
    try:
        assert driver.stdout is not None
        line = driver.stdout.readline()
        assert line.strip() == b"ready", line
        assert our_processes("8675310")
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        wait_until(lambda: not our_processes("8675310"), "the dead driver's sandbox runs", 90)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()
