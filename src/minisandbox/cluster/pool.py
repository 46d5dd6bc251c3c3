"""A pool of task sandboxes across the nodes of a Ray cluster.

    pool = SandboxPool()                      # ray.init() first, or it joins/starts one
    await pool.start()
    async with pool.sandbox(task) as sb:      # a RemoteSandbox: the API of a local Sandbox
        await sb.execute("pytest -x")
    result = await pool.evaluate(task, patch)  # an EvalResult, graded on the node
    await pool.close()

The driver resolves a task's layers (building what is missing, into the shared store) and turns
host interpreters into layers (`portable`), so a node needs only the store and bwrap;
a node that does not see the store copies the layers it needs from the driver's, through Ray
(store_source.py). Nodes that join the cluster later are taken up as placement finds them.
It places each sandbox (placement.py): on a node that already holds its layers, unless that node
is much busier than another, never past a node's capacity (its `minisandbox_slots` resource);
when every node is full, the sandbox waits for a slot. The node's agent (node.py) unpacks what is
missing under the node's own I/O budget, starts the sandbox and keeps it; commands, files and
sessions go to it by actor calls.

A node lost mid-episode fails what ran there with NodeLostError (`pool.evaluate` gives an error
result), or with `retries` starts the episode again on another node; the pool keeps serving on
the others. The agents belong to the driver: when it dies, Ray ends them and their sandboxes'
janitors remove the sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from minisandbox.cluster.config import PoolConfig
from minisandbox.cluster.messages import AgentStats, EvalSettings, NodeInfo, StartFacts
from minisandbox.cluster.node import NodeAgent
from minisandbox.cluster.placement import NodeView, choose
from minisandbox.cluster.remote import RemoteSandbox
from minisandbox.cluster.store_source import StoreSource
from minisandbox.envs.layerbuild import LayerBuilder
from minisandbox.envs.portable import interpreter_layer, travels
from minisandbox.errors import MiniSandboxError, NodeLostError, PoolError
from minisandbox.evaluation.evaluator import DEFAULT_TIMEOUT, EvalResult, Evaluator
from minisandbox.evaluation.purposes import Purpose
from minisandbox.runtime import Runtime
from minisandbox.tasks.builder import Builder, BuildSettings, TaskLayers
from minisandbox.tasks.specs import Task
from minisandbox.utils.aio import settle

try:
    import ray
    from ray.exceptions import ActorDiedError, RayActorError, RayError, RayTaskError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
except ImportError as e:  # pragma: no cover - the `ray` extra is in `dev`
    raise ImportError(
        f"minisandbox.cluster needs Ray ({e}): install the `ray` extra (in a checkout of "
        "swe-minisandbox: pip install -e '.[ray]')"
    ) from None

T = TypeVar("T")
_RECOUNT_S = 2.0
_REMEMBERED_STARTS = 10_000
_REMEMBERED = 4096  # layer sets made portable (an RL run meets each task many times)
_AGENT = ray.remote(NodeAgent)  # one actor class for every agent: Ray exports it once


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


def _quiet(task: asyncio.Task[int]) -> None:
    """A background look for joined nodes failed: the next one tries again."""
    if not task.cancelled():
        task.exception()


@dataclass
class _Node(NodeView):
    actor: Any = None
    """The node's agent (a Ray actor handle)."""


