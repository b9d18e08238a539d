"""Surplus slots: what the NS homes that a wave leaves without a matrix can do (pure planning).

A wave of ``W`` matrices on a domain of ``S`` homes leaves ``S - W`` homes idle when ``W < S`` -- always the case
for the tapered last waves, whose exchange + NS + exchange is the optimizer time that cannot hide ([Note: the
critical path] in docs/design.md). :func:`plan_surplus` gives those ranks work under one of four policies:

``idle``
    Today's plan: one home per matrix (the wave's LPT home), the surplus ranks do nothing.
``duplicate``
    A matrix gets ``k`` homes, each of which receives the whole matrix and runs the same NS (so each produces the
    same bits), and each shard owner takes its result from the nearest of them (same node first). NS time is
    unchanged; the way back fans out from ``k`` ranks instead of one, and duplicates on other nodes turn the
    inter-node part of the return into intra-node traffic.
``team``
    ``k`` ranks split one matrix's NS by columns of the long dim (``overlap_muon._team_ns``, [Note: team NS by
    columns]): each holds a column block of ``X`` (after the tall transpose) and per NS step all-reduces its
    partial Gram ``A`` (``m x m``); ``A @ A`` is computed whole by every member. The two large products are
    ``1/k``; the all-reduces cost bandwidth and ``ns_steps + 1`` latencies (with the norm's).
``auto``
    Plans ``idle``, ``duplicate`` and ``team`` and keeps the one with the smallest estimated wave time (ties go to
    the simpler policy, in that order).

[Note: surplus cost model] The estimates the planner weighs (per matrix ``to + NS + back``, per rank the sum of
its matrices' estimates, the wave the largest rank load) are the cost model's, in ``scheduler/surplus_cost.py``.

What the planner does: the idle plan first; then, while surplus ranks are left, the longest matrix on the most
loaded rank (ties: lowest rank, then lowest param index) gets the fewest extra ranks ``j >= 1`` that shorten its
estimate (a team's fixed all-reduce latencies can make 2 members slower than 1 but 4 faster); if none do, planning
stops (nothing else can shorten the wave). Matrices of equal cost thus share the surplus ranks in turn. Extra ranks are
taken in a fixed preference order: for a team, same node as the home first; for duplicates, nodes without a home
of the matrix first; then by rank. Everything is deterministic, so every rank computes the same plan.

[Note: runtime wiring] What the runtime runs today (``OVERLAP_MUON_SURPLUS``): at planning,
:func:`every_rank_kinds` picks the waves whose plan gives every matrix every rank of its domain, and the kind
(``auto``: per wave, the cheaper of the two by the cost model). ``duplicate`` runs those as gathers (every
rank receives every matrix of the wave, ``all_gather``, runs each NS and keeps its own block: no exchange back);
``team`` re-lays each matrix into column blocks of the long dim over the whole domain (``to_team``), splits each NS
by columns (``overlap_muon._team_ns.team_zeropower_blocks`` on a group of the compute lane) and re-lays the results
into the shards (``from_team``): no home and no gather. With fused exchanges, ``duplicate`` (and ``auto``) plans
that give a matrix ``k`` of ``S`` ranks run too (:func:`duplicate_homes`: the exchange to the homes lists the matrix
once per home, each home runs its NS, and the exchange back sends each rank its block from its serving home only,
``from_homes(..., serve=...)``, so a home receives nothing back). Teams of part of the domain are not run; the steps
below say how the wave pipeline is meant to act on a plan in general:

1. Per wave, on every rank: ``plan = plan_surplus(wave.params, wave.homes, full_shapes, S, config.surplus,
   cost_model, busy_s=...)`` (``busy_s``: e.g. the previous wave's per-home NS seconds from
   :func:`scheduler.cost.ns_flops`; the plan is a pure function, so all ranks agree without communicating, and it
   can be computed once per step at construction, since shapes and wave order are fixed).
2. ``kind == "single"``: today's path.
3. ``kind == "duplicate"``: the to-home exchange sends each rank's shard to every rank of ``a.ranks``; each runs
   ``overlap_muon._ns.zeropower`` on the same bits and so gets the same bits (bitwise parity holds); on the way
   back rank ``r`` takes its block from ``serving_homes(a, S, ranks_per_node)[r]`` only.
4. ``kind == "team"``: member ``j = a.ranks[j]`` receives column block ``j`` (:func:`team_row_counts` of
   ``max(P, Q)`` over ``len(a.ranks)``) of the ORIENTED matrix (the transpose of a tall update), calls
   ``overlap_muon._team_ns.team_zeropower_blocks([block], [norm], team_group)`` and sends the parts of its result
   block back to their shard owners (what ``to_team`` / ``from_team`` do for a team of the whole domain).
   ``team_group`` must exist on every member: ``dist.new_group`` is collective over the whole world, so create one
   per distinct team at construction (the plans are known then). Not bitwise in general (see
   ``overlap_muon/_team_ns.py``), which the parity tests must say.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from .._layout import team_row_counts
from . import surplus_cost as _surplus_cost
from .cost import _check_shape
from .homes import _check_num_ranks
from .surplus_cost import (
    CPU_GLOO,
    SurplusCostModel,
    _dup_served,
    _estimate,
    _Nodes,
    team_splits_poly,
)

__all__ = ["POLICIES", "CPU_GLOO", "duplicate_homes", "SurplusCostModel", "SurplusAssignment", "SurplusPlan", "plan_surplus",
           "team_row_counts", "serving_homes", "every_rank_kinds", "team_splits_poly"]

#: The surplus policies, in the order ``auto`` prefers them on a tie.
POLICIES: tuple[str, ...] = ("idle", "duplicate", "team", "auto")

#: An estimate must improve by more than this (relative) to take more ranks: no churn on float noise.
_REL_EPS = 1e-12

#: Re-exported: ``overlap_muon.apps.simulate`` imports this cost-model helper from here.
_estimate_parts = _surplus_cost._estimate_parts


@dataclass(frozen=True, slots=True)
class SurplusAssignment:
    """Where one matrix's NS runs."""

    kind: str
    """``"single"`` (one home), ``"duplicate"`` (every rank runs the whole NS) or ``"team"`` (split by columns)."""
    ranks: tuple[int, ...]
    """Domain ranks, the wave's home first (a relocated team: its first member instead); for a team, in row-block
    order (member ``j`` holds column block ``j`` of the long dim, :func:`team_row_counts` sizes)."""
    estimate_s: float
    """The cost model's to-home + NS + back for this matrix, seconds."""


