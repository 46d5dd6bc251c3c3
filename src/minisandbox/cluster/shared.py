"""One pool per process and cluster, for integrations configured by a string (`cluster: auto`)."""

from __future__ import annotations

import asyncio

from minisandbox.cluster.pool import PoolConfig, SandboxPool, ray
from minisandbox.tasks.builder import Builder

_pools: dict[tuple[str, str], SandboxPool] = {}
_lock: asyncio.Lock | None = None


async def shared_pool(address: str = "auto", *, builder: Builder | None = None) -> SandboxPool:
    """This process's pool on the Ray cluster at `address` ("auto": the cluster this process
    is part of, or $RAY_ADDRESS's), over `builder`'s store; started on first use.

    Raises:
        PoolError: no node of the cluster has the slots resource.
        ConnectionError: there is no cluster at `address`.
    """
    global _lock
    if _lock is None:
        _lock = asyncio.Lock()
    builder = builder or Builder()
    key = (address, str(builder.settings.store))
    async with _lock:
        if key not in _pools:
            if not ray.is_initialized():
                ray.init(address=address)
            pool = SandboxPool(PoolConfig(store=builder.settings.store), builder=builder)
            _pools[key] = await pool.start()
        return _pools[key]
