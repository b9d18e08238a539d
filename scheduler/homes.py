"""Assign each Muon matrix an NS home rank: LPT (greedy, cost-aware) or round robin.

Every function here is a pure, deterministic function of its arguments (ties broken by index, then by rank),
so every rank computes the same homes with no communication.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

__all__ = ["lpt_homes", "round_robin_homes", "LoadReport", "load_report"]


def _check_num_ranks(num_ranks: int) -> None:
    if not isinstance(num_ranks, int) or isinstance(num_ranks, bool) or num_ranks < 1:
        raise ValueError(f"num_ranks must be a positive int, got {num_ranks!r}")


def _check_costs(costs: Sequence[float]) -> list[float]:
    out = []
    for i, c in enumerate(costs):
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 0:
            raise ValueError(f"cost of param {i} is {c!r}; expected a finite number >= 0")
        out.append(c)
    return out


def lpt_homes(
    costs: Sequence[float],
    num_ranks: int,
    initial_loads: Sequence[float] | None = None,
    node_size: int | None = None,
) -> list[int]:
    """Longest Processing Time first: heaviest matrix to the least loaded rank.

    Items are taken in order of ``(-cost, index)``; each goes to the rank with the smallest
    ``(load, rank)``, whose load then grows by the item's cost. Graham's bound: the max load is at most
    ``4/3 - 1/(3*num_ranks)`` times the optimum (Graham, "Bounds on multiprocessing timing anomalies", 1969).

    [Note: homes that know nodes] With ``node_size`` (ranks ``[n*L, (n+1)*L)`` form node ``n``), ties of load are
    broken by the load of the rank's node, then by the load of its local index ``rank % L`` over all nodes, then
    by rank: ``(load, node load, local-index load, rank)``. The per-rank loads, and so every home's NS time, are
    those of plain LPT (only ties move); what moves is where equal-load homes sit. Ties are the rule when a wave
    has fewer matrices than ranks (every wave at a thousand ranks): plain LPT fills ranks ``0, 1, 2, ...``, so a
    node-aware exchange (``layer_sharded_a2a/_nodes.py``) funnels every node's traffic through the first local
    indices; the node-aware order places homes on a diagonal ``(node n, local n mod L)``, one per node and per
    local index before any repeats. Where no loads tie (waves with more matrices than ranks) the homes are plain
    LPT's.

    Args:
        costs: per-item cost (any unit, e.g. FLOPs from :func:`scheduler.cost.ns_flops`), each finite, >= 0.
        num_ranks: number of home ranks, >= 1.
        initial_loads: per-rank load carried in (same unit as ``costs``), length ``num_ranks``; zeros if None.
        node_size: ranks per node (the last node may be short); ``None``: ties go to the lowest rank.

    Returns:
        ``homes[i]`` in ``[0, num_ranks)`` for every item ``i``.

    Raises:
        ValueError: a cost or initial load is negative or not finite, ``num_ranks < 1``, ``initial_loads``
            has the wrong length, or ``node_size`` is not a positive int.
    """
    _check_num_ranks(num_ranks)
    costs = _check_costs(costs)
    if initial_loads is None:
        loads = [0.0] * num_ranks
    else:
        if len(initial_loads) != num_ranks:
            raise ValueError(f"initial_loads has {len(initial_loads)} entries, expected num_ranks={num_ranks}")
        loads = [float(x) for x in initial_loads]
        for r, x in enumerate(loads):
            if not math.isfinite(x) or x < 0:
                raise ValueError(f"initial load of rank {r} is {x!r}; expected a finite number >= 0")
    if node_size is not None:
        _check_num_ranks(node_size)
    L = node_size or num_ranks
    by_node, by_local = [0.0] * -(-num_ranks // L), [0.0] * L
    for j, x in enumerate(loads):
        by_node[j // L] += x
        by_local[j % L] += x
    homes = [0] * len(costs)
    # A linear scan for the least-loaded rank: O(items * ranks), fine for thousands x thousands, and the
    # tie-break is explicit. Without node_size the node and local terms are the same for every rank.
    for i in sorted(range(len(costs)), key=lambda k: (-costs[k], k)):
        r = min(range(num_ranks), key=lambda j: (loads[j], by_node[j // L], by_local[j % L], j)
                if node_size else (loads[j], j))
        homes[i] = r
        loads[r] += costs[i]
        by_node[r // L] += costs[i]
        by_local[r % L] += costs[i]
    return homes


def round_robin_homes(num_items: int, num_ranks: int, start: int = 0) -> list[int]:
    """Homes ``(start + i) % num_ranks`` for items ``i = 0 .. num_items-1`` (cost-blind baseline).

    Raises:
        ValueError: ``num_items < 0`` or ``num_ranks < 1``.
    """
    _check_num_ranks(num_ranks)
    if not isinstance(num_items, int) or num_items < 0:
        raise ValueError(f"num_items must be an int >= 0, got {num_items!r}")
    return [(start + i) % num_ranks for i in range(num_items)]


@dataclass(frozen=True, slots=True)
class LoadReport:
    """Per-rank NS load of an assignment (the unit of the costs it was built from)."""

    per_rank: tuple[float, ...]
    """Summed cost homed on each rank, indexed by rank."""
    max: float
    """Largest per-rank load: the NS time of the assignment, since ranks work in parallel."""
    mean: float
    """Mean per-rank load: the best any assignment could do."""
    max_over_mean: float
    """``max / mean`` (>= 1; 1 is perfect balance; 1.0 when every load is 0)."""


def load_report(costs: Sequence[float], homes: Sequence[int], num_ranks: int) -> LoadReport:
    """Summarize the per-rank load of ``homes``.

    Raises:
        ValueError: lengths differ, a home is outside ``[0, num_ranks)``, or a cost is invalid.
    """
    _check_num_ranks(num_ranks)
    costs = _check_costs(costs)
    if len(homes) != len(costs):
        raise ValueError(f"{len(homes)} homes for {len(costs)} costs")
    loads = [0.0] * num_ranks
    for i, (c, h) in enumerate(zip(costs, homes)):
        if not isinstance(h, int) or not 0 <= h < num_ranks:
            raise ValueError(f"home of param {i} is {h!r}; expected an int in [0, {num_ranks})")
        loads[h] += c
    mx = max(loads)
    mean = sum(loads) / num_ranks
    return LoadReport(
        per_rank=tuple(loads),
        max=mx,
        mean=mean,
        max_over_mean=mx / mean if mean > 0 else 1.0,
    )