@dataclass(frozen=True, slots=True)
class SurplusPlan:
    """:func:`plan_surplus`'s answer for one wave."""

    policy: str
    """The policy the plan follows (``auto`` resolved to ``idle``, ``duplicate`` or ``team``)."""
    assignments: Mapping[int, SurplusAssignment]
    """Param index -> its assignment; keys are exactly the wave's params."""
    rank_load_s: tuple[float, ...]
    """Per domain rank, its ``busy_s`` plus the summed estimates of the matrices it holds, seconds."""
    wave_s: float
    """``max(rank_load_s)``: the estimated time of the wave, seconds."""
    surplus_ranks: tuple[int, ...]
    """Ranks the wave's homes left free (before this plan used any)."""


def serving_homes(assignment: SurplusAssignment, num_ranks: int, ranks_per_node: int = 8) -> list[int]:
    """Per domain rank, the rank of ``assignment.ranks`` it receives its block of the NS result from.

    ``single``: the one home for everyone. ``duplicate``: a home serves itself and the ranks of its node, the rest
    go round robin over the homes in ``assignment.ranks`` order (as the cost model assumes). ``team``: ``-1`` for
    every rank -- each member sends the rows it computed, so a rank receives from every member.

    Raises:
        ValueError: ``num_ranks`` or ``ranks_per_node`` < 1, or a rank of the assignment is out of range.
    """
    _check_num_ranks(num_ranks)
    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"ranks_per_node must be an int >= 1, got {ranks_per_node!r}")
    if any(not 0 <= r < num_ranks for r in assignment.ranks):
        raise ValueError(f"assignment ranks {assignment.ranks} outside [0, {num_ranks})")
    if assignment.kind == "team":
        return [-1] * num_ranks
    if assignment.kind == "single":
        return [assignment.ranks[0]] * num_ranks
    out = [0] * num_ranks
    for h, served in zip(assignment.ranks, _dup_served(assignment.ranks, _Nodes(num_ranks, ranks_per_node))):
        out[h] = h
        for r in served:
            out[r] = h
    return out


