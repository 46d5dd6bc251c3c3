"""How a pool finds its nodes and places sandboxes."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

SLOTS_RESOURCE = "minisandbox_slots"


class PoolConfig(BaseModel):
    """How a pool finds its nodes and places sandboxes."""

    model_config = ConfigDict(extra="forbid")

    store: Path | None = None
    """The layer store, at a path every node sees (default: $MINISANDBOX_STORE or the
    builder's default)."""
    node_store: Path | None = None
    """Where the nodes see the store, when not at the driver's path. A node without it copies
    the layers it needs from the driver's store, through Ray."""
    slots_resource: str = SLOTS_RESOURCE
    """The custom resource that marks a sandbox node; its amount is the node's capacity."""
    cache_aware: bool = True
    """Prefer nodes whose cache holds a task's layers (else: the least loaded)."""
    balance: float = Field(0.5, ge=0)
    """How much busier (a fraction of capacity) a node holding the layers may be than the
    least loaded one and still be preferred. Half: a node's slots are what it runs well at
    once, while an unpack costs seconds of its disk and CPU (an episode's worth or more)."""
    retries: int = Field(0, ge=0)
    """Default times an episode starts again on another node after its node was lost."""
    build: bool = True
    """Build a task's missing layers on the driver before placing it (else: TaskNotBuiltError)."""
    join_every_s: float | None = Field(10.0, gt=0)
    """How often (seconds) placement looks for sandbox nodes that joined the cluster since, and
    starts agents on them (None: only the nodes there at `start`, and at `refresh`)."""
