"""The sandboxes of one node: started, driven and stopped where their files are.

A pool runs one `NodeAgent` per node as a Ray actor (pool.py); the class itself knows nothing of
Ray. Everything node-specific comes from the node: its cache directory and I/O budget from the
environment its Ray node was started with ($MINISANDBOX_CACHE, $MINISANDBOX_IO_BUDGET, as for any
process using minisandbox), so unpacks run on the node whose sandboxes need them and are bounded
by that node's own budget, whatever the number of drivers; the store is the path the pool names
(a filesystem every node sees). A node without that path keeps a store of its own in its cache
directory and copies into it, through Ray, the layers its sandboxes need (from the pool's
StoreSource on the driver's node).

The node's sandbox capacity is a node-wide semaphore in its cache directory (layers.budget's, one
unit per sandbox): every agent on the node, of any driver, counts against it, and a dead agent's
sandboxes stop counting. Sandboxes of an agent that dies (its node lost, its driver gone) are
removed by their janitors (sandbox.cleanup), as for any process killed under its sandboxes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import tarfile
import tempfile
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from minisandbox.cluster.messages import (
    AgentStats,
    CreateSession,
    EvalSettings,
    Execute,
    IsRunning,
    NodeInfo,
    ReadFile,
    SandboxRequest,
    SessionBusy,
    SessionClose,
    SessionInterrupt,
    SessionReply,
    SessionRequest,
    SessionRun,
    SessionSend,
    StartFacts,
    Upload,
    WriteFile,
)
from minisandbox.envs.layerbuild import LayerBuilder
from minisandbox.envs.settings import BuildSettings
from minisandbox.errors import PoolError, SandboxFileError, SandboxNotRunningError
from minisandbox.evaluation.evaluator import EvalResult, Evaluator
from minisandbox.layers.budget import LocalIOBudget, NodeSemaphore
from minisandbox.layers.replica import copy_layer
from minisandbox.sandbox.sandbox import Sandbox
from minisandbox.sandbox.session import SessionResult
from minisandbox.tasks.builder import TaskLayers, launch
from minisandbox.tasks.specs import Task
from minisandbox.utils.aio import settle


def _checked(members: list[tarfile.TarInfo], name: str) -> list[tarfile.TarInfo]:
    """The members of an upload, refused unless all are under `name`, each once, none through
    a link of the archive, every hard link to a regular file before it, and none a device;
    set-id bits dropped. (A name given twice would let its second member be written through
    its first, a symlink; a hard link through an archive symlink would reach a host file.)"""
    links: set[str] = set()
    seen: set[str] = set()
    files: set[str] = set()
    for m in members:
        parts = Path(m.name).parts
        if m.name.startswith("/") or ".." in parts or not parts or parts[0] != name:
            raise SandboxFileError(f"upload: {m.name!r} is outside {name!r}")
        normal = str(Path(*parts))
        if normal in seen:
            raise SandboxFileError(f"upload: {m.name!r} appears twice")
        seen.add(normal)
        if any(str(Path(*parts[:i])) in links for i in range(1, len(parts))):
            raise SandboxFileError(f"upload: {m.name!r} goes through a link")
        if m.islnk() and str(Path(m.linkname)) not in files:
            raise SandboxFileError(
                f"upload: the hard link {m.name!r} is not to a file of the upload before it"
            )
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            raise SandboxFileError(f"upload: {m.name!r} is not a file, directory or link")
        if m.issym() or m.islnk():
            links.add(normal)
        elif m.isfile():
            files.add(normal)
        m.mode &= 0o777
    return members


class _Open:
    """A sandbox of this node and what closes it."""

    def __init__(self, sandbox: Sandbox, stack: contextlib.AsyncExitStack) -> None:
        self.sandbox = sandbox
        self.stack = stack


class NodeAgent:
    """One node's sandboxes for one pool. `store`: the layer store's path on this node, and
    `store_id` its identity (LayerStore.identity); `capacity`: how many sandboxes the node holds
    at once (all agents on it together)."""

    def __init__(self, store: str, store_id: str, capacity: int) -> None:
        settings = BuildSettings(store=Path(store))
        # The same store, not one that happens to be at the same path (the default path is the
        # same on every machine): its random name tells.
        id_file = Path(store) / "id"
        self.shared_store = id_file.is_file() and id_file.read_text().strip() == store_id
        if not self.shared_store:  # a copy of what its sandboxes need, fetched via `source`
            settings = BuildSettings(store=settings.cache / "store")
        self.builder = LayerBuilder(settings)  # (the store and node cache: nothing is built here)
        self.source: Any = None
        self._copying: dict[str, asyncio.Lock] = {}
        self.copied_bytes = 0
        self.capacity = max(1, int(capacity))
        self.slots = NodeSemaphore(self.builder.settings.cache / "slots", self.capacity)
        self.opened: dict[str, _Open] = {}
        self.hits = 0
        self.misses = 0

    # ---------------------------------------------------------------- what the pool sees

    def info(self) -> NodeInfo:
        """This node's facts for placement: capacity, sandboxes open (all agents), the layers
        its cache holds, its I/O budget."""
        cache = self.builder.cache
        budget = cache.budget
        return NodeInfo(
            pid=os.getpid(),
            shared_store=self.shared_store,
            cache=str(cache.root),
            capacity=self.capacity,
            node_sandboxes=self.slots.in_flight(),
            waiting=self.slots.waiting(),
            cached=cache.cached(),
            budget_bytes=budget.limit if isinstance(budget, LocalIOBudget) else None,
        )

    def stats(self) -> AgentStats:
        """What this agent did: layer hits and misses at its starts, unpacks per layer (by this
        agent's process), the node's high-water mark of bytes being unpacked."""
        budget = self.builder.cache.budget
        return AgentStats(
            hits=self.hits,
            misses=self.misses,
            unpacks=dict(self.builder.cache.unpacked),
            max_bytes_in_flight=budget.peak() if isinstance(budget, LocalIOBudget) else None,
            budget_bytes=budget.limit if isinstance(budget, LocalIOBudget) else None,
            agent_sandboxes=len(self.opened),
            copied_bytes=self.copied_bytes,
        )

    def set_source(self, source: Any) -> None:
        """Where this node, which does not see the store, copies layers from (a StoreSource
        actor)."""
        self.source = source

    async def _fetch(self, layer_ids: list[str]) -> None:
        """Copy into this node's store the layers it lacks (only without the shared store)."""
        if self.shared_store:
            return
        store = self.builder.store
        for layer_id in dict.fromkeys(layer_ids):
            lock = self._copying.setdefault(layer_id, asyncio.Lock())
            async with lock:  # one copy of a layer at a time; the others wait for it
                if store.exists(layer_id):
                    continue
                if self.source is None:
                    raise PoolError("this node does not see the store and has no source of it")
                files = await self.source.layer_files.remote(layer_id)
                self.copied_bytes += await copy_layer(store, layer_id, files, self._read_source)

    async def _read_source(self, rel: str, offset: int, size: int) -> bytes:
        data: bytes = await self.source.read.remote(rel, offset, size)
        return data

    # ---------------------------------------------------------------- sandboxes

    async def _enter(
        self, stack: contextlib.AsyncExitStack, layers: TaskLayers, overrides: dict[str, Any]
    ) -> tuple[Sandbox, StartFacts]:
        began = time.monotonic()
        await stack.enter_async_context(self.slots.reserve(1))
        await self._fetch(layers.ids)
        wanted = dict.fromkeys(layers.ids)
        present = sum(1 for i in wanted if self.builder.cache.present(i))
        missing = len(wanted) - present
        self.hits += present
        self.misses += missing
        sb = await stack.enter_async_context(launch(self.builder, layers, **overrides))
        facts = StartFacts(
            id=sb.id,
            hits=present,
            misses=missing,
            prep_s=time.monotonic() - began,
            node_sandboxes=self.slots.in_flight(),
        )
        return sb, facts

    async def open(self, layers: dict[str, Any], overrides: dict[str, Any]) -> StartFacts:
        """Start a sandbox of `layers` (TaskLayers' fields); its id and how it started.

        Raises:
            SandboxStartError: and what `launch` raises.
        """
        stack = contextlib.AsyncExitStack()
        try:
            sb, facts = await self._enter(stack, TaskLayers.model_validate(layers), overrides)
        except BaseException:
            await stack.aclose()
            raise
        self.opened[sb.id] = _Open(sb, stack)
        return facts

    async def close(self, sandbox_id: str) -> None:
        """Stop a sandbox (nothing if it is gone)."""
        entry = self.opened.pop(sandbox_id, None)
        if entry is not None:
            await entry.stack.aclose()

    async def close_all(self) -> None:
        await settle([self.close(sid) for sid in list(self.opened)])

    def _sandbox(self, sandbox_id: str) -> Sandbox:
        entry = self.opened.get(sandbox_id)
        if entry is None:
            raise SandboxNotRunningError(f"sandbox {sandbox_id} is not open on this node")
        return entry.sandbox

    async def evaluate(
        self,
        layers: dict[str, Any],
        task: dict[str, Any],
        patch: str | None,
        settings: EvalSettings,
        overrides: dict[str, Any],
    ) -> tuple[EvalResult, StartFacts | None]:
        """Grade `patch` for `task` (as graded) in a fresh sandbox of `layers`, as
        `Evaluator.evaluate_in` does on any host: the result (an error one when the sandbox
        could not be started) and how the sandbox started (None then)."""
        the_layers = TaskLayers.model_validate(layers)
        started: list[StartFacts] = []

        @contextlib.asynccontextmanager
        async def sandbox() -> AsyncIterator[Sandbox]:
            async with contextlib.AsyncExitStack() as stack:
                sb, facts = await self._enter(stack, the_layers, overrides)
                started.append(facts)
                yield sb

        evaluator = Evaluator(timeout=settings.timeout, grading=settings.grading)
        result = await evaluator.evaluate_in(sandbox, Task.model_validate(task), patch)
        return result, (started[0] if started else None)

    # ---------------------------------------------------------------- one sandbox's API

    async def call(self, sandbox_id: str, request: SandboxRequest) -> Any:
        """Run one `SandboxAPI` call (a RemoteSandbox's request) on the local sandbox.

        Raises:
            SandboxNotRunningError: the sandbox is not open on this node; and what the local
                call raises.
        """
        if isinstance(request, IsRunning):
            entry = self.opened.get(sandbox_id)
            return entry is not None and entry.sandbox.running
        sb = self._sandbox(sandbox_id)
        match request:
            case Execute():
                fields = request.model_dump(exclude={"command"})
                return await sb.execute(request.command, **fields)
            case ReadFile(path=path, max_bytes=max_bytes):
                return await sb.read_file(path, max_bytes=max_bytes)
            case WriteFile(path=path, data=data, mode=mode):
                return await sb.write_file(path, data, mode=mode)
            case Upload():
                return await self._upload(sb, request)
            case CreateSession():
                await sb.create_session(**request.model_dump())
                return None
            case SessionBusy(name=name):
                return sb.session(name).busy
            case SessionRun() | SessionSend() | SessionInterrupt() | SessionClose():
                return await self._session_call(sb, request)
        raise TypeError(f"not a sandbox request: {request!r}")

    async def _session_call(self, sb: Sandbox, request: SessionRequest) -> SessionReply:
        session = sb.session(request.name)
        result: SessionResult | None
        match request:
            case SessionRun(command=command, timeout=timeout, expect=expect, input=text):
                result = await session.run(command, timeout=timeout, expect=expect, input=text)
            case SessionSend(text=text, timeout=timeout, expect=expect):
                result = await session.send(text, timeout=timeout, expect=expect)
            case SessionInterrupt(timeout=timeout):
                result = await session.interrupt(timeout)
            case SessionClose():
                await session.close()
                result = None
        return SessionReply(result=result, busy=session.busy)

    async def _upload(self, sb: Sandbox, request: Upload) -> None:
        """`Sandbox.upload` of what the driver sent as a tar: the file, link or directory
        `name` (a directory: its contents).

        Raises:
            SandboxFileError: the tar is not one the driver makes (see `_checked`); and what
                `Sandbox.upload` raises.
        """
        name = request.name
        if not name or name in (".", "..") or "/" in name or "\0" in name:
            raise SandboxFileError(f"upload: {name!r} is not a file name")
        with tempfile.TemporaryDirectory(prefix="msb-upload-") as tmp:
            with tarfile.open(fileobj=io.BytesIO(request.data)) as tar:
                members = _checked(tar.getmembers(), name)
                # Checked above; Pythons with extraction filters want to be told so.
                trusted: dict[str, Any] = (
                    {"filter": "fully_trusted"} if hasattr(tarfile, "data_filter") else {}
                )
                await asyncio.to_thread(tar.extractall, tmp, members, numeric_owner=True, **trusted)
            await sb.upload(Path(tmp) / name, request.target)