def _greedy(kind: str, params: Sequence[int], homes: Mapping[int, int], shapes: Mapping[int, tuple[int, int]],
            surplus: list[int], nodes: _Nodes, cm: SurplusCostModel,
            busy: Sequence[float]) -> tuple[dict[int, list[int]], dict[int, float]]:
    ranks = {i: [homes[i]] for i in params}
    est = {i: _estimate(shapes[i], "single", ranks[i], nodes, cm) for i in params}
    load = list(busy)
    for i in params:
        load[homes[i]] += est[i]
    holders: dict[int, list[int]] = {}
    for i in params:
        holders.setdefault(homes[i], []).append(i)
    avail = list(surplus)
    cap = cm.max_team or nodes.S
    while avail:
        r = max(range(nodes.S), key=lambda x: (load[x], -x))
        cands = sorted(holders.get(r, []), key=lambda i: (-est[i], i))
        if not cands:
            break
        i = cands[0]
        base = list(ranks[i])
        k0 = len(base)
        release: list[int] = []
        # Only ranks free no later than the matrix's own ranks: a helper still busy would delay it.
        ready = max(busy[x] for x in base)
        eligible = [x for x in avail if busy[x] <= ready]
        if kind == "team" and all(holders[x] == [i] for x in base):
            # [Note: team relocation] A team is cheap only inside a node (it all-reduces ns_steps * m*m elements).
            # A matrix whose ranks hold nothing else may move, whole, to the node where it would have
            # the most ranks (free ones plus its own there; ties keep its node, then the lowest node); its old
            # ranks join the free ones.
            room: dict[int, int] = {}
            for x in eligible + base:
                room[nodes.node(x)] = room.get(nodes.node(x), 0) + 1
            here = nodes.node(base[0])
            node = max(sorted(room), key=lambda n: (room[n], n == here))
            if node != here:
                release, base = base, [min(x for x in eligible if nodes.node(x) == node)]
                k0 = 1
        home_node = nodes.node(base[0])
        pool = [x for x in eligible if x not in base] + release
        if kind == "team":
            pref = sorted(pool, key=lambda x: (nodes.node(x) != home_node, x))
        else:
            covered = {nodes.node(x) for x in ranks[i]}
            first_on: dict[int, int] = {}
            for x in sorted(pool):
                first_on.setdefault(nodes.node(x), x)
            fresh = sorted(x for x in first_on.values() if nodes.node(x) not in covered)
            pref = fresh + sorted(x for x in pool if x not in fresh)
        # The fewest extra ranks that shorten this matrix (a team's latencies can make 2 slower than 1 but 4 faster).
        best_j, best_t = 0, est[i]
        for j in range(1, min(len(pref), cap - k0) + 1):
            t = _estimate(shapes[i], kind, base + pref[:j], nodes, cm)
            if t < est[i] * (1 - _REL_EPS):
                best_j, best_t = j, t
                break
        if best_j == 0:
            break  # the critical matrix cannot get shorter: neither can the wave
        for x in ranks[i]:
            load[x] -= est[i]
            holders[x].remove(i)
        ranks[i] = base + pref[:best_j]
        est[i] = best_t
        for x in ranks[i]:
            load[x] += est[i]
            holders.setdefault(x, []).append(i)
        taken = set(ranks[i])
        avail = sorted(x for x in set(avail) | set(release) if x not in taken)
    return ranks, est


def plan_surplus(
    params: Sequence[int],
    homes: Mapping[int, int],
    shapes: Mapping[int, tuple[int, int]] | Sequence[tuple[int, int]],
    num_ranks: int,
    policy: str = "idle",
    cost_model: SurplusCostModel | None = None,
    busy_s: Sequence[float] | None = None,
) -> SurplusPlan:
    """Give the wave's surplus ranks work: duplicate homes or NS teams; see the module docstring.

    Args:
        params: the wave's param indices (``scheduler.Wave.params``).
        homes: param index -> its home rank (``scheduler.Wave.homes``), in ``[0, num_ranks)``.
        shapes: param index -> full logical ``(P, Q)`` (a mapping, or a sequence indexed by param index).
        num_ranks: the domain size ``S``.
        policy: ``"idle"``, ``"duplicate"``, ``"team"`` or ``"auto"``.
        cost_model: machine figures (default :class:`SurplusCostModel`).
        busy_s: per rank, seconds of NS work still queued when this wave's NS starts (e.g. the previous wave's);
            a surplus rank is used only for a matrix whose ranks are busy at least as long, and the loads include
            it. ``None``: all free.

    Returns:
        A :class:`SurplusPlan`: per param its kind and ranks (home first), per-rank loads and the wave estimate
        (seconds). Only surplus ranks are added; a team may leave its wave home (see [Note: team relocation]),
        which then counts as free; a home holding several matrices keeps them all.

    Raises:
        ValueError: unknown policy, ``num_ranks < 1``, a home out of range, ``homes`` keys not the params,
            duplicate params, or a bad shape.
    """
    if policy not in POLICIES:
        raise ValueError(f"surplus policy must be one of {POLICIES}, got {policy!r}")
    _check_num_ranks(num_ranks)
    cm = cost_model or SurplusCostModel()
    params = list(params)
    if len(set(params)) != len(params) or set(homes) != set(params):
        raise ValueError(f"params {params[:16]} must be distinct and match the homes' keys {sorted(homes)[:16]}")
    for i in params:
        h = homes[i]
        if isinstance(h, bool) or not isinstance(h, int) or not 0 <= h < num_ranks:
            raise ValueError(f"home of param {i} is {h!r}; expected an int in [0, {num_ranks})")
    shp = {i: _check_shape(tuple(shapes[i])) for i in params}
    if busy_s is None:
        busy = [0.0] * num_ranks
    else:
        busy = [float(x) for x in busy_s]
        if len(busy) != num_ranks or any(not math.isfinite(x) or x < 0 for x in busy):
            raise ValueError(f"busy_s must hold {num_ranks} finite times >= 0 (seconds), got {list(busy_s)[:16]}")
    nodes = _Nodes(num_ranks, cm.ranks_per_node)
    used = {homes[i] for i in params}
    surplus = [r for r in range(num_ranks) if r not in used]

    def build(kind: str) -> SurplusPlan:
        if kind == "idle" or not surplus or not params:
            ranks = {i: [homes[i]] for i in params}
            est = {i: _estimate(shp[i], "single", ranks[i], nodes, cm) for i in params}
        else:
            ranks, est = _greedy(kind, params, homes, shp, surplus, nodes, cm, busy)
        load = list(busy)
        out = {}
        for i in params:
            k = "single" if len(ranks[i]) == 1 else kind
            out[i] = SurplusAssignment(kind=k, ranks=tuple(ranks[i]), estimate_s=est[i])
            for r in ranks[i]:
                load[r] += est[i]
        return SurplusPlan(policy=kind, assignments=out, rank_load_s=tuple(load), wave_s=max(load, default=0.0),
                           surplus_ranks=tuple(surplus))

    if policy != "auto":
        return build(policy)
    best = build("idle")
    for kind in ("duplicate", "team"):
        cand = build(kind)
        if cand.wave_s < best.wave_s * (1 - 1e-9):  # a tie keeps the simpler policy
            best = cand
    return best


