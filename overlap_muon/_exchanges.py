"""The exchange kinds: how a wave's matrices reach the ranks that orthogonalize them, and come back.

A wave's plan (:class:`overlap_muon._scheduler.kinds.WavePlan`, frozen at construction) names its kind; the runtime
builds one :class:`Exchange` per wave from it, and the wave pipeline calls the same three methods for every kind:

* ``to_compute(leg)``: from this rank's packed bf16 shards to the matrices this rank orthogonalizes (``leg.mats``,
  ``leg.homed``: whose matrix each is);
* ``orthogonalize(leg, kw)``: Newton-Schulz on them, the kind's own NS (plain or team) with the NS options ``kw``;
* ``back_to_storage(leg)``: from the results to this rank's block of each result, in ``leg.positions`` order.

Each exchange runs its own collectives (an error names the wave, the exchange, the group and the params:
``run_collective``). To add an exchange kind, add a class here and a kind to the planner; nothing else
branches on the kind.

=============  ==================================================================================================
kind           trip
=============  ==================================================================================================
``routed``     layer-sharded: one ``all_to_all`` to each matrix's NS home (``to_homes``), NS there, one back
               (``from_homes``); with duplicate homes a matrix goes to each of its homes and each rank takes its
               block from its serving home (``surplus="duplicate"``, fused exchanges)
``gathered``   every rank all-gathers every matrix and runs its NS, keeping its own block (``duplicated`` mode, and
               waves the surplus plan gives every rank)
``team``       re-laid into column blocks of the long dim, NS split over the domain ([Note: team NS by columns] in
               ``_team_ns.py``), re-laid back; not bitwise
``local``      the matrix is whole on every rank (replicated params, an expert's own matrices): NS in place
``dp_shared``  ``routed`` over this replica's matrices, then the DP swap brings the other replicas' blocks
               ([Note: DP replicas as NS slots] in ``_comm.py``)
=============  ==================================================================================================
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._comm import DPSlots
from ._domain import Domain
from ._placement import MuonParam
from ._scheduler.kinds import WavePlan
from .layer_sharded_a2a import all_gather_full, from_homes, from_team, local_shard, to_homes, to_team
from ._ns import split_ns, zeropower_each
from ._gram_mode import sharded_gram_zeropower
from ._team_ns import team_zeropower_oriented

__all__ = ["run_collective", "Leg", "ExchangeContext", "Exchange", "Routed", "Gathered", "Team", "Gram", "Local",
           "DPShared", "WaveExchanges", "build_exchange"]


def run_collective(fn: Callable[[], Any], what: str, names: list[str], dom: Domain, op: str, fused: bool) -> Any:
    """``fn()``, a collective; any error but a ``ValueError`` (bad input, already named and raised on every rank
    before the collective) becomes a ``RuntimeError`` naming ``what`` (the wave and phase), the collective, the group
    and ``names`` (the params), with the original chained."""
    try:
        return fn()
    except ValueError:
        raise
    except Exception as e:
        if fused or op == "all_gather":
            g, kind = dom.flat_group, "flat R x T group"
        else:
            g, kind = dom.remat_group or dom.tp_group, "remat/TP groups"
        ranks = dist.get_process_group_ranks(g) if g is not None else [dist.get_rank()]
        raise RuntimeError(
            f"OverlapMuon {what} failed on rank {dist.get_rank()} ({'fused' if fused else 'two-stage'} {op} over the "
            f"runtime's {kind} {dom.remat_size}x{dom.tp_size}, global ranks {ranks}; params {names}): {e}"
        ) from e


@dataclass(eq=False)
class Leg:
    """The part of one launched wave that one exchange carries (tensors released as the wave's tasks finish)."""

    exchange: "Exchange"
    """Which exchange carries it."""
    positions: list[int]
    """Positions in the wave state's ``items`` (params with a gradient on this rank) that this leg carries."""
    params: list[MuonParam]
    """The Muon params at those positions."""
    packed: list[Tensor | None]
    """Shards, bf16: their NS inputs (``None`` where another replica computes the matrix: ``dp_shared``)."""
    mats: list[Tensor] | None = None
    """What this rank orthogonalizes: full ``(P, Q)`` matrices, or team blocks (``to_compute``)."""
    homed: list[MuonParam] = field(default_factory=list)
    """Whose matrix each of ``mats`` is."""
    route: Any = None
    """The exchange's own record of how the leg was routed (e.g. which copies are homed here)."""
    outs: list[Tensor] | None = None
    """NS results of ``mats`` (``orthogonalize``)."""

    def release(self) -> None:
        self.packed = self.mats = self.outs = None  # type: ignore[assignment]


@dataclass(eq=False)
class ExchangeContext:
    """What every exchange of one runtime shares: the fused/two-stage choice, the NS options, the routing's caches
    and the reserved buffers. Its two NS methods are what the kinds run (tests wrap them to watch or delay NS)."""

    fused: bool
    stats: dict[str, int]
    """The optimizer's counters (``ns_matrices``, ``ns_calls``)."""
    batch_ns: bool = False
    team_group: Any = None
    """A group over this rank's dense domain, for team NS (``surplus="team"``)."""
    routes: dict[Any, dict] = field(default_factory=dict)
    buffers: dict[Any, dict] | None = None
    """CPU: each routed exchange's reserved buffers, by (direction, wave, params) ([Note: reserved exchange
    buffers] in ``layer_sharded_a2a/_route.py``); ``None``: fresh buffers each time (CUDA: the caching allocator)."""
    lock: threading.Lock = field(default_factory=threading.Lock)
    """Guards ``stats`` where two threads run :meth:`ns` at once."""
    gram_restart_every: int = 5
    """``mode="gram"``: NS steps between two all-reduces of a matrix's Gram (``_gram_mode.py``)."""

    def ns(self, mats: list[Tensor], kw: dict[str, Any]) -> list[Tensor]:
        """NS of each ``(P, Q)`` bf16 matrix (``_ns.zeropower_each``; same-shape ones batched with ``batch_ns``).
        Two threads may run it at once ([Note: a waiting thread helps] in ``_lanes.py``): the counts add under a
        lock."""
        counts = {"ns_matrices": 0, "ns_calls": 0}
        out = zeropower_each(mats, kw, self.batch_ns, counts)
        with self.lock:
            for k, v in counts.items():
                self.stats[k] += v
        return out

    def gram_ns(self, blocks: list[Tensor], talls: list[bool], kw: dict[str, Any]) -> list[Tensor]:
        """[Note: sharded Gram NS] in ``_gram_mode.py``: each matrix's NS over its blocks, in Gram space on
        ``team_group`` (collective, in the same order on every rank)."""
        with self.lock:
            self.stats["ns_matrices"] += len(blocks)
            self.stats["ns_calls"] += len(blocks)
        opts = {k: kw[k] for k in ("ns_coefficients", "ns_steps", "eps")}
        return [sharded_gram_zeropower(b, self.team_group, tall=t, restart_every=self.gram_restart_every, **opts)
                for b, t in zip(blocks, talls)]

    def team_ns(self, work: list[tuple[list[Tensor], list[MuonParam], list[bool]]], kw: dict[str, Any]
                ) -> list[Tensor]:
        """[Note: team NS by columns] The wave's team blocks (``(P, Q)`` layout) of its matrices, NS'd in lockstep
        over ``team_group`` (collective, in the same order on every rank). ``work`` is ``[(blocks, params,
        split_poly)]``: one entry, so that a wrapper sees one call."""
        ((blocks, mps, split),) = work
        self.stats["ns_matrices"] += len(blocks)
        self.stats["ns_calls"] += len(blocks)
        tall = [m.full_shape[0] > m.full_shape[1] for m in mps]
        kw = {k: v for k, v in kw.items() if k != "gram"}  # team NS keeps the plain iteration
        return team_zeropower_oriented(blocks, tall, self.team_group, split, kw)


class Exchange:
    """One wave's exchange of one kind. ``dom_to`` / ``dom_from``: the wave's domain with the gather and the scatter
    lanes' own groups (one group set per communicating lane, ``_lanes.py``)."""

    kind = "?"
    op = "all_to_all"
    """The collective named in errors."""
    ns_collective = False
    """Its NS issues collectives: its NS task stays on the compute lane's thread ([Note: a waiting thread helps] in
    ``_lanes.py``)."""

    def __init__(self, ctx: ExchangeContext, index: int, dom_to: Domain, dom_from: Domain) -> None:
        self.ctx, self.index, self.dom_to, self.dom_from = ctx, index, dom_to, dom_from

    def to_compute(self, leg: Leg) -> None:
        raise NotImplementedError

    def orthogonalize(self, leg: Leg, kw: dict[str, Any]) -> list[Tensor]:
        """NS of each matrix of ``leg``, ``(P, Q)`` bf16 in, ``(P, Q)`` bf16 out. [Note: transposed weights]: a weight
        stored ``(in, out)`` (HF ``Conv1D``) is the ``(out, in)`` linear ``W^T``: NS runs on a contiguous copy of
        ``W^T``, exactly the matrix ``torch.optim.Muon`` sees for the equivalent ``nn.Linear``, and the result goes
        back to the stored layout; a split param is orthogonalized as its parts (``overlap_muon.split``)."""
        mats = [f.T.contiguous() if m.transposed else f for f, m in zip(leg.mats, leg.homed)]
        outs = split_ns(mats, [m.parts for m in leg.homed], lambda ms: self.ctx.ns(ms, kw))
        return [o.T.contiguous() if m.transposed else o for o, m in zip(outs, leg.homed)]

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        raise NotImplementedError

    def needs_input(self, m: MuonParam) -> bool:
        """Whether this rank must pack ``m``'s NS input (``dp_shared``: not where another replica computes it)."""
        return True

    def _run(self, leg: Leg, phase: str, dom: Domain, fn: Callable[[], Any]) -> Any:
        """Run this exchange's collective ``fn``; an error names the wave, the phase, the group and the params."""
        return run_collective(fn, f"wave {self.index} {phase}", [m.name for m in leg.params], dom, self.op,
                              self.ctx.fused)

    def _route(self, what: str, leg: Leg) -> dict:
        """The routing's cache (its ``plan=`` dict: the metadata of the exchange) of this wave's ``what`` exchange for
        the params present now."""
        return self.ctx.routes.setdefault((what, self.index, tuple(m.index for m in leg.params)), {})

    def _buffers(self, what: str, leg: Leg) -> dict | None:
        """This wave's reserved buffers for its ``what`` exchange (``None`` where the context keeps none)."""
        if self.ctx.buffers is None:
            return None
        return self.ctx.buffers.setdefault((what, self.index, tuple(m.index for m in leg.params)), {})

    @staticmethod
    def _layout(leg: Leg) -> tuple[list[int | None], list[tuple[int, int]]]:
        return [m.partition_dim for m in leg.params], [m.full_shape for m in leg.params]


class Local(Exchange):
    """The matrices are whole here: no exchange ([Note: replicated params] in ``_placement.py``)."""

    kind = "local"

    def to_compute(self, leg: Leg) -> None:
        leg.mats, leg.homed = list(leg.packed), list(leg.params)

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        return list(leg.outs)


class Gathered(Exchange):
    """Every rank all-gathers every matrix and keeps its own block of the NS result: nothing is scattered back."""

    kind, op = "gathered", "all_gather"

    def to_compute(self, leg: Leg) -> None:
        pds, shapes, dom = *self._layout(leg), self.dom_to
        leg.mats = self._run(leg, "a2a_to_home", dom, lambda: all_gather_full(leg.packed, pds, shapes, dom))
        leg.homed = list(leg.params)

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        return [local_shard(o, m.partition_dim, self.dom_from) for o, m in zip(leg.outs, leg.params)]


class Team(Exchange):
    """Team NS by columns: each rank gets its column block of every matrix's long dim, the domain splits each NS
    (``split_poly``: per param, whether the ``A @ A`` product is split by rows too; decided by the planner)."""

    kind = "team"
    ns_collective = True

    def __init__(self, ctx: ExchangeContext, index: int, dom_to: Domain, dom_from: Domain,
                 split_poly: dict[int, bool]) -> None:
        super().__init__(ctx, index, dom_to, dom_from)
        self.split_poly = split_poly

    def to_compute(self, leg: Leg) -> None:
        pds, shapes, dom, route = *self._layout(leg), self.dom_to, self._route("to_team", leg)
        leg.mats = self._run(leg, "a2a_to_home", dom, lambda: to_team(leg.packed, pds, shapes, dom, route))
        leg.homed = list(leg.params)

    def orthogonalize(self, leg: Leg, kw: dict[str, Any]) -> list[Tensor]:
        return self.ctx.team_ns([(leg.mats, leg.homed, [self.split_poly[m.index] for m in leg.homed])], kw)

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        pds, shapes, dom, route = *self._layout(leg), self.dom_from, self._route("from_team", leg)
        return self._run(leg, "a2a_from_home", dom, lambda: from_team(leg.outs, pds, shapes, dom, route))


class Gram(Exchange):
    """No exchange: each rank keeps its block, and NS runs in Gram space over the blocks on the compute lane's own
    group ([Note: sharded Gram NS] in ``_gram_mode.py``; ``tall``: per param, whether its rows are split)."""

    kind, op = "gram", "all_reduce"
    ns_collective = True

    def __init__(self, ctx: ExchangeContext, index: int, dom_to: Domain, dom_from: Domain, tall: dict[int, bool]
                 ) -> None:
        super().__init__(ctx, index, dom_to, dom_from)
        self.tall = tall

    def to_compute(self, leg: Leg) -> None:
        leg.mats, leg.homed = list(leg.packed), list(leg.params)

    def orthogonalize(self, leg: Leg, kw: dict[str, Any]) -> list[Tensor]:
        return self.ctx.gram_ns(leg.mats, [self.tall[m.index] for m in leg.homed], kw)

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        return list(leg.outs)


class Routed(Exchange):
    """Layer sharding: each matrix to its NS home(s) and back.

    Args:
        homes: param index -> its NS home, a rank of the domain.
        dup: params with several homes (``surplus="duplicate"``): param index -> ``(homes, serving home of each
            domain rank)``; each home receives the whole matrix and runs its NS, every rank takes its block from
            its serving home (a home from itself), so only the other ranks receive a scatter.
    """

    kind = "routed"

    def __init__(self, ctx: ExchangeContext, index: int, dom_to: Domain, dom_from: Domain, homes: dict[int, int],
                 dup: dict[int, tuple[tuple[int, ...], tuple[int, ...]]]) -> None:
        super().__init__(ctx, index, dom_to, dom_from)
        self.homes, self.dup = homes, dup

    def _copies(self, leg: Leg) -> list[tuple[int, int]]:
        """``(position in the leg, home)`` per copy of a matrix, one copy per home."""
        return [(x, h) for x, m in enumerate(leg.params) for h in self.dup.get(m.index, ((self.homes[m.index],),))[0]]

    def to_compute(self, leg: Leg) -> None:
        copies, (pds, shapes), dom = self._copies(leg), self._layout(leg), self.dom_to
        homes = [h for _, h in copies]
        cp, cpds, cshapes = ([v[x] for x, _ in copies] for v in (leg.packed, pds, shapes))
        route, fused, buf = self._route("to", leg), self.ctx.fused, self._buffers("to", leg)
        leg.mats, mine = self._run(leg, "a2a_to_home", dom, lambda: to_homes(cp, homes, cpds, cshapes, dom,
                                                                            fused=fused, plan=route, buffers=buf))
        leg.homed = [leg.params[copies[v][0]] for v in mine]
        leg.route = (copies, mine)

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        (copies, mine), (pds, shapes), dom = leg.route, self._layout(leg), self.dom_from
        homes = [h for _, h in copies]
        cp, cpds, cshapes = ([v[x] for x, _ in copies] for v in (leg.packed, pds, shapes))
        serve = self._serve(leg, copies, dom.size)
        route, fused, buf = self._route("from", leg), self.ctx.fused, self._buffers("from", leg)
        got = self._run(leg, "a2a_from_home", dom, lambda: from_homes(leg.outs, mine, cp, homes, cpds, cshapes, dom,
                                                                     fused=fused, plan=route, serve=serve, buffers=buf))
        updates: list[Tensor | None] = [None] * len(leg.params)
        for v, (x, _) in enumerate(copies):
            if serve is None or dom.flat_rank in serve[v]:
                updates[x] = got[v]
        return updates  # type: ignore[return-value]

    def _serve(self, leg: Leg, copies: list[tuple[int, int]], size: int) -> list[frozenset[int]] | None:
        """Which ranks each copy serves: a duplicated matrix's copy the ranks whose serving home it is, a
        single-homed matrix everyone; ``None`` without duplicate homes."""
        if not self.dup:
            return None
        every = frozenset(range(size))
        return [frozenset(r for r, s in enumerate(self.dup[m][1]) if s == h) if m in self.dup else every
                for m, h in ((leg.params[x].index, h) for x, h in copies)]


class DPShared(Exchange):
    """``dp_slots``: the routed exchange of the matrices homed in this replica, then the DP swap: this rank's
    blocks of its replica's results go to the same-position rank of every other replica, which sends back its own
    (one ``all_to_all`` over the DP group, flat bf16 buffers)."""

    kind = "dp_shared"

    def __init__(self, inner: Routed, dp: DPSlots, owner: dict[int, int]) -> None:
        super().__init__(inner.ctx, inner.index, inner.dom_to, inner.dom_from)
        self.inner, self.dp, self.owner = inner, dp, owner

    def needs_input(self, m: MuonParam) -> bool:
        return self.owner[m.index] == self.dp.replica

    def _mine(self, leg: Leg) -> Leg:
        keep = [x for x, m in enumerate(leg.params) if self.needs_input(m)]
        return Leg(self.inner, [leg.positions[x] for x in keep], [leg.params[x] for x in keep],
                   [leg.packed[x] for x in keep])

    def to_compute(self, leg: Leg) -> None:
        inner = self._mine(leg)
        if inner.params:  # every rank of the replica's domain has the same params (presence is agreed)
            self.inner.to_compute(inner)
        leg.mats, leg.homed, leg.route = inner.mats or [], inner.homed, inner

    def back_to_storage(self, leg: Leg) -> list[Tensor]:
        inner: Leg = leg.route
        inner.outs = leg.outs
        own = self.inner.back_to_storage(inner) if inner.params else []
        got = self._run(leg, "dp_share", self.dom_from, lambda: self._swap(leg.params, inner.params, own))
        return [got[m.index] for m in leg.params]

    def _swap(self, params: Sequence[MuonParam], mine: Sequence[MuonParam], own: list[Tensor]) -> dict[int, Tensor]:
        """Blocks of every param of the leg (``params``, in wave order), by param index: this replica's from ``own``,
        the others' from the DP swap (each replica sends its blocks in wave order; all hold the same shard shapes)."""
        dp, owner = self.dp, self.owner
        order = list(params)
        shapes = {m.index: tuple(m.local(m.param).shape) for m in order}
        n = [sum(math.prod(shapes[m.index]) for m in order if owner[m.index] == r) for r in range(dp.size)]
        device = order[0].local(order[0].param).device
        dtype = own[0].dtype if own else torch.bfloat16  # NS results are bf16 (overlap_muon._ns)
        send = torch.cat([u.reshape(-1) for u in own]) if own else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(n), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send.repeat(dp.size), output_split_sizes=n,
                               input_split_sizes=[send.numel()] * dp.size, group=dp.group)
        got = {m.index: u for m, u in zip(mine, own)}
        for r, part in enumerate(recv.split(n)):
            if r == dp.replica:
                continue
            theirs = [m for m in order if owner[m.index] == r]
            for m, flat in zip(theirs, part.split([math.prod(shapes[m.index]) for m in theirs])):
                got[m.index] = flat.view(shapes[m.index])
        return got


