"""The domain API of the routing: ``local_shard``, ``to_homes`` and ``from_homes`` over the ``R x T`` layouts.

They speak the domain's layouts directly. ``fused=False`` runs the two seed stages (``_seed_api.py``);
``fused=True`` does the whole move in one ``all_to_all_single`` over the domain's flat group, or, where the domain
has node groups, in two hops over nodes with the same results ([Note: node-aware exchange], ``_nodes.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from overlap_muon._domain import Domain

from overlap_muon._layout import block, block_shape

from ._checks import _check_domain_inputs, _check_pd, _check_results, _Params
from ._nodes import TwoHops, two_hops
from ._route import _block_region, _cached, _execute, _mismatch, _Out, _Packer, _Piece, _Route
from ._seed_api import _route_from, _route_to, params_by_home


# ----------------------------------------------------------------------------------------------------------------
# Domain API.
# ----------------------------------------------------------------------------------------------------------------


def local_shard(full: Tensor, partition_dim: int | None, domain: Domain) -> Tensor:
    """This rank's block of a full ``(P, Q)`` tensor (a view), by the domain layouts of docs/design.md §2.

    Rank ``(g, t)`` of an ``R x T`` domain holds (``torch.chunk`` rules; blocks may be uneven or empty):
    partition_dim 0: rows ``chunk(chunk(range(P), T)[t], R)[g]``, all columns; 1: rows ``chunk(range(P), R)[g]``,
    columns ``chunk(range(Q), T)[t]``; None: rows ``chunk(range(P), R)[g]``, all columns.

    Raises:
        ValueError: ``full`` is not 2-D, or ``partition_dim`` is not 0, 1 or None.
    """
    if full.dim() != 2:
        raise ValueError(f"local_shard: full tensor has shape {tuple(full.shape)}, expected a (P, Q) matrix")
    pd = _check_pd(partition_dim, 0)
    r0, nr, c0, nc = block(tuple(full.shape), pd, domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank)
    return full.narrow(0, r0, nr).narrow(1, c0, nc)


def _replay_key(plan: dict | None, fused: bool, shards: Sequence[Tensor], homes: Sequence[int],
                partition_dims: Sequence[int | None], full_shapes: Sequence[tuple[int, int]], domain: Domain,
                *extra: object) -> tuple | None:
    """[Note: replayed routes] A fused call that repeats the last validated call on ``plan`` exactly (every input
    the validation and the route read: homes, layouts, shard shapes, dtypes and devices, the domain with its groups,
    and ``extra``) replays that call's route without validating again: a runtime exchanges the same params step after
    step, and the layout rule need not run per step. Anything that differs takes the checked path, whose errors are
    unchanged. ``None``: no replay (no plan, or the two-stage path)."""
    if plan is None or not fused:
        return None
    return (tuple(homes), tuple(partition_dims), tuple(tuple(f) for f in full_shapes),
            tuple((tuple(x.shape), x.dtype, x.device) for x in shards), domain, extra)


def _domain_plan(plan: dict | None, fused: bool, p: _Params, domain: Domain) -> None:
    """Tie ``plan`` to one (params, homes, layout, grid, fused) combination; raise if reused for another."""
    if plan is None:
        return
    grid = (domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank)
    sig = (
        ("fused", bool(fused)),
        ("grid", grid),
        ("homes", p.homes),
        ("partition_dims", p.pds),
        ("full_shapes", p.full),
    )
    old = plan.setdefault("domain", sig)
    if old != sig:
        raise ValueError(f"reused plan does not match this call: {_mismatch(old, sig)}")


def to_homes(
    shards: Sequence[Tensor],
    homes: Sequence[int],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    *,
    fused: bool,
    plan: dict | None = None,
    buffers: dict | None = None,
) -> tuple[list[Tensor], list[int]]:
    """Assemble every Muon matrix on its NS home from the domain's shards.

    Args:
        shards: this rank's block of each param (``local_shard`` layout; may be non-contiguous), one dtype.
        homes: flat home index ``g*T + t`` of each param.
        partition_dims: TP partition dim of each param: 0, 1 or None.
        full_shapes: full ``(P, Q)`` of each param.
        domain: this rank's :class:`~overlap_muon._domain.Domain`.
        fused: True: one ``all_to_all_single`` over ``domain.flat_group``; the home assembles each matrix from
            its R*T blocks (for partition_dim None from the R ranks with its ``t``). False: two seed stages,
            stage 1 over ``remat_group`` along dim 0 to the home's ``g`` (None-partition params only in the remat
            group with the home's ``t``), stage 2 over ``tp_group`` along the partition dim to the home's ``t``
            (only params homed on this rank's ``g``, none of partition None). A stage with no participating
            param or a trivial group issues no collective, so at most 2 collectives.
        plan: optional dict caching the metadata, one per (set of params, fused); also valid for
            :func:`from_homes` with the same params. Reuse with a different call raises ``ValueError``; with
            ``fused``, a call identical to the last validated one replays its route ([Note: replayed routes]).

    Returns:
        ``(matrices, indices)``: the contiguous full ``(P, Q)`` tensors (shards' dtype) of the params homed on this
        rank and their indices, ascending. Both modes give bit-identical matrices.

    Raises:
        ValueError (before any collective): length mismatches, a home outside ``[0, R*T)``, a partition dim not in
        {0, 1, None}, a shard shape that is not this rank's block, mixed dtypes, a missing group, a plan mismatch.
    """
    key = _replay_key(plan, fused, shards, homes, partition_dims, full_shapes, domain)
    if key is not None and plan.get("replay_to", (None,))[0] == key:
        route, mine, meta, hops = plan["replay_to"][1]  # [Note: replayed routes]
        return _execute(route, shards, domain.flat_group, *meta, buffers, hops), list(mine)
    needs = "flat" if fused else "stages"
    p = _check_domain_inputs("to_homes", shards, homes, partition_dims, full_shapes, domain, needs)
    _domain_plan(plan, fused, p, domain)
    R, T, g, t = domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank
    me = domain.flat_rank
    shapes = tuple(tuple(x.shape) for x in shards)
    if fused:
        mine = [i for i, h in enumerate(p.homes) if h == me]
        if R * T == 1 or not shards:
            return [shards[i].contiguous() for i in mine], mine
        sig = (("op", "fused_to"),)
        route = _cached(plan, "fused_to", sig, lambda sig: _fused_to(sig, p, domain))
        hops = _hops(plan, "nodes_to", route, domain, lambda at: _to_sends(p, at).splits)
        if key is not None:
            plan["replay_to"] = (key, (route, tuple(mine), (p.dtype, p.device), hops))
        return _execute(route, shards, domain.flat_group, p.dtype, p.device, buffers, hops), mine
    meta = (p.dtype, p.device)
    coords = [divmod(h, T) for h in p.homes]
    # Stage 1, over the remat group: rows to the home's g. A None-partition param moves only in the remat group
    # of its home's t (its TP peers hold copies).
    a1 = [i for i in range(len(shards)) if p.pds[i] is not None or coords[i][1] == t]
    res1, got = _route_to(
        [shards[i] for i in a1],
        tuple(shapes[i] for i in a1),
        tuple(coords[i][0] for i in a1),
        (0,) * len(a1),
        tuple(_remat_length(p.full[i], p.pds[i], T, t) for i in a1),
        domain.remat_group,
        R,
        g,
        meta,
        _sub_plan(plan, "remat"),
    )
    got1 = [a1[j] for j in got]  # params homed on this g, each now a full TP block (or, None, the full matrix)
    # Stage 2, over the TP group: TP blocks of the params homed on this g to the home's t.
    a2 = [k for k, i in enumerate(got1) if p.pds[i] is not None]
    ids2 = [got1[k] for k in a2]
    res2, got2 = _route_to(
        [res1[k] for k in a2],
        tuple(tuple(res1[k].shape) for k in a2),
        tuple(coords[i][1] for i in ids2),
        tuple(p.pds[i] for i in ids2),
        tuple(p.full[i][p.pds[i]] for i in ids2),
        domain.tp_group,
        T,
        t,
        meta,
        _sub_plan(plan, "tp"),
    )
    done = {ids2[j]: x for j, x in zip(got2, res2)}
    done.update((i, res1[k]) for k, i in enumerate(got1) if p.pds[i] is None)
    mine = sorted(done)
    return [done[i] for i in mine], mine


def _remat_length(full: tuple[int, int], pd: int | None, T: int, t: int) -> int:
    """Rows a remat group of TP rank ``t`` splits: TP block ``t``'s rows for partition 0, else all ``P``."""
    return block_shape(full, 0, 1, T, 0, t)[0] if pd == 0 else full[0]


def _hops(plan: dict | None, key: str, route: _Route, domain: Domain, mate_sends) -> TwoHops | None:
    """The fused ``route``'s two-hop transport where ``domain`` spans nodes ([Note: node-aware exchange] in
    ``overlap_muon/_domain.py``), cached in ``plan`` beside the route; ``None``: one flat ``all_to_all``."""
    if domain.nodes is None:
        return None
    got = None if plan is None else plan.get(key)
    if got is None or got[0] is not route or got[1].groups is not domain.nodes:
        got = (route, two_hops(route, domain, mate_sends))
        if plan is not None:
            plan[key] = got
    return got[1]


def _sub_plan(plan: dict | None, key: str) -> dict | None:
    return None if plan is None else plan.setdefault(key, {})


def _to_sends(p: _Params, domain: Domain) -> _Packer:
    """What the rank at ``domain``'s coordinates sends in a fused ``to_homes`` (its route's send side alone: the
    node-aware exchange reads its node-mates' splits from it)."""
    R, T, t, W = domain.remat_size, domain.tp_size, domain.tp_rank, domain.size
    by_home = params_by_home(len(p.homes), p.homes, W)
    send = _Packer(W)
    for h in range(W):
        for i in by_home[h]:
            if p.pds[i] is None and h % T != t:  # None: only the home's TP column sends (peers hold copies)
                continue
            b = block(p.full[i], p.pds[i], R, T, domain.remat_rank, t)
            send.add(h, i, (b[1], b[3]), ())
    return send


def _fused_to(sig: tuple, p: _Params, domain: Domain) -> _Route:
    R, T, t, W, me = domain.remat_size, domain.tp_size, domain.tp_rank, domain.size, domain.flat_rank
    by_home = params_by_home(len(p.homes), p.homes, W)
    send = _to_sends(p, domain)
    recv = _Packer(W)
    pieces: dict[int, list[_Piece]] = {i: [] for i in by_home[me]}
    for s in range(W):
        gs, ts = divmod(s, T)
        for i in by_home[me]:
            if p.pds[i] is None and ts != t:
                continue
            b = block(p.full[i], p.pds[i], R, T, gs, ts)
            piece = recv.add(s, i, (b[1], b[3]), _block_region(b))
            if piece is not None:
                pieces[i].append(piece)
    outs = tuple(_Out(p.full[i], None, tuple(pieces[i])) for i in by_home[me])
    return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)


def from_homes(
    ns_results: Sequence[Tensor],
    my_indices: Sequence[int],
    shards: Sequence[Tensor],
    homes: Sequence[int],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    *,
    fused: bool,
    plan: dict | None = None,
    dtype: torch.dtype | None = None,
    serve: Sequence[frozenset[int]] | None = None,
    buffers: dict | None = None,
) -> list[Tensor]:
    """Scatter the homes' full results back: every rank gets its block of every param (inverse of :func:`to_homes`).

    Args:
        ns_results: full ``(P, Q)`` results of the params homed on this rank, ordered like ``my_indices``.
        my_indices: the indices :func:`to_homes` returned on this rank.
        shards, homes, partition_dims, full_shapes, domain, plan: as in :func:`to_homes`; only the shapes (and,
            without ``dtype``, the dtype) of ``shards`` are read.
        fused: True: one ``all_to_all_single`` over ``flat_group``. False: stage 2 reversed over ``tp_group``
            (the home's TP blocks to its TP peers; for partition None a full copy to every peer), then stage 1
            reversed over ``remat_group`` along dim 0. At most 2 collectives.
        dtype: dtype of the results and the transport; every rank must agree, so it defaults to the shards'
            dtype. Pass it when the NS results have another dtype.
        serve: fused only: per param, the flat ranks its home sends a block to (``None``: all). A rank outside a
            param's set gets an empty tensor for it. With a param listed once per duplicate home
            (``surplus="duplicate"``), each copy serves its own ranks and every rank is served once.

    Returns:
        One tensor per param: this rank's block (shape ``shards[i].shape``, dtype ``dtype``); for partition None
        every TP peer gets its row block. See [Note: results may alias].

    Raises:
        ValueError (before any collective): as :func:`to_homes`, and ``ns_results`` not matching ``my_indices``
        (count, indices, a shape that is not the full shape, a dtype).
    """
    key = _replay_key(plan, fused, shards, homes, partition_dims, full_shapes, domain, tuple(my_indices),
                      tuple((tuple(r.shape), r.dtype) for r in ns_results), dtype,
                      None if serve is None else tuple(frozenset(x) for x in serve))
    if key is not None and plan.get("replay_from", (None,))[0] == key:
        route, meta, hops = plan["replay_from"][1]  # [Note: replayed routes]
        return _execute(route, ns_results, domain.flat_group, *meta, buffers, hops)
    needs = "flat" if fused else "stages"
    p = _check_domain_inputs("from_homes", shards, homes, partition_dims, full_shapes, domain, needs)
    if serve is not None and (not fused or len(serve) != len(shards)):
        raise ValueError(f"from_homes: serve needs fused=True and one rank set per param ({len(shards)}), got "
                         f"fused={fused} and {len(serve)}")
    dtype = dtype if dtype is not None else p.dtype
    R, T, g, t, me = domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank, domain.flat_rank
    mine = [i for i, h in enumerate(p.homes) if h == me]
    _check_results(ns_results, my_indices, mine, p.full, dtype, "the param's full_shapes entry")
    _domain_plan(plan, fused, p, domain)
    shapes = tuple(tuple(x.shape) for x in shards)
    if fused:
        if R * T == 1 or not shards:
            return list(ns_results)
        sig = (("op", "fused_from"), ("serve", None if serve is None else tuple(tuple(sorted(x)) for x in serve)))
        route = _cached(plan, "fused_from", sig, lambda sig: _fused_from(sig, p, domain, serve))
        hops = _hops(plan, "nodes_from", route, domain, lambda at: _from_sends(p, at, serve).splits)
        if key is not None:
            plan["replay_from"] = (key, (route, (dtype, p.device), hops))
        return _execute(route, ns_results, domain.flat_group, dtype, p.device, buffers, hops)
    coords = [divmod(h, T) for h in p.homes]
    # Stage 2 reversed, over the TP group: the home sends each TP peer its TP block (None: a full copy, since
    # every peer then scatters rows in its own remat group).
    b2 = [i for i in range(len(shards)) if coords[i][0] == g]
    shapes2 = []
    for i in b2:
        P, Q = p.full[i]
        # the TP block (the whole matrix for partition None): the layout rule with R = 1
        shapes2.append(block_shape((P, Q), p.pds[i], 1, T, 0, t) if p.pds[i] is not None else (P, Q))
    out2 = _route_from(
        list(ns_results),
        [j for j, i in enumerate(b2) if coords[i][1] == t],
        tuple(shapes2),
        tuple(coords[i][1] for i in b2),
        tuple(p.pds[i] for i in b2),
        tuple(None if p.pds[i] is None else p.full[i][p.pds[i]] for i in b2),
        domain.tp_group,
        T,
        t,
        dtype,
        p.device,
        _sub_plan(plan, "tp"),
    )
    # Stage 1 reversed, over the remat group: rows from the home's g to every g.
    return _route_from(
        out2,
        b2,
        shapes,
        tuple(c[0] for c in coords),
        (0,) * len(shapes),
        tuple(_remat_length(f, pd, T, t) for f, pd in zip(p.full, p.pds)),
        domain.remat_group,
        R,
        g,
        dtype,
        p.device,
        _sub_plan(plan, "remat"),
    )


def _from_sends(p: _Params, domain: Domain, serve: Sequence[frozenset[int]] | None = None) -> _Packer:
    """What the rank at ``domain``'s coordinates sends in a fused ``from_homes`` (the send side alone)."""
    R, T, W, me = domain.remat_size, domain.tp_size, domain.size, domain.flat_rank
    mine = [i for i, h in enumerate(p.homes) if h == me]
    send = _Packer(W)
    for d in range(W):
        gd, td = divmod(d, T)
        for k, i in enumerate(mine):
            if serve is not None and d not in serve[i]:
                continue
            b = block(p.full[i], p.pds[i], R, T, gd, td)
            send.add(d, k, (b[1], b[3]), _block_region(b))
    return send


def _fused_from(sig: tuple, p: _Params, domain: Domain, serve: Sequence[frozenset[int]] | None = None) -> _Route:
    R, T, W, me = domain.remat_size, domain.tp_size, domain.size, domain.flat_rank
    by_home = params_by_home(len(p.homes), p.homes, W)
    send = _from_sends(p, domain, serve)
    recv = _Packer(W)
    outs: list[_Out | None] = [None] * len(p.homes)
    for s in range(W):
        for i in by_home[s]:
            if serve is not None and me not in serve[i]:
                outs[i] = _Out((0, 0), None, ())  # served by another copy of the param
                continue
            b = block(p.full[i], p.pds[i], R, T, domain.remat_rank, domain.tp_rank)
            piece = recv.add(s, i, (b[1], b[3]), ())
            outs[i] = _Out((b[1], b[3]), None, () if piece is None else (piece,))
    return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), tuple(outs))
