"""The sandbox pool on a real multi-node Ray cluster on this machine, started once for the module
(starting Ray costs seconds): a head (the driver's node, no sandboxes) and two sandbox nodes, each
with its own node cache and I/O budget, as each node of a real cluster has; tests add and remove
more. Real sandboxes, real unpacks under each node's budget, nodes removed for real, a driver
killed; and the integrations on the pool, chosen by their config option (`cluster`)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MSWEA_SILENT_STARTUP", "1")
ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from cluster_helpers import CAPACITY, Nodes, agent_leftovers, our_processes, wait_until  # noqa: E402

from minisandbox.cluster import NodeLostError, PoolConfig, RemoteSandbox, SandboxPool  # noqa: E402
from minisandbox.cluster.pool import portable  # noqa: E402
from minisandbox.cluster.shared import shared_pool  # noqa: E402
from minisandbox.envs.portable import travels  # noqa: E402
from minisandbox.errors import (  # noqa: E402
    CommandTimeoutError,
    SandboxFileError,
    SandboxNotRunningError,
)
from minisandbox.layers.replica import layer_files  # noqa: E402
from minisandbox.layers.store import LayerStore  # noqa: E402
from minisandbox.sandbox.sync import run_sync  # noqa: E402
from minisandbox.tasks.builder import Builder, BuildSettings  # noqa: E402
from minisandbox.tasks.loaders import load_tasks  # noqa: E402
from minisandbox.tasks.specs import Task  # noqa: E402
from minisandbox.utils.safefs import discard_tree  # noqa: E402

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def tasks() -> list[Task]:
    return load_tasks("examples")


@pytest.fixture(scope="module")
def nodes(settings: BuildSettings, built: list, tasks: list[Task], home: Path) -> Iterator[Nodes]:
    # Each node's budget: the largest layer a sandbox of an example needs (the interpreter's),
    # so that two unpacks that do not fit together must wait for each other.
    builder = Builder(settings)

    async def sizes() -> list[int]:
        out = []
        for task in tasks:
            layers = await portable(builder, await builder.task_layers(task, build=False))
            out += [builder.store.info(i).size for i in layers.ids]
        return out

    budget = max(asyncio.run(sizes()))
    from ray.cluster_utils import Cluster

    # Ray's files (sessions, sockets, the current cluster's address) in a directory of ours,
    # short for its sockets and removed after: $RAY_TMPDIR, which Ray's nodes inherit. (Ray
    # writes the address to $RAY_TMPDIR/ray even when told another temp_dir, and fails where
    # that does not exist: /tmp/ray on a fresh machine.)
    # Ray adds ray/session_<date>_<time>_<pid>/sockets/plasma_store.1 (~70 bytes) and refuses
    # a socket path over 107: a short name in the session's directory, or else in /tmp with a
    # name the next session's sweep recognises.
    ray_dir = tempfile.mkdtemp(prefix="r")
    if len(ray_dir) > 36:
        os.rmdir(ray_dir)
        ray_dir = tempfile.mkdtemp(prefix=f"msbs{os.getpid()}-r", dir="/tmp")
    old_tmpdir = os.environ.get("RAY_TMPDIR")
    os.environ["RAY_TMPDIR"] = ray_dir
    try:
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
    finally:
        if old_tmpdir is None:
            os.environ.pop("RAY_TMPDIR", None)
        else:
            os.environ["RAY_TMPDIR"] = old_tmpdir
        discard_tree(Path(ray_dir))


@pytest.fixture
async def pool(settings: BuildSettings, nodes: Nodes) -> Any:
    pool = await SandboxPool(PoolConfig(store=settings.store)).start()
    agents = [(await pool._info(n)).pid for n in pool.nodes]
    try:
        yield pool
    finally:
        await pool.close()
    # Closing leaves nothing of the agents' sandboxes: no process, no runtime directory (Ray
    # kills an actor's child processes, the janitor among them, unless told not to).
    wait_until(lambda: not any(agent_leftovers(pid) for pid in agents), "the agents' leftovers")


# --------------------------------------------------------------------------- budgets


# Two fresh Ray nodes, then every layer unpacked on each under its budget: past the module's 300 s
# once, with two other suites and a second Ray cluster on the machine (load 11).
@pytest.mark.timeout(600)
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


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_starts_of_one_task_at_once_unpack_its_layers_on_one_node(
    settings: BuildSettings, tasks: list[Task], nodes: Nodes
) -> None:
    # Layers on their way to a node count as there: the second start does not unpack them on
    # the other, empty node (without that, both nodes look alike and the least loaded wins).
    fresh = [nodes.add(slots="arrive_slots"), nodes.add(slots="arrive_slots")]
    config = PoolConfig(store=settings.store, slots_resource="arrive_slots")
    pool = await SandboxPool(config).start()
    try:

        async def one() -> str:
            async with pool.sandbox(tasks[0]) as sb:
                assert (await sb.execute("true")).exit_code == 0
                return sb.node_id

        placed = await asyncio.gather(one(), one())
        stats = await pool.stats()
    finally:
        await pool.close()
        for node in fresh:
            nodes.cluster.remove_node(node)
    assert placed[0] == placed[1]
    unpacked = {n: sum(s["unpacks"].values()) for n, s in stats["nodes"].items()}
    assert unpacked[placed[0]] > 0 and sum(unpacked.values()) == unpacked[placed[0]], unpacked


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
        seen: list[tuple[int, bytes]] = []
        r = await sb.execute("echo out; echo err >&2", on_output=lambda *out: seen.append(out))
        assert seen == [(1, b"out\n"), (2, b"err\n")] and r.stdout == "out\n"
        # The local API's errors, as they were raised on the node.
        with pytest.raises(CommandTimeoutError) as timed_out:
            await sb.execute("echo started; sleep 30", timeout=1)
        assert "started" in timed_out.value.output
        with pytest.raises(SandboxFileError):
            await sb.read_file("/no/such/file")
        # The interpreter came as a layer: the node mounts no host path for it (unless it is
        # a distribution's, under /usr, which cannot travel: the node's own is used).
        prefix = pool.builder.interpreter(tasks[0]).prefix
        assert (await sb.execute(["test", "-x", f"{prefix}/bin/python3"])).exit_code == 0
        layers = await pool.node_layers(tasks[0])
        if travels(prefix):
            assert layers.ro_paths == [] and layers.interpreters
        else:
            assert layers.ro_paths == [prefix] and not layers.interpreters
        await sb.stop()  # before the block ends: stopped on its node
        assert not sb.running
        with pytest.raises(SandboxNotRunningError):
            await sb.execute("true")


async def test_gold_patches_resolve_and_empty_ones_do_not(
    pool: SandboxPool, tasks: list[Task]
) -> None:
    gold = await asyncio.gather(*(pool.evaluate(t, t.gold_patch, timeout=120) for t in tasks))
    empty = await asyncio.gather(*(pool.evaluate(t, "", timeout=120) for t in tasks))
    assert [r.reward for r in gold] == [1.0] * 3, [r.reason for r in gold]
    assert [r.reward for r in empty] == [0.0] * 3


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_nodes_that_do_not_see_the_store_get_layers_through_ray(
    settings: BuildSettings, tasks: list[Task], nodes: Nodes, tmp_path: Path
) -> None:
    # The nodes are told the store is at a path where they find another store (as a node has
    # its own at the default path): not the driver's, so they copy from it.
    other = LayerStore(tmp_path / "another-store")
    config = PoolConfig(store=settings.store, node_store=other.root)
    async with SandboxPool(config) as pool:
        gold = await asyncio.gather(*(pool.evaluate(t, t.gold_patch, timeout=120) for t in tasks))
        assert [r.reward for r in gold] == [1.0] * 3, [r.reason for r in gold]
        empty = await asyncio.gather(*(pool.evaluate(t, "", timeout=120) for t in tasks))
        assert [r.reward for r in empty] == [0.0] * 3
        # What a node copied is each layer's files at most once.
        store = pool.builder.store
        ids = {i for t in tasks for i in (await pool.node_layers(t, "evaluation")).ids}
        files = {f for i in ids for f in layer_files(store, i)}
        whole = sum((store.root / f).stat().st_size for f in files)
        copied = [s["copied_bytes"] for s in (await pool.stats())["nodes"].values()]
        assert sum(copied) > 0 and max(copied) <= whole, (copied, whole)
    assert not other.layer_ids()


# --------------------------------------------------------------------------- placement


async def test_a_sandbox_goes_where_its_layers_are(pool: SandboxPool, tasks: list[Task]) -> None:
    # A node that holds a task's layers is preferred to one that does not.
    task = tasks[1]
    layers = await pool.node_layers(task)
    holder = next((n for n in pool.nodes if set(layers.ids) <= n.cached), None)
    if holder is None:
        async with pool.sandbox(task) as sb:
            holder = next(n for n in pool.nodes if n.node_id == sb.node_id)
    for other in pool.nodes:  # (earlier tests may have left them on both: the pool forgets)
        if other is not holder:
            other.cached -= set(layers.ids)
    for _ in range(3):
        async with pool.sandbox(task) as sb:
            assert sb.node_id == holder.node_id
            assert sb.facts.misses == 0 and sb.facts.hits == len(set(layers.ids))


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
    # As the nodes count them (all drivers'): full, not over.
    assert [(await pool._info(n)).node_sandboxes for n in pool.nodes] == [CAPACITY] * len(
        pool.nodes
    )
    release.set()
    await asyncio.gather(*episodes)
    assert opened == total + 2
    assert max(most.values()) == CAPACITY


# --------------------------------------------------------------------------- nodes joining


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_a_node_that_joins_later_gets_a_request_waiting_for_a_slot(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    # A pool of one node (its own slots resource), every slot taken: the next request waits.
    # A node that joins meanwhile is taken up by the pool on its own, and the request goes there.
    added = [nodes.add(slots="join_slots")]
    config = PoolConfig(store=settings.store, slots_resource="join_slots", join_every_s=0.5)
    pool = await SandboxPool(config).start()
    try:
        assert [n.node_id for n in pool.nodes] == [added[0].node_id]
        async with contextlib.AsyncExitStack() as full:
            for _ in range(CAPACITY):
                await full.enter_async_context(pool.sandbox(tasks[0]))

            async def one() -> str:
                async with pool.sandbox(tasks[0]) as sb:
                    assert (await sb.execute("echo here")).stdout == "here\n"
                    return sb.node_id

            waiting = asyncio.ensure_future(one())
            await asyncio.sleep(1)
            assert not waiting.done()  # no slot anywhere
            added.append(nodes.add(slots="join_slots"))  # (Ray starts nodes on the main thread)
            assert await asyncio.wait_for(waiting, 120) == added[1].node_id
        assert len(pool.nodes) == 2 and await pool.refresh() == 0  # nothing new since
    finally:
        await pool.close()
        for node in added:
            nodes.cluster.remove_node(node)


# --------------------------------------------------------------------------- faults


@contextlib.asynccontextmanager
async def pool_with_a_node_to_lose(
    settings: BuildSettings, nodes: Nodes
) -> AsyncIterator[tuple[SandboxPool, Any, Any]]:
    """A pool over the test cluster and one more node, to be removed: (pool, Ray's node, the
    pool's view of it)."""
    doomed = nodes.add()
    pool = await SandboxPool(PoolConfig(store=settings.store)).start()
    try:
        yield pool, doomed, next(n for n in pool.nodes if n.node_id == doomed.node_id)
    finally:
        await pool.close()


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_a_lost_node_fails_its_episode_and_the_pool_keeps_serving(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    async with pool_with_a_node_to_lose(settings, nodes) as (pool, doomed, victim):
        victim.others = CAPACITY  # (as if full) the survivor goes to another node
        async with pool.sandbox(tasks[2]) as survivor_sb:
            assert survivor_sb.node_id != victim.node_id
            for n in pool.nodes:  # the others as if full: the next sandbox goes to the victim
                n.others = CAPACITY if n is not victim else 0
            async with pool.sandbox(tasks[0]) as sb:
                assert sb.node_id == victim.node_id
                agent_pid = (await pool._info(victim)).pid
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
        assert all(s["agent_sandboxes"] == 0 for s in stats["nodes"].values())


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_an_episode_retries_elsewhere_when_asked(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    async with pool_with_a_node_to_lose(settings, nodes) as (pool, doomed, victim):
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


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_drivers_share_the_nodes_slots_and_a_cancelled_start_leaves_nothing(
    settings: BuildSettings, nodes: Nodes, tasks: list[Task]
) -> None:
    # Three drivers' pools. `late` starts while the nodes are empty; `early` then fills every
    # slot, so `late`'s start waits on the node itself (slots are node-wide) until cancelled.
    late = await SandboxPool(PoolConfig(store=settings.store)).start()
    early = await SandboxPool(PoolConfig(store=settings.store)).start()
    after = None

    async def on_nodes(pool: SandboxPool, key: str) -> int:
        return sum([getattr(await pool._info(n), key) for n in pool.nodes])

    async def start_in(pool: SandboxPool) -> str:
        async with pool.sandbox(tasks[0]) as sb:
            return sb.node_id

    try:
        async with contextlib.AsyncExitStack() as full:
            for _ in range(CAPACITY * len(early.nodes)):
                await full.enter_async_context(early.sandbox(tasks[0]))
            assert await on_nodes(late, "node_sandboxes") == CAPACITY * len(late.nodes)
            waiting = asyncio.ensure_future(start_in(late))
            deadline = time.monotonic() + 60
            while not await on_nodes(late, "waiting") and time.monotonic() < deadline:
                await asyncio.sleep(0.1)
            assert await on_nodes(late, "waiting") == 1, "the start never waited on its node"
            waiting.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiting
            # `after` starts while every node is full: it waits on the driver's side.
            after = await SandboxPool(PoolConfig(store=settings.store)).start()
            served = asyncio.ensure_future(start_in(after))
            await asyncio.sleep(0.5)
            assert not served.done()
        # The other drivers' sandboxes are gone: `after` notices (it has no release of its own
        # to wake it) and is served; the cancelled start took no slot on its node.
        assert await asyncio.wait_for(served, 60)
        deadline = time.monotonic() + 30
        while await on_nodes(late, "node_sandboxes") and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        assert await on_nodes(late, "node_sandboxes") == 0
        assert sum(s["agent_sandboxes"] for s in (await late.stats())["nodes"].values()) == 0
    finally:
        for pool in (late, early, after):
            if pool is not None:
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
                node = next(n for n in pool.nodes if n.node_id == sb.node_id)
                print("ready", (await pool._info(node)).pid, flush=True)
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
        line = driver.stdout.readline().split()
        assert line[:1] == [b"ready"], line
        agent = int(line[1])
        assert our_processes("8675310") and agent_leftovers(agent)
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=30)
        wait_until(lambda: not our_processes("8675310"), "the dead driver's sandbox runs", 90)
        wait_until(lambda: not agent_leftovers(agent), "the dead driver's sandbox's files", 90)
    finally:
        if driver.poll() is None:
            driver.kill()
            driver.wait()


# --------------------------------------------------------------------------- integrations


@pytest.fixture
def store_env(settings: BuildSettings, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Made by name or config, the integrations find the store in the environment."""
    monkeypatch.setenv("MINISANDBOX_STORE", str(settings.store))
    monkeypatch.setenv("MINISANDBOX_GIT_MIRROR", str(settings.git_mirror))
    yield


def pool_starts(builder: Builder) -> int:
    stats = run_sync(run_sync(shared_pool("auto", builder=builder)).stats())
    return int(stats["hits"] + stats["misses"])


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
async def test_swerex_deployment_on_the_pool(
    nodes: Nodes, store_env: None, tasks: list[Task], tmp_path: Path
) -> None:
    pytest.importorskip("swerex", reason="SWE-ReX is not installed (extra: swerex)")
    from swerex.exceptions import CommandTimeoutError as SwerexTimeout
    from swerex.runtime.abstract import (
        BashAction,
        BashInterruptAction,
        CreateBashSessionRequest,
        ReadFileRequest,
        UploadRequest,
        WriteFileRequest,
    )

    from minisandbox.integrations.swerex import MiniSandboxDeploymentConfig

    task = next(t for t in tasks if t.id == "examples__tablekit-1")
    d = MiniSandboxDeploymentConfig(task=task.id, cluster=nodes.cluster.address).get_deployment()
    await d.start()
    try:
        assert isinstance(d.task_sandbox.sandbox, RemoteSandbox)
        rt = d.runtime
        await rt.create_session(CreateBashSessionRequest(startup_source=["/root/.bashrc"]))
        o = await rt.run_in_session(BashAction(command="cd /testbed && export X=7", timeout=30))
        o = await rt.run_in_session(BashAction(command="echo $PWD $X", timeout=30))
        assert o.output.strip() == "/testbed 7"
        # A timeout leaves the session busy on the node; the interrupt is sent there.
        with pytest.raises(SwerexTimeout):
            await rt.run_in_session(BashAction(command="sleep 30", timeout=0.5))
        assert (await rt.run_in_session(BashInterruptAction())).exit_code == 0
        o = await rt.run_in_session(BashAction(command="echo back", timeout=30))
        assert o.output.strip() == "back"
        # Files, and an upload of a directory of this host.
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "a.txt").write_text("from the driver")
        (tmp_path / "up" / "link").symlink_to("a.txt")  # stays a link, as a local upload keeps it
        await rt.upload(UploadRequest(source_path=str(tmp_path / "up"), target_path="/tmp/up"))
        read = await rt.read_file(ReadFileRequest(path="/tmp/up/a.txt"))
        assert read.content == "from the driver"
        o = await rt.run_in_session(BashAction(command="readlink /tmp/up/link", timeout=30))
        assert o.output.strip() == "a.txt"
        await rt.write_file(WriteFileRequest(path="/tmp/gold.patch", content=task.gold_patch))
        await rt.run_in_session(BashAction(command="git apply /tmp/gold.patch", timeout=30))
        result = await d.evaluate()
        assert result.reward == 1.0, result.reason
    finally:
        await d.stop()


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
def test_skyrl_rollout_and_environment_on_the_pool(
    nodes: Nodes, settings: BuildSettings, store_env: None, tasks: list[Task]
) -> None:
    skyrl_gym = pytest.importorskip("skyrl_gym", reason="skyrl-gym is not installed (extra: skyrl)")
    from minisweagent.models.test_models import DeterministicModel, make_output

    from minisandbox.integrations.skyrl import ENV_ID, run_rollout

    task = next(t for t in tasks if t.id == "examples__datekit-1")
    builder = Builder(settings)
    before = pool_starts(builder)
    apply = f"git apply <<'EOF_PATCH'\n{task.gold_patch}\nEOF_PATCH"
    submit = "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT && git diff"
    model = DeterministicModel(outputs=[make_output("", [{"command": c}]) for c in (apply, submit)])
    config = {
        "agent": {"system_template": "sys", "instance_template": "{{task}}", "step_limit": 5},
        "environment": {"timeout": 60, "cluster": "auto"},
    }
    r = run_rollout({"instance_id": task.id}, model, config, builder=builder)
    assert r.reward == 1.0 and r.error is None, r.error
    assert r.result is not None and r.result.test_results
    # SkyRL's gym environment, made by name, with the same option.
    env = skyrl_gym.make(
        ENV_ID, env_config={"timeout": 60, "cluster": "auto"}, extras={"task": task.id}
    )
    try:
        env.init([{"role": "user", "content": "fix it"}])
        assert isinstance(env.env.task_sandbox.sandbox, RemoteSandbox)
        env.step(f"```bash\n{apply}\n```")
        out = env.step(f"```bash\n{submit}\n```")
        assert out["done"] and out["reward"] == 1.0, out["metadata"]
    finally:
        env.close()
    # Both episodes' sandboxes and evaluations started on the pool's nodes.
    assert pool_starts(builder) >= before + 4


# --------------------------------------------------------------------------- last: loses a node


@pytest.mark.slow  # 5-45 s of Ray node starts and losses: scripts/test --slow
def test_a_rollout_whose_node_is_lost_ends_with_that_error(
    nodes: Nodes, settings: BuildSettings, store_env: None, tasks: list[Task]
) -> None:
    # (Last in the module: it removes one of the cluster's two nodes.)
    pytest.importorskip("minisweagent", reason="mini-swe-agent is not installed (extra: skyrl)")
    from minisweagent.models.test_models import DeterministicModel, make_output

    from minisandbox.integrations.skyrl import run_rollout

    builder = Builder(settings)
    pool = run_sync(shared_pool("auto", builder=builder))

    class LosesTheNode(DeterministicModel):  # type: ignore[misc]
        """Before its second command, the node of the episode's sandbox is removed."""

        def query(self, messages: list[dict[str, str]], **kwargs: Any) -> dict[str, Any]:
            if self.current_index == 0:
                node_id = pool.started[-1]["node_id"]
                node = next(n for n in nodes.cluster.worker_nodes if n.node_id == node_id)
                nodes.cluster.remove_node(node)
            return super().query(messages, **kwargs)  # type: ignore[no-any-return]

    commands = ["echo one", "echo two", "echo three", "echo four"]
    model = LosesTheNode(outputs=[make_output("", [{"command": c}]) for c in commands])
    config = {
        "agent": {"system_template": "sys", "instance_template": "{{task}}", "step_limit": 4},
        "environment": {"timeout": 60, "cluster": "auto"},
    }
    r = run_rollout({"instance_id": tasks[0].id}, model, config, builder=builder)
    # The episode ends at the loss with its error (not three more commands failing in the
    # model's view), and the empty patch is still graded, elsewhere: reward 0.
    assert r.exit_status == "NodeLostError" and "was lost" in (r.error or ""), r.error
    assert model.current_index == 1
    assert r.reward == 0.0 and r.result is not None and r.result.status != "error"