@dataclass
class WaveExchanges:
    """One wave's exchanges: its kind's (``main``), ``local`` for its replicated params ([Note: replicated params]
    in ``_placement.py``), ``gram`` for the params NS'd over their blocks (``mode="gram"``, ``auto``'s Gram picks)
    and ``gathered`` for ``auto``'s duplicated picks in a routed wave ([Note: NS strategy per weight] in
    ``scheduler/strategy.py``)."""

    main: Exchange
    local: Exchange
    gram: Gram | None = None
    gathered: Gathered | None = None
    gathered_params: frozenset[int] = frozenset()

    @property
    def ns_shareable(self) -> bool:
        """No NS of the wave issues a collective: another thread may run it ([Note: a waiting thread helps])."""
        return not any(e is not None and e.ns_collective for e in (self.main, self.local, self.gram, self.gathered))

    def needs_input(self, m: MuonParam) -> bool:
        """Whether this rank packs ``m``'s NS input: always in the legs of its own, else as the main kind says."""
        own = m.index in self.gathered_params or (self.gram is not None and m.index in self.gram.tall)
        return own or self.main.needs_input(m)

    def legs(self, mps: Sequence[MuonParam], packed: Sequence[Tensor | None]) -> list[Leg]:
        """One leg per exchange that has params among ``mps`` (``packed``: their NS inputs, in ``mps`` order)."""
        own, dup = (self.gram.tall if self.gram is not None else {}), self.gathered_params
        split = ((self.main, [j for j, m in enumerate(mps) if not m.replicated and m.index not in own
                              and m.index not in dup]),
                 (self.gathered, [j for j, m in enumerate(mps) if m.index in dup]),
                 (self.local, [j for j, m in enumerate(mps) if m.replicated]),
                 (self.gram, [j for j, m in enumerate(mps) if m.index in own]))
        return [Leg(e, pos, [mps[j] for j in pos], [packed[j] for j in pos]) for e, pos in split if pos]


