"""Placement as a rule, without a cluster: capacity is never exceeded, a node holding the layers
is preferred unless it is much busier, and equal nodes take turns."""

from __future__ import annotations

from minisandbox.cluster.placement import NodeView, choose

SIZES = {"env": 100, "repo": 10}


def nodes(*loads: int, capacity: int = 4) -> list[NodeView]:
    return [NodeView(node_id=f"n{i}", capacity=capacity, mine=u) for i, u in enumerate(loads)]


def test_a_full_or_dead_node_is_never_chosen() -> None:
    a, b = nodes(4, 1)
    a.cached = {"env", "repo"}
    assert choose([a, b], SIZES) is b
    b.alive = False
    assert choose([a, b], SIZES) is None
    b.alive, b.others = True, 3  # full through another driver's sandboxes
    assert choose([a, b], SIZES) is None


def test_the_node_with_the_layers_wins_within_the_balance() -> None:
    a, b = nodes(1, 0)
    a.cached = {"env"}
    assert choose([a, b], SIZES, balance=0.25) is a  # 1/4 busier: within 0.25
    a.mine = 2
    assert choose([a, b], SIZES, balance=0.25) is b  # 2/4 busier: balance first
    assert choose([a, b], SIZES, balance=0.5) is a
    b.cached = {"env", "repo"}
    a.mine = 0
    assert choose([a, b], SIZES, balance=0.25) is b  # fewer bytes to unpack


def test_without_cache_awareness_the_least_loaded_and_ties_take_turns() -> None:
    a, b, c = nodes(0, 0, 1)
    a.cached = {"env", "repo"}
    picked = {choose([a, b, c], SIZES, cache_aware=False, turn=t).node_id for t in range(4)}
    assert picked == {"n0", "n1"}


def test_layers_arriving_on_a_node_count_as_held_there() -> None:
    """Starts of one task at once go where its layers are already coming, instead of
    unpacking them on every idle node."""
    a, b = nodes(1, 0)
    assert choose([a, b], SIZES) is b  # nothing held anywhere: the least loaded
    a.arriving.update(SIZES)
    assert choose([a, b], SIZES) is a
    a.arriving.subtract(SIZES)
    assert choose([a, b], SIZES) is b
