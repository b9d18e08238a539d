"""The communication context: every process group the runtime owns is created here, each with a one-line why.

The runtime's exchanges run on groups of their own, never on the job's default group or on FSDP/DDP/TP groups, so
they cannot interleave with the training step's collectives. ``new_group`` is collective over the default group:
every rank creates every group, in one order. Functions elsewhere that run collectives take the group as an
argument (``tests/test_structure.py`` checks that no other module of the library creates one).
"""

from __future__ import annotations

import dataclasses
import datetime
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from ._domain import Domain, NodeHops

__all__ = ["CommContext", "build_comm", "domain_from_layouts", "domain_group", "DPSlots", "dp_slot_groups",
           "stage_replicas", "node_spans", "node_hops", "warm_up"]


def domain_from_layouts(
    layouts: list[list[list[int]]],
    *,
    timeout: datetime.timedelta | None = None,
    with_ctrl: bool = True,
    node_size: int | None = None,
) -> Domain:
    """Build this rank's domain given every domain's ``layout[g][t] = global rank`` (identical on all ranks).

    ``with_ctrl``: also give it a gloo ``ctrl_group`` for host-side flags (the flat group itself when the job's
    backend is gloo, else a new gloo group over the same ranks).
    ``node_size``: global ranks per node; a domain that spans nodes with as many of its ranks on each gets the
    node groups of two-hop exchanges (:func:`node_hops`).

    ``new_group`` is collective over the default group, so all ranks create all groups in one order.

    Raises:
        ValueError: a layout is not rectangular, ranks repeat, this rank is in no layout, or global ranks
            do not increase with ``g*T + t`` (group ranks would not match the coordinates).
    """
    me = dist.get_rank() if dist.is_initialized() else 0
    mine = None
    seen: set[int] = set()
    for layout in layouts:
        R = len(layout)
        T = len(layout[0]) if R else 0
        if R == 0 or T == 0 or any(len(row) != T for row in layout):
            raise ValueError(f"domain layout {layout} is not a rectangular R x T grid of global ranks")
        flat = [r for row in layout for r in row]
        if flat != sorted(flat) or len(set(flat)) != len(flat):
            raise ValueError(
                f"domain layout {layout}: global ranks must be distinct and increase with g*T + t "
                "(TP innermost), the layout of init_device_mesh(..., ('remat', 'tp'))"
            )
        if seen & set(flat):
            raise ValueError(f"domain layouts overlap on ranks {sorted(seen & set(flat))}")
        seen |= set(flat)
        for g, row in enumerate(layout):
            for t, r in enumerate(row):
                if r == me:
                    mine = (layout, g, t)
    if mine is None:
        raise ValueError(f"rank {me} is in none of the domain layouts {layouts}")
    kw = {} if timeout is None else {"timeout": timeout}
    # Host-side flags need a gloo group; a gloo job's flat group is one already.
    gloo_ctrl = with_ctrl and dist.get_backend() != "gloo"
    groups: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}

    def make(kind: str, ranks: list[int], **extra: str) -> None:
        if len(ranks) > 1:
            groups[(kind, tuple(ranks))] = dist.new_group(ranks=ranks, **kw, **extra)

    for layout in layouts:
        R, T = len(layout), len(layout[0])
        for t in range(T):
            make("remat", [layout[g][t] for g in range(R)])
        for g in range(R):
            make("tp", list(layout[g]))
        make("flat", [r for row in layout for r in row])
        if gloo_ctrl:
            make("ctrl", [r for row in layout for r in row], backend="gloo")
    nodes = node_hops(layouts, node_size, timeout) if node_size else None
    layout, g, t = mine
    R, T = len(layout), len(layout[0])
    return Domain(
        remat_size=R,
        tp_size=T,
        remat_rank=g,
        tp_rank=t,
        remat_group=groups.get(("remat", tuple(layout[gg][t] for gg in range(R)))),
        tp_group=groups.get(("tp", tuple(layout[g]))),
        flat_group=groups.get(("flat", tuple(r for row in layout for r in row))),
        ctrl_group=groups.get(("ctrl" if gloo_ctrl else "flat", tuple(r for row in layout for r in row)))
        if with_ctrl else None,
        nodes=nodes,
    )


