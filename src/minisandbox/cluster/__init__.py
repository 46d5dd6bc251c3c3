"""Sandboxes across the nodes of a Ray cluster (the `ray` extra): `SandboxPool`.

Between evaluation and the integrations: a pool resolves tasks' layers and grades as they do, and
the integrations run on a pool by a config option.
"""

from minisandbox.cluster.placement import NodeView, choose
from minisandbox.cluster.pool import PoolConfig, SandboxPool
from minisandbox.cluster.remote import RemoteSandbox, RemoteSession
from minisandbox.errors import NodeLostError, PoolError

__all__ = [
    "NodeLostError",
    "NodeView",
    "PoolConfig",
    "PoolError",
    "RemoteSandbox",
    "RemoteSession",
    "SandboxPool",
    "choose",
]