class SandboxPool:
    """Sandboxes of tasks across a Ray cluster's sandbox nodes (see the module's docstring)."""

    def __init__(self, config: PoolConfig | None = None, *, builder: Builder | None = None):
        self.config = config or PoolConfig()
        store = self.config.store
        self.builder = builder or Builder(BuildSettings(store=store) if store else None)
        self.nodes: list[_Node] = []
        self._layers: OrderedDict[str, tuple[TaskLayers, dict[str, int]]] = OrderedDict()
        self._sizes: dict[str, int] = {}
        self._changed: asyncio.Condition | None = None
        self._turn = 0
        self._source: Any = None
        self._closed = False
        self._closing: set[asyncio.Future[None]] = set()  # sandboxes opened for cancelled calls
        self._joining: asyncio.Task[int] | None = None
        self._looked_at = 0.0
        self._tried: set[str] = set()  # nodes an agent was started on (or failed to start)
        self._store_id = ""
        self.runtime = Runtime(builder=self.builder, backend=self, build=self.config.build)
        """Every sandbox and grade of a task on this pool: `runtime.sandbox(task, purpose=...)`,
        `runtime.evaluate(task, patch)`."""
        self.started: deque[dict[str, Any]] = deque(maxlen=_REMEMBERED_STARTS)
        """How the sandboxes this pool started did (`sandbox` and `evaluate` alike), the last
        10,000 in order (an RL run starts millions): their StartFacts' fields (`hits`,
        `misses`, `prep_s`, ...) and `node_id`."""

    # ---------------------------------------------------------------- lifecycle

    async def start(self) -> SandboxPool:
        """Start an agent on every live node that has the slots resource.

        Raises:
            PoolError: no node of the cluster has the slots resource.
        """
        if not ray.is_initialized():
            ray.init(address=os.environ.get("RAY_ADDRESS") or None)
        self._changed = asyncio.Condition()
        self._store_id = await asyncio.to_thread(self.builder.store.identity)
        await self.refresh()
        if not self.nodes:
            raise PoolError(
                f"no live Ray node has the {self.config.slots_resource!r} resource: start each "
                f"sandbox node with --resources='{{\"{self.config.slots_resource}\": N}}'"
            )
        return self

    async def refresh(self) -> int:
        """Start agents on the sandbox nodes that joined the cluster since the pool last looked
        (placement does so by itself every `join_every_s`); how many. A node whose agent
        failed to start is not tried again.

        Raises:
            PoolError: the pool is not started.
        """
        if self._changed is None:
            raise PoolError("the pool is not started: await pool.start() first")
        self._looked_at = time.monotonic()
        fresh = []
        for node in await asyncio.to_thread(ray.nodes):
            capacity = int(node.get("Resources", {}).get(self.config.slots_resource, 0))
            if node.get("Alive") and capacity >= 1 and node["NodeID"] not in self._tried:
                self._tried.add(node["NodeID"])
                fresh.append(_Node(node_id=node["NodeID"], capacity=capacity))
        try:
            oks = await asyncio.gather(*map(self._join, fresh))
        except BaseException:  # cancelled (the pool closing): no agent is left behind
            for node in fresh:
                if node.actor is not None:
                    ray.kill(node.actor, no_restart=True)
            raise
        joined = [node for node, ok in zip(fresh, oks, strict=True) if ok]
        self.nodes += joined
        await self._notify()
        return len(joined)

    async def _join(self, node: _Node) -> bool:
        """Start the node's agent and learn what its cache holds; False (no agent) if it fails."""
        node.actor = self._agent(node)
        try:
            info = await self._info(node)
            node.cached, node.others = set(info.cached), info.node_sandboxes
            if not info.shared_store:
                await self._call(node, "set_source", self._store_source())
        except MiniSandboxError:
            ray.kill(node.actor, no_restart=True)
            return False
        return True

    def _agent(self, node: _Node) -> Any:
        """A new agent on `node` (a Ray actor)."""
        return _AGENT.options(
            num_cpus=0,
            max_restarts=0,
            max_task_retries=0,
            max_concurrency=100_000,
            # Ray kills a worker's child processes when it exits, the janitor among them,
            # which would leave the agent's sandboxes' directories behind.
            runtime_env={"env_vars": {"RAY_kill_child_processes_on_worker_exit": "0"}},
            scheduling_strategy=NodeAffinitySchedulingStrategy(node.node_id, soft=False),
        ).remote(
            str(self.config.node_store or self.builder.settings.store),
            self._store_id,
            node.capacity,
        )

    def _look_for_joined(self) -> None:
        """Look for nodes that joined, in the background, when it is time to."""
        every = self.config.join_every_s
        if every is None or self._closed or time.monotonic() - self._looked_at < every:
            return
        if self._joining is None or self._joining.done():
            self._looked_at = time.monotonic()
            self._joining = asyncio.ensure_future(self.refresh())
            self._joining.add_done_callback(_quiet)

    def _store_source(self) -> Any:
        """The actor serving the driver's store to nodes without it (started once)."""
        if self._source is None:
            here = ray.get_runtime_context().get_node_id()
            self._source = (
                ray.remote(StoreSource)
                .options(
                    num_cpus=0,
                    max_restarts=0,
                    max_concurrency=16,
                    scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False),
                )
                .remote(str(self.builder.settings.store))
            )
        return self._source

    async def __aenter__(self) -> SandboxPool:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        """Stop every sandbox of this pool and end its agents; requests waiting for a slot
        fail with PoolError."""
        self._closed = True
        if self._joining is not None:
            self._joining.cancel()
            await asyncio.gather(self._joining, return_exceptions=True)
        await self._notify()
        await settle(self._closing, timeout=30)
        nodes, self.nodes = self.nodes, []
        for node in nodes:
            if node.alive:
                with contextlib.suppress(NodeLostError):
                    await self._call(node, "close_all")
            ray.kill(node.actor, no_restart=True)
        source, self._source = self._source, None
        if source is not None:
            ray.kill(source, no_restart=True)

    # ---------------------------------------------------------------- calls to agents

    async def _call(self, node: _Node, method: str, *args: Any) -> Any:
        """`method` of the node's agent. Its own errors come back as they were raised there.
        Cancelled, the call is cancelled on the node too (a sandbox it was opening is closed).

        Raises:
            NodeLostError: the node (or its agent) is gone.
        """
        ref = getattr(node.actor, method).remote(*args)
        try:
            return await ref
        except asyncio.CancelledError:
            ray.cancel(ref)
            if method == "open":  # it may have opened before the cancel arrived
                closing = asyncio.ensure_future(self._close_if_opened(node, ref))
                self._closing.add(closing)
                closing.add_done_callback(self._closing.discard)
            raise
        except ActorDiedError as e:
            node.alive = False
            await self._notify()
            raise NodeLostError(f"node {node.node_id[:12]} was lost: {e}") from None
        except RayActorError as e:  # unreachable for now: the node may come back
            raise NodeLostError(f"node {node.node_id[:12]} cannot be reached: {e}") from None
        except RayTaskError as e:
            cause = e.cause
            if isinstance(cause, RayError):  # Ray's own, on the node (its store source died)
                raise PoolError(f"node {node.node_id[:12]}: {cause}") from None
            raise (cause if isinstance(cause, Exception) else e) from None

    async def _info(self, node: _Node) -> NodeInfo:
        info: NodeInfo = await self._call(node, "info")
        return info

    async def _close_if_opened(self, node: _Node, ref: Any) -> None:
        with contextlib.suppress(Exception):
            facts: StartFacts = await ref
            await self._call(node, "close", facts.id)

    async def _notify(self) -> None:
        if self._changed is not None:
            async with self._changed:
                self._changed.notify_all()

    # ---------------------------------------------------------------- placement

    async def _portable(self, layers: TaskLayers) -> tuple[TaskLayers, dict[str, int]]:
        """`layers` as any node can start them (host interpreters as layers:
        `portable`) and their sizes; remembered for the last few thousand layer sets."""
        key = layers.model_dump_json()
        if key in self._layers:
            self._layers.move_to_end(key)
            return self._layers[key]
        moved = await portable(self.builder, layers)
        for layer in moved.ids:
            if layer not in self._sizes:
                info = await asyncio.to_thread(self.builder.store.info, layer)
                self._sizes[layer] = info.size
        self._layers[key] = (moved, {i: self._sizes[i] for i in moved.ids})
        while len(self._layers) > _REMEMBERED:
            self._layers.popitem(last=False)
        return self._layers[key]

    async def node_layers(self, task: Task, purpose: Purpose = "agent") -> TaskLayers:
        """What a node starts for a sandbox of `task` for `purpose`: the Runtime's layers,
        made portable (built first when missing and the pool builds)."""
        return (await self._portable(await self.runtime.layers(task, purpose)))[0]

    async def _place(self, sizes: dict[str, int]) -> _Node:
        """A node with a free slot for these layers (waiting for one), its slot taken and the
        layers marked as arriving there (until `_release`). While it waits, it looks again
        every few seconds at what other drivers hold on the nodes.

        Raises:
            PoolError: the pool is closed, or no node is alive.
        """
        if self._changed is None:
            raise PoolError("the pool is not started: await pool.start() first")
        while True:
            self._look_for_joined()
            async with self._changed:
                if self._closed:
                    raise PoolError("the pool is closed")
                if not any(n.alive for n in self.nodes):
                    raise PoolError("no node of the pool is alive")
                self._turn += 1
                node = choose(
                    self.nodes,
                    sizes,
                    cache_aware=self.config.cache_aware,
                    balance=self.config.balance,
                    turn=self._turn,
                )
                if isinstance(node, _Node):
                    node.mine += 1
                    node.arriving.update(sizes)
                    return node
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), _RECOUNT_S)
                    continue
            await self._recount()

    async def _recount(self) -> None:
        """What other drivers hold now on the nodes this driver saw busy with theirs (only its
        own sandboxes tell it otherwise)."""
        for node in self.nodes:
            if node.alive and node.others:
                with contextlib.suppress(MiniSandboxError):
                    info = await self._info(node)
                    node.others = max(0, info.node_sandboxes - node.mine)

    async def _release(self, node: _Node, sizes: dict[str, int]) -> None:
        node.mine -= 1
        node.arriving.subtract(sizes)
        node.arriving = +node.arriving  # drop what is no longer arriving
        await self._notify()

    def _started(self, node: _Node, layers: TaskLayers, facts: StartFacts) -> None:
        self.started.append({**facts.model_dump(), "node_id": node.node_id})
        node.cached.update(layers.ids)
        node.others = max(0, facts.node_sandboxes - node.mine)

    # ---------------------------------------------------------------- the backend

    @contextlib.asynccontextmanager
    async def open(self, layers: TaskLayers, **overrides: Any) -> AsyncIterator[RemoteSandbox]:
        """A sandbox of `layers` on some node (the Runtime's Backend), stopped when the block
        ends; `overrides` are SandboxConfig fields.

        Raises:
            NodeLostError: its node was lost (at the start, or by any later call).
            PoolError: no node is alive, or the pool is closed.
            SandboxStartError: and the node cache's errors.
        """
        layers, sizes = await self._portable(layers)
        node = await self._place(sizes)
        try:
            facts: StartFacts = await self._call(
                node, "open", layers.model_dump(mode="json"), overrides
            )
            self._started(node, layers, facts)

            async def stop() -> None:
                if node.alive:
                    with contextlib.suppress(NodeLostError):
                        await self._call(node, "close", facts.id)

            sb = RemoteSandbox(self._call, node, facts, stop)
            try:
                yield sb
            finally:
                await sb.stop()
        finally:
            await self._release(node, sizes)

    async def grade(
        self,
        layers: TaskLayers,
        task: Task,
        patch: str | None,
        evaluator: Evaluator,
        **overrides: Any,
    ) -> EvalResult:
        """`evaluator`'s procedure on a node, in a fresh sandbox of `layers` (the Runtime's
        Backend): one call, the whole evaluation on the node. A node lost mid-way is tried
        again elsewhere (the pool's `retries`), then gives an error result naming it."""
        left = self.config.retries
        while True:
            try:
                return await self._grade_once(layers, task, patch, evaluator, overrides)
            except NodeLostError as e:
                if left > 0:
                    left -= 1
                    continue
                error: MiniSandboxError = e
            except MiniSandboxError as e:
                error = e
            return evaluator.not_graded(task.id, patch, error)

    async def _grade_once(
        self,
        layers: TaskLayers,
        task: Task,
        patch: str | None,
        evaluator: Evaluator,
        overrides: dict[str, Any],
    ) -> EvalResult:
        layers, sizes = await self._portable(layers)
        node = await self._place(sizes)
        try:
            result, facts = await self._call(
                node,
                "evaluate",
                layers.model_dump(mode="json"),
                task.model_dump(mode="json"),
                patch,
                EvalSettings(timeout=evaluator.timeout, grading=evaluator.grading),
                overrides,
            )
            if facts is not None:
                self._started(node, layers, facts)
            return EvalResult.model_validate(result)
        finally:
            await self._release(node, sizes)

    # ---------------------------------------------------------------- episodes

    @contextlib.asynccontextmanager
    async def sandbox(
        self, task: Task, *, purpose: Purpose = "agent", **kwargs: Any
    ) -> AsyncIterator[RemoteSandbox]:
        """`Runtime.sandbox` on this pool (`self.runtime`): a sandbox of `task` for
        `purpose` on some node; an agent's is refused for a task without a passing validation
        when the policy asks for one.

        Raises:
            NodeLostError: its node was lost (at the start, or by any later call).
            PoolError: no node is alive.
            TaskNotValidatedError, TaskNotBuiltError, TaskBuildError, SandboxStartError: as
                `Runtime.sandbox`.
        """
        async with self.runtime.sandbox(task, purpose=purpose, **kwargs) as sb:
            yield cast(RemoteSandbox, sb)

    async def episode(
        self,
        task: Task,
        run: Callable[[RemoteSandbox], Awaitable[T]],
        *,
        retries: int | None = None,
        **overrides: Any,
    ) -> T:
        """`await run(sb)` in a sandbox of `task`; when its node is lost, again from the start
        in a new sandbox elsewhere, at most `retries` times (default: the pool's).

        Raises:
            NodeLostError: the node was lost more times than `retries` allows.
        """
        left = self.config.retries if retries is None else retries
        while True:
            try:
                async with self.sandbox(task, **overrides) as sb:
                    return await run(sb)
            except NodeLostError:
                if left <= 0:
                    raise
                left -= 1

    async def evaluate(
        self, task: Task, patch: str | None, *, timeout: float = DEFAULT_TIMEOUT, **kwargs: Any
    ) -> EvalResult:
        """`Runtime.evaluate` on this pool: the patch graded on a node in a fresh sandbox of
        the task. A node lost mid-way gives an error result naming it (after `retries` new
        tries)."""
        return await self.runtime.evaluate(task, patch, timeout=timeout, **kwargs)

    # ---------------------------------------------------------------- what happened

    async def stats(self) -> dict[str, Any]:
        """Per live node: its agent's AgentStats fields (hits, misses, unpacks per layer, the
        node's high-water mark of bytes in flight against its budget, its sandboxes open); and
        the overall hit rate."""
        per_node: dict[str, Any] = {}
        for node in self.nodes:
            if not node.alive:
                continue
            with contextlib.suppress(NodeLostError):
                stats: AgentStats = await self._call(node, "stats")
                per_node[node.node_id] = stats.model_dump()
        hits = sum(s["hits"] for s in per_node.values())
        misses = sum(s["misses"] for s in per_node.values())
        return {
            "nodes": per_node,
            "hits": hits,
            "misses": misses,
            "hit_rate": hits / (hits + misses) if hits + misses else None,
        }
