"""Which NS strategy each weight takes under ``mode="auto"``: its home, every rank (duplicated), or Gram space.

[Note: NS strategy per weight] Three ways run one weight's Newton-Schulz over a weight-shard domain of ``S`` ranks
(full shape ``(P, Q)``, ``m = min(P, Q)``, ``n = max(P, Q)``, bf16 on the wire, ``M = P*Q*2`` bytes, shards
``s = M / S``):

- ``home`` (layer-sharded): the shards travel to one rank, it runs the whole NS, the result travels back. Its home
  pays ``ns_flops / rate`` and receives then sends ``(S-1) * s``; every other rank sends and receives ``s``. Both
  exchanges are fused into the wave's two ``all_to_all`` (their latency counts once per wave, i.e. ``1/S`` of it
  per weight of an ``S``-matrix wave).
- ``duplicated``: every rank all-gathers the matrix (receives ``(S-1) * s``), runs the whole NS, keeps its block:
  ``ns_flops / rate`` on every rank, one fused collective.
- ``gram`` (NOT bitwise; [Note: sharded Gram NS] in ``overlap_muon/_gram_mode.py``): no gather; every rank forms
  its block's ``m x m`` Gram (``2*m*m*n/S`` FLOPs), ``ceil(ns_steps / k)`` fp32 all-reduces of it (a ring: ``2 *
  (S-1)/S * 4*m*m`` bytes each, one latency each, per matrix), the iteration on ``m x m`` fp32 matrices (``8*m**3``
  FLOPs a step) and the polynomial applied to its block at each restart and at the end (``2*m*m*n/S``), all at
  the fp32 rate. Only where the matrix is split along its long side (``_gram_mode.gram_orientations``) and where
  its fp32 Gram is not larger than the bf16 shard it replaces; only where the user allows inexact NS.

A transfer of ``b`` bytes takes ``b / bandwidth``, the bandwidth of the links its peers sit behind: within a node
(``ranks_per_node`` consecutive ranks) or across nodes; a domain that spans nodes is charged the cross-node rate
for the share of its peers on other nodes (the surplus model's link rule, [Note: surplus cost model] in
``surplus_cost.py``). A home or a duplicate holds the whole matrix, its result and the ``m x m`` products:
``2*M + 4*m*m`` bytes; where that exceeds ``home_memory_bytes`` only Gram can run the weight (if allowed; else it
stays ``home``).

The step estimate is the work every rank does (duplicated and Gram weights, the senders' share of each exchange)
plus the homes' load, which balanced homes (the LPT planner's) bring to ``max(the mean load, the largest
matrix's)``. The choice (:func:`pick_strategies`) starts with every weight at its home and visits the weights
largest first, moving each to the other strategy that lowers the estimate most, if one does (ties keep ``home``,
then ``duplicated``). It is a deterministic function of shapes and figures, so every rank
computes the same picks without communicating; the plan hash checks it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .cost import _check_shape, ns_flops
from .surplus_cost import SurplusCostModel

__all__ = ["STRATEGIES", "StrategyCosts", "strategy_costs", "pick_strategies", "step_estimate"]

#: The strategies, in tie-break order.
STRATEGIES = ("home", "duplicated", "gram")


@dataclass(frozen=True, slots=True)
class StrategyCosts:
    """Seconds one weight adds under each strategy: ``home`` on its home rank and ``home_others`` on every other
    rank; ``duplicated`` and ``gram`` on every rank (``None``: the strategy cannot run it)."""

    home: float
    home_others: float
    duplicated: float | None
    gram: float | None


def _link(nbytes: float, S: int, cm: SurplusCostModel) -> float:
    """Seconds to move ``nbytes`` to or from the domain's other ranks (the share on other nodes at the cross-node
    rate)."""
    if S <= 1 or nbytes <= 0:
        return 0.0
    same = min(S, cm.ranks_per_node) - 1
    across = (S - 1 - same) / (S - 1)
    return max(nbytes * (1 - across) / cm.intra_node_bytes_per_s, nbytes * across / cm.inter_node_bytes_per_s)


def _gram_s(m: int, n: int, S: int, cm: SurplusCostModel, restart_every: int) -> float:
    restarts = max(1, math.ceil(cm.ns_steps / max(1, restart_every)))
    flops = restarts * 2 * m * m * n / S + cm.ns_steps * 8 * m ** 3 + restarts * 2 * m * m * n / S
    gram_bytes = 4 * m * m
    reduce = restarts * (cm.latency_s + _link(2 * (S - 1) / S * gram_bytes, S, cm))
    return flops / cm.fp32_flops_per_s + reduce


def strategy_costs(shape: tuple[int, int], S: int, cm: SurplusCostModel, *, restart_every: int = 5,
                   gram_ok: bool = False) -> StrategyCosts:
    """One weight's :class:`StrategyCosts` over a domain of ``S`` ranks ([Note: NS strategy per weight]).

    Args:
        shape: the full ``(P, Q)``.
        S: ranks of the weight-shard domain (>= 1).
        cm: the machine figures (``ns_steps`` among them).
        restart_every: Gram re-formed every this many NS steps.
        gram_ok: the matrix is split along its long side only and inexact NS is allowed.

    Raises:
        ValueError: a bad shape or ``S < 1``.
    """
    p, q = _check_shape(shape)
    if isinstance(S, bool) or not isinstance(S, int) or S < 1:
        raise ValueError(f"S must be an int >= 1, got {S!r} (shape {(p, q)})")
    m, n = min(p, q), max(p, q)
    M = p * q * cm.dtype_bytes
    s = M / S
    ns = ns_flops((p, q), cm.ns_steps) / cm.ns_flops_per_s
    fused_latency = cm.latency_s / S  # the wave's collective, shared by about S weights
    fits = cm.home_memory_bytes is None or 2 * M + 2 * cm.dtype_bytes * m * m <= cm.home_memory_bytes
    home = ns + 2 * (_link((S - 1) * s, S, cm) + fused_latency)
    others = 2 * (_link(s, S, cm) + fused_latency) if S > 1 else 0.0
    dup = ns + _link((S - 1) * s, S, cm) + fused_latency if fits else None
    gram = _gram_s(m, n, S, cm, restart_every) if gram_ok and S > 1 and 4 * m * m <= s else None
    if not fits and gram is None:
        dup = None  # home stays: the layer-sharded baseline
    return StrategyCosts(home, others, dup, gram)


def pick_strategies(shapes: Sequence[tuple[int, int]], S: int, cm: SurplusCostModel, *, restart_every: int = 5,
                    gram_ok: Mapping[int, bool] | None = None) -> list[str]:
    """Per weight, the strategy of :data:`STRATEGIES` that [Note: NS strategy per weight] picks: every weight at
    its home first, then, largest first, each weight moved to the other strategy that lowers the step estimate
    most, if one does.

    Args:
        shapes: each weight's full ``(P, Q)`` (one domain).
        S: the domain's ranks.
        cm: the machine figures.
        restart_every: as :func:`strategy_costs`.
        gram_ok: the weights (by position) Gram may run: split along their long side, inexact NS allowed.

    Returns:
        One of ``"home"``, ``"duplicated"``, ``"gram"`` per weight, in ``shapes`` order.
    """
    ok = gram_ok or {}
    costs = [strategy_costs(tuple(sh), S, cm, restart_every=restart_every, gram_ok=i in ok)
             for i, sh in enumerate(shapes)]
    picks = ["home"] * len(shapes)
    own = [c.home - c.home_others for c in costs]  # a home's load beyond what every rank pays for the weight
    shared = sum(c.home_others for c in costs)
    homes = sorted(range(len(shapes)), key=lambda j: (-own[j], j))
    total = sum(own)

    def estimate(shared: float, total: float, top: float) -> float:
        return shared + max(total / S, top)

    kept = 0.0  # the largest home load of the weights visited that stayed home
    for k, i in enumerate(homes):
        c = costs[i]
        top_after = max(kept, own[homes[k + 1]] if k + 1 < len(homes) else 0.0)
        now = estimate(shared, total, max(own[i], top_after))
        best, best_t = "home", now
        for name, extra in (("duplicated", c.duplicated), ("gram", c.gram)):
            if extra is not None:
                t = estimate(shared - c.home_others + extra, total - own[i], top_after)
                if t < best_t:
                    best, best_t = name, t
        if best != "home":
            picks[i] = best
            shared += getattr(c, best) - c.home_others
            total -= own[i]
        else:
            kept = max(kept, own[i])
    return picks


def step_estimate(shapes: Sequence[tuple[int, int]], S: int, cm: SurplusCostModel, picks: Sequence[str], *,
                  restart_every: int = 5) -> float | None:
    """The step estimate of [Note: NS strategy per weight] for ``picks`` (seconds), ``None`` where a pick cannot
    run its weight (a Gram larger than the shard; a home that does not fit takes the estimate anyway)."""
    shared = total = top = 0.0
    for sh, k in zip(shapes, picks):
        c = strategy_costs(tuple(sh), S, cm, restart_every=restart_every, gram_ok=k == "gram")
        if k == "home":
            shared += c.home_others
            total += c.home - c.home_others
            top = max(top, c.home - c.home_others)
        else:
            extra = getattr(c, k)
            if extra is None:
                return None
            shared += extra
    return shared + max(total / S, top)
