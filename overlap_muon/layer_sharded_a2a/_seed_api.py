"""The seed API of the routing: one exchange over one process group.

``params_by_home``, ``route_to_ns_home``, ``route_from_ns_home`` are axis-generic: one exchange over one process
group along one ``shard_dim`` per param. The caller runs it once over the remat group (dim 0) and once over the TP
group (along the partition dim); the domain API's two-stage path (``_domain_exchange.py``) does exactly that.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor
from torch.distributed import ProcessGroup

from overlap_muon._layout import chunk_offsets, chunk_sizes

from ._checks import (
    _as_int,
    _check_results,
    _common_dtype,
    _full_lengths,
    _group_coords,
    _homes,
    _shape,
    _shard_dims,
)
from ._route import _cached, _execute, _Out, _Packer, _Piece, _replace, _Route


# ----------------------------------------------------------------------------------------------------------------
# Seed API: one exchange over one group.
# ----------------------------------------------------------------------------------------------------------------


def _full_shape(shape: tuple[int, ...], dim: int | None, full: int | None) -> tuple[int, ...]:
    return shape if dim is None else _replace(shape, dim, full)


def _signature(op, size, rank, shapes, homes, dims, fulls) -> tuple:
    """Everything the metadata of a seed-level exchange depends on (dtype is not: splits count elements)."""
    return (
        ("op", op),
        ("group", (size, rank)),
        ("shapes", shapes),
        ("homes", homes),
        ("shard_dims", dims),
        ("dim_sizes", fulls),
    )


def params_by_home(num_params: int, home_of: dict, size: int) -> list[list[int]]:
    """Group param indices by their NS home rank in the group.

    Args:
        num_params: number of params ``n``; indices ``0 .. n-1``.
        home_of: ``{param index: home rank}`` (a sequence indexed by param also works). Must cover every index;
            extra keys are ignored.
        size: group size ``S``.

    Returns:
        ``result[r]``: the params homed on rank ``r`` in increasing index order, the order every exchange uses.
        Ranks with no params get empty lists.

    Raises:
        ValueError: an index has no home, or a home is not an int in ``[0, size)``.
    """
    size = _as_int(size, "size")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    result: list[list[int]] = [[] for _ in range(size)]
    for i, h in enumerate(_homes(home_of, _as_int(num_params, "num_params"), size, None)):
        result[h].append(i)
    return result


def route_to_ns_home(
    momentum_list: list[Tensor],
    param_to_home_rank: dict,
    group: ProcessGroup | None,
    shard_dim: int | None | Sequence[int | None] = 0,
    plan: dict | None = None,
    *,
    dim_sizes: Sequence[int | None] | None = None,
) -> tuple[list[Tensor], list[int]]:
    """Forward all_to_all for layer sharding: redistribute momentum shards so each home has complete tensors.

    Every rank of ``group`` holds its shard of every param; after the call each rank holds the complete tensors
    of the params homed on it. One ``dist.all_to_all_single`` (uint8 transport, see module notes) when the group
    has more than one rank and there is at least one param; none otherwise.

    Args:
        momentum_list: ``n`` tensors, one per param, all of one dtype and device; ``momentum_list[i]`` is this
            rank's shard, e.g. ``(P_i / S, Q_i)`` for ``shard_dim=0``. Non-contiguous views are fine.
        param_to_home_rank: ``{i: home group rank}`` covering every ``i < n``.
        group: the process group of the exchange; ``None`` or size 1 means no communication.
        shard_dim: the dim the shards split: an int (negative allowed), ``None`` (replicated: every rank holds
            the whole tensor, the home uses its own copy and nobody sends), or a per-param sequence of those.
        plan: optional mutable dict caching the routing metadata under key ``"to"`` (the same dict may also be
            passed to :func:`route_from_ns_home`, which uses key ``"from"``). Filled on the first call, reused
            later; a reused plan that does not match the call raises ``ValueError``.
        dim_sizes: per-param full length along ``shard_dim`` within the group, for uneven shards following
            ``torch.chunk`` rules (``chunk_sizes``); ``None`` (or a ``None`` entry) means even shards
            (local length x S). Ignored for replicated params.

    Returns:
        ``(complete, my_param_indices)``: ``complete[k]`` is the contiguous full tensor of param
        ``my_param_indices[k]`` (pieces from every group rank concatenated along ``shard_dim`` in source-rank
        order, dtype of the inputs); indices ascend. See [Note: results may alias].

    Raises:
        ValueError (before any collective): a param has no home or a home outside ``[0, S)``; mixed dtypes or
            devices; a bad ``shard_dim``; a shard whose length disagrees with ``dim_sizes``' chunk rule; a reused
            plan that does not match.
    """
    shapes = tuple(_shape(x) for x in momentum_list)
    size, rank = _group_coords(group, "route_to_ns_home")
    dims = _shard_dims(shard_dim, shapes)
    homes = _homes(param_to_home_rank, len(shapes), size, shapes)
    meta = _common_dtype(momentum_list, "momentum_list")
    fulls = _full_lengths(shapes, dims, dim_sizes, size, rank)
    return _route_to(momentum_list, shapes, homes, dims, fulls, group, size, rank, meta, plan)


def _route_to(tensors, shapes, homes, dims, fulls, group, size, rank, meta, plan):
    """route_to_ns_home on validated inputs (also the stages of the domain API)."""
    mine = [i for i, h in enumerate(homes) if h == rank]
    if size == 1 or not tensors:
        return [tensors[i].contiguous() for i in mine], mine
    sig = _signature("to", size, rank, shapes, homes, dims, fulls)

    def build(sig: tuple) -> _Route:
        by_home = params_by_home(len(shapes), homes, size)
        send = _Packer(size)
        for h in range(size):
            for i in by_home[h]:
                if dims[i] is not None:  # replicated: the home already has it
                    send.add(h, i, shapes[i], ())
        recv = _Packer(size)
        pieces: dict[int, list[_Piece]] = {i: [] for i in mine}
        for s in range(size):
            for i in mine:
                d = dims[i]
                if d is None:
                    continue
                length, start = chunk_sizes(fulls[i], size)[s], chunk_offsets(fulls[i], size)[s]
                p = recv.add(s, i, _replace(shapes[i], d, length), ((d, start, length),))
                if p is not None:
                    pieces[i].append(p)
        outs = tuple(
            _Out(shapes[i], i, ())  # replicated: the home's own copy
            if dims[i] is None
            else _Out(_full_shape(shapes[i], dims[i], fulls[i]), None, tuple(pieces[i]))
            for i in mine
        )
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)

    route = _cached(plan, "to", sig, build)
    return _execute(route, tensors, group, *meta), mine


def route_from_ns_home(
    ns_results: list[Tensor],
    my_param_indices: list[int],
    momentum_list: list[Tensor],
    param_to_home_rank: dict,
    group: ProcessGroup | None,
    shard_dim: int | None | Sequence[int | None] = 0,
    plan: dict | None = None,
    *,
    dim_sizes: Sequence[int | None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[Tensor | None]:
    """Backward all_to_all for layer sharding: distribute the homes' NS results back as shards.

    The inverse of :func:`route_to_ns_home`: each home holds complete results for its params; after the call every
    rank holds its shard of every param (for a replicated param, the whole tensor: the home sends a full copy to
    every other rank). Same collective count as :func:`route_to_ns_home`.

    Args:
        ns_results: complete results of the params homed on this rank, ordered like ``my_param_indices``; each
            has the full shape of its param (the local shape with ``shard_dim`` set to the full length).
        my_param_indices: the indices :func:`route_to_ns_home` returned here (params homed on this rank,
            ascending).
        momentum_list: this rank's shard of every param (``n`` entries); only shapes (and, if ``dtype`` is not
            given, the dtype) are read.
        param_to_home_rank, group, shard_dim, plan, dim_sizes: as in :func:`route_to_ns_home` (``plan`` key
            ``"from"``).
        dtype: dtype of the results and of the transport. Every rank must agree on it, including ranks that
            own no param, so it defaults to the (common) dtype of ``momentum_list``; pass it when the NS results
            have another dtype (e.g. bf16 results for fp32 momentum).

    Returns:
        ``n`` tensors: entry ``i`` is this rank's shard of param ``i`` (shape ``momentum_list[i].shape``, dtype
        ``dtype``). No entry is ``None`` here (the annotation is the seed's). See [Note: results may alias].

    Raises:
        ValueError (before any collective): as :func:`route_to_ns_home`, and ``ns_results`` not matching
            ``my_param_indices`` (count, indices, a shape or a dtype).
    """
    shapes = tuple(_shape(x) for x in momentum_list)
    size, rank = _group_coords(group, "route_from_ns_home")
    dims = _shard_dims(shard_dim, shapes)
    homes = _homes(param_to_home_rank, len(shapes), size, shapes)
    meta = _common_dtype(momentum_list, "momentum_list")
    if dtype is None and meta is not None:
        dtype = meta[0]
    device = meta[1] if meta is not None else None
    fulls = _full_lengths(shapes, dims, dim_sizes, size, rank)
    return _route_from(
        ns_results, my_param_indices, shapes, homes, dims, fulls, group, size, rank, dtype, device, plan
    )


def _route_from(ns_results, my_param_indices, shapes, homes, dims, fulls, group, size, rank, dtype, device, plan):
    """route_from_ns_home on validated inputs (also the stages of the domain API)."""
    mine = [i for i, h in enumerate(homes) if h == rank]
    full_shapes = [_full_shape(s, d, f) for s, d, f in zip(shapes, dims, fulls)]
    _check_results(ns_results, my_param_indices, mine, full_shapes, dtype, "local shape with shard_dim at full length")
    if ns_results and ns_results[0].device != device:
        raise ValueError(f"ns_results[0] is on {ns_results[0].device}, expected {device} like the shards")
    if size == 1 or not shapes:
        return list(ns_results)
    sig = _signature("from", size, rank, shapes, homes, dims, fulls)

    def build(sig: tuple) -> _Route:
        by_home = params_by_home(len(shapes), homes, size)
        send = _Packer(size)
        for dst in range(size):
            for k, i in enumerate(mine):
                d = dims[i]
                if d is None:
                    if dst != rank:  # replicated: a full copy to every other rank
                        send.add(dst, k, full_shapes[i], ())
                    continue
                length, start = chunk_sizes(fulls[i], size)[dst], chunk_offsets(fulls[i], size)[dst]
                send.add(dst, k, _replace(full_shapes[i], d, length), ((d, start, length),))
        recv = _Packer(size)
        outs: list[_Out | None] = [None] * len(shapes)
        for src in range(size):
            for k, i in enumerate(by_home[src]):
                if dims[i] is None and src == rank:
                    outs[i] = _Out(shapes[i], k, ())  # the home keeps its own result
                    continue
                p = recv.add(src, i, shapes[i], ())
                outs[i] = _Out(shapes[i], None, () if p is None else (p,))
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), tuple(outs))

    route = _cached(plan, "from", sig, build)
    return _execute(route, ns_results, group, dtype, device)
