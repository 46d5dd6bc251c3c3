"""Which node a sandbox goes to: one whose cache holds its layers, unless that node is much busier
than another; never a node at its capacity."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field


@dataclass
class NodeView:
    """What a driver knows of a node."""

    node_id: str
    capacity: int
    cached: set[str] = field(default_factory=set)
    """Layers the node's cache holds (as last reported, plus those its sandboxes since used)."""
    arriving: Counter[str] = field(default_factory=Counter)
    """Layers of sandboxes placed there and still starting (being unpacked, maybe): counted as
    held, so that starts of one task at once go where its layers are coming rather than
    unpack them on several nodes."""
    mine: int = 0
    """Sandboxes this driver has open there (or is starting)."""
    others: int = 0
    """Sandboxes other drivers had open there, as last reported."""
    alive: bool = True

    @property
    def used(self) -> int:
        return self.mine + self.others

    @property
    def load(self) -> float:
        return self.used / self.capacity

    def missing_bytes(self, sizes: Mapping[str, int]) -> int:
        return sum(
            size
            for layer, size in sizes.items()
            if layer not in self.cached and not self.arriving[layer]
        )


def choose(
    nodes: Sequence[NodeView],
    sizes: Mapping[str, int],
    *,
    cache_aware: bool = True,
    balance: float = 0.5,
    turn: int = 0,
) -> NodeView | None:
    """The node for a sandbox of the layers in `sizes` (id -> bytes), or None when every live
    node is full. Cache-aware: among the nodes whose load is within `balance` (a fraction of
    capacity) of the least loaded, the one with the fewest bytes to unpack. Otherwise, or on a
    tie, the least loaded; `turn` rotates the order of ties so that equal nodes take turns."""
    free = [n for n in nodes if n.alive and n.used < n.capacity]
    if not free:
        return None
    order = {id(n): (i - turn) % len(nodes) for i, n in enumerate(nodes)}
    if not cache_aware:
        return min(free, key=lambda n: (n.load, order[id(n)]))
    least = min(n.load for n in free)
    near = [n for n in free if n.load <= least + balance]
    return min(near, key=lambda n: (n.missing_bytes(sizes), n.load, order[id(n)]))