def every_rank_kinds(
    waves: Sequence, shapes: Sequence[tuple[int, int]], domain_sizes: Sequence[int], policy: str = "duplicate",
    cost_model: SurplusCostModel | None = None,
) -> dict[int, str]:
    """The waves whose ``policy`` plan gives every matrix of the wave every rank of its domain, all of one kind,
    with that kind: ``{wave index: "duplicate" | "team"}``. The runtime's ``surplus=`` option runs exactly those
    (``duplicate``: every rank gathers the wave's matrices and runs each whole NS; ``team``: the domain splits each
    NS by columns, ``overlap_muon._team_ns``; then each keeps its own block). ``policy="auto"`` keeps the kind the
    cost model prefers for each wave ([Note: surplus cost model]). A wave that fills its domain has no surplus and
    stays single-homed; plans that give a matrix ``k`` of ``S`` ranks are left to :func:`duplicate_homes`
    ([Note: runtime wiring]).

    Args:
        waves: ``scheduler.Wave`` s (``params``, ``homes``, ``domain``).
        shapes: full ``(P, Q)`` per param index.
        domain_sizes: ranks per domain, indexed by ``Wave.domain`` (a size below 2 leaves that domain's waves out).
        policy: ``"duplicate"``, ``"team"`` or ``"auto"``.
        cost_model: as :func:`plan_surplus`.
    """
    out: dict[int, str] = {}
    for w in waves:
        size = domain_sizes[w.domain]
        if size < 2 or len(w.params) >= size:
            continue
        plan = plan_surplus(w.params, w.homes, {i: shapes[i] for i in w.params}, size, policy, cost_model)
        kinds = {a.kind for a in plan.assignments.values()}
        if len(kinds) == 1 and kinds <= {"duplicate", "team"} and all(
                len(a.ranks) == size for a in plan.assignments.values()):
            out[w.index] = kinds.pop()
    return out


def duplicate_homes(
    waves: Sequence, shapes: Sequence[tuple[int, int]], domain_sizes: Sequence[int],
    cost_model: SurplusCostModel | None = None, skip: set[int] | frozenset[int] = frozenset(),
) -> dict[int, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]]:
    """The ``duplicate`` plan's matrices with several homes, per wave: ``{wave: {param: (homes, serving)}}``, where
    ``homes`` are the ranks that receive the whole matrix and run its NS (the wave's home first) and ``serving[r]``
    is the home rank ``r`` takes its block of the result from (:func:`serving_homes`: a home serves itself, so only
    the other ranks receive a scatter). Waves in ``skip`` (run otherwise) and single-homed matrices are left out.
    ``ranks_per_node`` of the cost model decides which home serves whom."""
    cm = cost_model or SurplusCostModel()
    out: dict[int, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
    for w in waves:
        size = domain_sizes[w.domain]
        if w.index in skip or size < 2 or len(w.params) >= size:
            continue
        plan = plan_surplus(w.params, w.homes, {i: shapes[i] for i in w.params}, size, "duplicate", cm)
        dup = {i: (a.ranks, tuple(serving_homes(a, size, min(cm.ranks_per_node, size))))
               for i, a in plan.assignments.items() if a.kind == "duplicate" and len(a.ranks) > 1}
        if dup:
            out[w.index] = dup
    return out