def node_spans(flat: list[int], node_size: int) -> tuple[int, int] | None:
    """``(L, N)``: ``flat`` (a domain's global ranks, ascending) lies ``L`` ranks to a node on ``N >= 2`` nodes of
    ``node_size`` global ranks each (node ``r // node_size``); ``None`` if it lies on one node or unevenly."""
    per: dict[int, int] = {}
    for r in flat:
        per[r // node_size] = per.get(r // node_size, 0) + 1
    L = len(flat) // max(len(per), 1)
    return (L, len(per)) if len(per) > 1 and all(c == L for c in per.values()) else None


def node_hops(layouts: list[list[list[int]]], node_size: int, timeout: datetime.timedelta | None = None
              ) -> NodeHops | None:
    """This rank's :class:`~overlap_muon._domain.NodeHops` ([Note: node-aware exchange] in ``_domain.py``): for every
    domain of ``layouts`` that spans nodes evenly (:func:`node_spans`), a group per node over its ranks there and a
    group per local index over the nodes. ``None`` where this rank's domain does not. Collective over the default
    group: every rank creates every domain's groups, in one order."""
    me, mine = dist.get_rank(), None
    kw = {} if timeout is None else {"timeout": timeout}
    for lay in layouts:
        flat = [r for row in lay for r in row]
        span = node_spans(flat, node_size)
        if span is None:
            continue
        L, N = span
        intra = [dist.new_group(ranks=flat[n * L:(n + 1) * L], **kw) if L > 1 else None for n in range(N)]
        inter = [dist.new_group(ranks=flat[l::L], **kw) for l in range(L)]
        if me in flat:
            n, l = divmod(flat.index(me), L)
            mine = NodeHops(L, N, intra[n], inter[l])
    return mine


def domain_group(layouts: list[list[list[int]]] | None, timeout: datetime.timedelta | None = None,
                 backend: str | None = "gloo") -> ProcessGroup | None:
    """A new group over this rank's domain of ``layouts`` (``None`` for a one-rank domain or one process), on
    ``backend`` (gloo by default, for host-side flags; ``None``: the job's backend).

    Collective over the default group: every rank creates every domain's group, in one order."""
    if not layouts or not (dist.is_available() and dist.is_initialized()):
        return None
    me, mine = dist.get_rank(), None
    kw = {} if timeout is None else {"timeout": timeout}
    for lay in layouts:
        ranks = [r for row in lay for r in row]
        if len(ranks) > 1:
            group = dist.new_group(ranks=ranks, backend=backend, **kw)
            mine = group if me in ranks else mine
    return mine


@dataclass(frozen=True)
class DPSlots:
    """[Note: DP replicas as NS slots] With replicate dims (HSDP's ``dp_replicate``) every replica of the dense
    domain holds the same shards and, after the gradient all-reduce, the same gradients, so by default each replica
    runs the NS of every matrix. With DP slots a wave's homes number ``D * S`` (replica ``h % D``, domain rank
    ``h // D``: interleaved, so the planner's ties, which go to the lowest home, alternate between replicas): each
    replica gathers, orthogonalizes and scatters only the matrices homed in it, then every rank
    swaps its blocks of the results with the same-position rank of the other replicas (one ``all_to_all`` over
    that DP group, on the from-home lane after the scatter). Same inputs, same NS: bitwise the result of every
    replica running all of it, at ``1/D`` of the NS and of the domain's exchanges per replica plus the DP swap."""

    size: int  #: D, the number of replicas
    replica: int  #: this rank's replica, in [0, D)
    group: dist.ProcessGroup  #: the D ranks at this rank's position in every replica


def stage_replicas(layouts: list[list[list[int]]], stages: list[list[int]] | None) -> list[list[list[int]]]:
    """The replicas of each pipeline stage: per stage, the flat rank lists of the domains inside it (every domain
    of the job is one stage's replica without stages). Replicas hold the same params only within a stage."""
    flats = [[r for row in lay for r in row] for lay in layouts]
    if not stages or len(stages) == 1:
        return [flats]
    return [[f for f in flats if set(f) <= set(s)] for s in stages]


def dp_slot_groups(layouts: list[list[list[int]]], rank: int, timeout: Any,
                   stages: list[list[int]] | None = None) -> tuple[DPSlots | None, dist.ProcessGroup | None]:
    """This rank's :class:`DPSlots` for the replicas of its pipeline stage (:func:`stage_replicas`; ``layouts``:
    one ``R x T`` grid each, identical on every rank), and a gloo group over every replica's ranks of the stage for
    the per-wave presence agreement; ``(None, None)`` in a stage with one replica. Collective over the default
    group: every rank creates every stage's groups, in stage order."""
    out: tuple[DPSlots | None, dist.ProcessGroup | None] = (None, None)
    for flats in stage_replicas(layouts, stages):
        if len(flats) < 2:
            continue
        cols = [[f[p] for f in flats] for p in range(len(flats[0]))]
        if any(c != sorted(c) for c in cols):  # group rank r must be replica r (the DP swap's split order)
            raise ValueError(f"dp_slots: the replicas' ranks {flats} do not increase with the replica index at "
                             "every position; put the replicate dim outside the domain's dims in the mesh")
        groups = [dist.new_group(ranks=c, timeout=timeout) for c in cols]
        wide = dist.new_group(ranks=sorted(r for f in flats for r in f), backend="gloo", timeout=timeout)
        mine = next((d for d, f in enumerate(flats) if rank in f), None)
        if mine is not None:
            out = (DPSlots(len(flats), mine, groups[flats[mine].index(rank)]), wide)
    return out


@dataclass(frozen=True)
class CommContext:
    """Every group of one ``OverlapMuon``, built by :func:`build_comm`."""

    dom_to: Domain
    """The dense domain with the gather lane's groups (and a gloo ``ctrl_group`` for each wave's presence check)."""
    dom_from: Domain
    """The same domain with the scatter lane's own groups (wave k+1's gather runs beside wave k's scatter)."""
    ctrl: ProcessGroup | None
    """gloo, every rank of this rank's pipeline stage (of the job, without PP): ``step()``'s agreement on stale
    waves and gradient presence."""
    team: ProcessGroup | None
    """``surplus="team"|"auto"``: the compute lane's own group over the dense domain (team NS collectives)."""
    dp: DPSlots | None
    """``dp_slots``: the replicas' DP groups (the DP swap, on the scatter lane)."""
    expert: tuple[Domain, Domain, ProcessGroup | None] | None
    """Expert domain: gather lane's, scatter lane's, and a gloo group over it for ``step()``'s presence agreement."""
    stages: list[list[int]] | None = None
    """Every pipeline stage's ranks (``None``: one process)."""
    stage_root: int = 0
    """The first global rank of this rank's pipeline stage (the source of its broadcasts)."""


def stage_group(stages: list[list[int]] | None, rank: int, timeout_s: float) -> ProcessGroup:
    """A gloo group over this rank's pipeline stage (every rank without stages). Collective over the default
    group: every rank makes every stage's group, in stage order."""
    timeout = datetime.timedelta(seconds=timeout_s)
    if stages is None or len(stages) == 1:
        return dist.new_group(backend="gloo", timeout=timeout)
    return [g for s in stages for g in [dist.new_group(ranks=s, backend="gloo", timeout=timeout)] if rank in s][0]


def build_comm(layouts: list[list[list[int]]] | None, elayouts: list[list[list[int]]] | None, rank: int, *,
               timeout_s: float, team: bool, dp_slots: bool, experts: bool,
               stages: list[list[int]] | None = None, node_size: int | None = None) -> CommContext:
    """Create every group of one optimizer. Collective over the default group.

    Args:
        layouts / elayouts: every dense / expert domain's ``layout[g][t] = global rank`` (identical on all ranks);
            ``None``: one process, or no such domain.
        rank: this rank.
        timeout_s: timeout of every group, seconds.
        team: make the team group (``surplus="team"|"auto"``, no DP slots).
        dp_slots: make the DP-slot groups (the replicas of a stage share the dense domain's NS work).
        experts: make the expert domain's groups.
        stages: every pipeline stage's ranks ([Note: pipeline stages] in ``_discovery.py``); ``step()``'s agreement
            group is this rank's stage (``None`` or one stage: every rank).
        node_size: global ranks per node, for the dense domain's two-hop exchanges ([Note: node-aware exchange] in
            ``_domain.py``); ``None``: one flat ``all_to_all``.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    distributed = layouts is not None and dist.get_world_size() > 1
    dom_to = domain_from_layouts(layouts, timeout=timeout, node_size=node_size) if distributed else Domain.single()
    dom_from = (domain_from_layouts(layouts, timeout=timeout, with_ctrl=False, node_size=node_size) if distributed
                else Domain.single())
    experts_on = experts and elayouts is not None and dist.get_world_size() > 1
    ctrl = stage_group(stages, rank, timeout_s) if distributed or experts_on else None
    team_group = domain_group(layouts, timeout, backend=None) if distributed and team else None
    dp = None
    if distributed and dp_slots:
        dp, wide = dp_slot_groups(layouts, rank, timeout, stages)
        if wide is not None:
            dom_to = dataclasses.replace(dom_to, ctrl_group=wide)  # presence is agreed over every replica
    expert = None
    if experts_on:
        expert = (domain_from_layouts(elayouts, timeout=timeout),
                  domain_from_layouts(elayouts, timeout=timeout, with_ctrl=False), domain_group(elayouts, timeout))
    root = next((s[0] for s in stages or () if rank in s), 0)
    return CommContext(dom_to, dom_from, ctrl, team_group, dp, expert, stages, root)


def _groups_to_warm(ctx: CommContext, fused: bool) -> list[tuple[str, ProcessGroup, tuple[str, ...]]]:
    """Every group of ``ctx`` once, with its (first) name and the collective kinds the runtime runs on it
    (``fused``: the exchanges are fused, so the remat and TP groups carry none; the flat group's all_gather is a
    ring, two peers, and serves gathered waves)."""
    out: list[tuple[str, ProcessGroup | None, tuple[str, ...]]] = []
    doms = [("dense gather lane", ctx.dom_to), ("dense scatter lane", ctx.dom_from)]
    if ctx.expert is not None:
        doms += [("expert gather lane", ctx.expert[0]), ("expert scatter lane", ctx.expert[1])]
        out.append(("expert presence", ctx.expert[2], ("all_to_all",)))
    for lane, d in doms:
        # Connecting the peers of a group the exchanges do not use would undo the node hops: with them the flat
        # group's all_to_all serves team waves only; fused, the remat and TP groups serve nothing.
        flat = ("all_to_all", "all_gather") if d.nodes is None or ctx.team is not None else ("all_gather",)
        stages = () if fused else ("all_to_all",)
        out += [(f"{lane} flat", d.flat_group, flat), (f"{lane} remat", d.remat_group, stages),
                (f"{lane} TP", d.tp_group, stages), (f"{lane} control", d.ctrl_group, ("all_to_all",))]
        if d.nodes is not None:
            out += [(f"{lane} node", d.nodes.intra_group, ("all_to_all",)),
                    (f"{lane} across nodes", d.nodes.inter_group, ("all_to_all",))]
    out += [("step agreement", ctx.ctrl, ("all_to_all",)), ("team NS", ctx.team, ("all_reduce", "all_gather")),
            ("DP slots", ctx.dp.group if ctx.dp else None, ("all_to_all",))]
    merged: dict[int, tuple[str, ProcessGroup, tuple[str, ...]]] = {}
    for n, g, k in out:  # a group with two roles (gloo: the flat group is the control one) runs both kinds once
        if g is not None:
            name, _, kinds = merged.get(id(g), (n, g, ()))
            merged[id(g)] = (name, g, kinds + tuple(x for x in k if x not in kinds))
    return list(merged.values())


def warm_up(ctx: CommContext, device: Any, fused: bool = True) -> int:
    """[Note: warm-up] Run one small collective of each kind the runtime runs on each of its groups (``ctx``), at
    construction, and return how many ran. NCCL sets a group up, and connects the peers of an ``all_to_all``, at
    their first collective; without this that is the first exchange, launched from a backward hook at peak
    activation memory, where users of distributed Muon report first-step hangs and out-of-memory errors. On gloo it
    is cheap and exercises the same path. Only the kinds the runtime runs are warmed (``fused``: the exchanges are
    fused, so the two-stage groups are not), since each connects peers. Collective over every rank of every group,
    in one order.

    Raises:
        RuntimeError: a collective failed; the message names the group, its global ranks and the kind.
    """
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    ran = 0
    for name, group, kinds in _groups_to_warm(ctx, fused):
        n = dist.get_world_size(group)
        dev = torch.device("cpu") if dist.get_backend(group) == "gloo" else torch.device(device)
        for kind in kinds:
            try:
                if kind == "all_to_all":
                    dist.all_to_all_single(torch.empty(n, dtype=torch.uint8, device=dev),
                                           torch.zeros(n, dtype=torch.uint8, device=dev), group=group)
                elif kind == "all_gather":
                    gather(torch.empty(n, dtype=torch.uint8, device=dev), torch.zeros(1, dtype=torch.uint8,
                                                                                      device=dev), group=group)
                else:
                    dist.all_reduce(torch.zeros(1, device=dev), group=group)
            except Exception as e:
                raise RuntimeError(f"OverlapMuon warm-up: {kind} over the runtime's {name} group (global ranks "
                                   f"{dist.get_process_group_ranks(group)}, backend {dist.get_backend(group)}) "
                                   f"failed on rank {dist.get_rank()}: {e}") from e
            ran += 1
    return ran