def build_exchange(p: WavePlan, ctx: ExchangeContext, doms: tuple[Domain, Domain], dp: DPSlots | None
                   ) -> WaveExchanges:
    """The exchanges of one frozen wave plan, on the wave's domain (``doms``: the gather and the scatter lanes')."""
    gram = Gram(ctx, p.wave.index, *doms, dict(p.gram_tall)) if p.gram_tall else None
    gathered = Gathered(ctx, p.wave.index, *doms) if p.gathered else None
    return WaveExchanges(_main_exchange(p, ctx, doms, dp), Local(ctx, p.wave.index, *doms), gram, gathered,
                         frozenset(p.gathered))


def _main_exchange(p: WavePlan, ctx: ExchangeContext, doms: tuple[Domain, Domain], dp: DPSlots | None) -> Exchange:
    w, (dom_to, dom_from) = p.wave, doms
    if p.kind == "gathered":
        return Gathered(ctx, w.index, dom_to, dom_from)
    if p.kind == "team":
        return Team(ctx, w.index, dom_to, dom_from, dict(p.split_poly))
    if p.kind == "dp_shared":
        D = p.dp_size
        inner = Routed(ctx, w.index, dom_to, dom_from, {i: h // D for i, h in w.homes.items()}, {})
        return DPShared(inner, dp, {i: h % D for i, h in w.homes.items()})
    return Routed(ctx, w.index, dom_to, dom_from, dict(w.homes), {i: (hs, sv) for i, hs, sv in p.dup})
