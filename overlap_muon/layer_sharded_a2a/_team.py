"""Team layout: every matrix re-laid between the shard layout and the team NS layout, and back.

``to_team`` / ``from_team`` move every matrix between the shard layout (``local_shard``) and the team NS layout
(each rank one block of the long dim, ``team_block``), one ``all_to_all_single`` each (``overlap_muon._team_ns``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from overlap_muon._domain import Domain

from overlap_muon._layout import block, chunk_offsets, chunk_sizes

from ._checks import _check_domain_inputs, _check_full_shape, _check_pd, _common_dtype
from ._route import _cached, _execute, _Out, _Packer, _Piece, _Region, _Route


# ----------------------------------------------------------------------------------------------------------------
# Team layout: the long dim split over the whole domain (overlap_muon._team_ns).
# ----------------------------------------------------------------------------------------------------------------


def team_block(full_shape: tuple[int, int], size: int, member: int) -> tuple[int, int, int, int]:
    """``(row0, rows, col0, cols)`` of team member ``member``'s block of a ``(P, Q)`` matrix split over ``size``.

    NS runs on the oriented matrix (``(P, Q)``, or its transpose when ``P > Q``), whose columns are the long dim; a
    team splits them (``torch.chunk`` sizes), so a member holds all ``P`` rows and a column block of a wide or
    square matrix, or a row block and all ``Q`` columns of a tall one. See [Note: team NS by columns] in
    ``overlap_muon/_team_ns.py``.
    """
    P, Q = full_shape
    if P > Q:
        return chunk_offsets(P, size)[member], chunk_sizes(P, size)[member], 0, Q
    return 0, P, chunk_offsets(Q, size)[member], chunk_sizes(Q, size)[member]


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The intersection of two ``(row0, rows, col0, cols)`` rectangles, ``None`` when empty."""
    r0, c0 = max(a[0], b[0]), max(a[2], b[2])
    r1, c1 = min(a[0] + a[1], b[0] + b[1]), min(a[2] + a[3], b[2] + b[3])
    return (r0, r1 - r0, c0, c1 - c0) if r1 > r0 and c1 > c0 else None


def _within(x: tuple[int, int, int, int], outer: tuple[int, int, int, int]) -> _Region:
    """The region of rectangle ``x`` inside the tensor that holds rectangle ``outer``."""
    return ((0, x[0] - outer[0], x[1]), (1, x[2] - outer[2], x[3]))


def _relayout(what: str, inputs: Sequence[Tensor], pds: Sequence[int | None], fulls: Sequence[tuple[int, int]],
              domain: Domain, to_team_layout: bool, dtype: torch.dtype, device: torch.device,
              plan: dict | None) -> list[Tensor]:
    """One ``all_to_all_single`` over the flat group moving every matrix between the shard and team layouts."""
    R, T, W = domain.remat_size, domain.tp_size, domain.size
    me = domain.flat_rank
    sig = (("op", what), ("grid", (R, T, me)), ("partition_dims", tuple(pds)), ("full_shapes", tuple(fulls)))

    def src(i: int, f: int) -> tuple[int, int, int, int] | None:
        """The rectangle of matrix ``i`` that rank ``f`` sends from (``None``: it sends none)."""
        if not to_team_layout:
            return team_block(fulls[i], W, f)
        if pds[i] is None and f % T != 0:  # partition_dim None: TP ranks hold copies; the t = 0 copy is sent
            return None
        return block(fulls[i], pds[i], R, T, *divmod(f, T))

    def dst(i: int, f: int) -> tuple[int, int, int, int]:
        """The rectangle of matrix ``i`` that rank ``f`` receives into."""
        return team_block(fulls[i], W, f) if to_team_layout else block(fulls[i], pds[i], R, T, *divmod(f, T))

    def build(sig: tuple) -> _Route:
        send, recv = _Packer(W), _Packer(W)
        pieces: list[list[_Piece]] = [[] for _ in fulls]
        for f in range(W):  # _Packer wants peers in increasing order
            for i in range(len(fulls)):
                mine = src(i, me)
                x = _overlap(mine, dst(i, f)) if mine is not None else None
                if x is not None:
                    send.add(f, i, (x[1], x[3]), _within(x, mine))
        for f in range(W):
            for i in range(len(fulls)):
                theirs, mine = src(i, f), dst(i, me)
                x = _overlap(theirs, mine) if theirs is not None else None
                p = recv.add(f, i, (x[1], x[3]), _within(x, mine)) if x is not None else None
                if p is not None:
                    pieces[i].append(p)
        outs = tuple(_Out((dst(i, me)[1], dst(i, me)[3]), None, tuple(pieces[i])) for i in range(len(fulls)))
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)

    route = _cached(plan, what, sig, build)
    return _execute(route, inputs, domain.flat_group, dtype, device)


def to_team(
    shards: Sequence[Tensor],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    plan: dict | None = None,
) -> list[Tensor]:
    """Every rank's :func:`team_block` of every matrix, from the ranks' shards: one ``all_to_all_single``.

    Each rank sends each peer the part of its block (:func:`local_shard` layout) that falls in the peer's team
    block; for ``partition_dim`` None only the TP-rank-0 copies are sent. A pure copy: exact for every dtype.

    Args:
        shards: this rank's block of each ``(P, Q)`` matrix, one dtype.
        partition_dims, full_shapes: per matrix, as :func:`to_homes`.
        domain: the ``R x T`` domain; the flat group carries the exchange.
        plan: a caller-owned cache of the exchange's metadata (key ``"to_team"``); reusing it for another layout
            is a ``ValueError``.

    Returns:
        Per matrix, this rank's team block (``(rows, cols)`` of :func:`team_block` with the flat rank as member),
        contiguous, the shards' dtype.

    Raises:
        ValueError (before any collective): as :func:`all_gather_full`.
    """
    p = _check_domain_inputs("to_team", shards, None, partition_dims, full_shapes, domain, "flat")
    if domain.size == 1 or not shards:
        return [x.contiguous() for x in shards]
    return _relayout("to_team", shards, p.pds, p.full, domain, True, p.dtype, p.device, plan)


def from_team(
    blocks: Sequence[Tensor],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    plan: dict | None = None,
) -> list[Tensor]:
    """The inverse of :func:`to_team`: every rank's shard (:func:`local_shard` layout) of every matrix, from the
    ranks' team blocks; for ``partition_dim`` None every TP rank gets its copy. One ``all_to_all_single``.

    Args:
        blocks: this rank's :func:`team_block` of each matrix (the flat rank as member), one dtype.
        partition_dims, full_shapes, domain, plan: as :func:`to_team` (plan key ``"from_team"``).

    Returns:
        Per matrix, this rank's block, contiguous, the blocks' dtype.

    Raises:
        ValueError (before any collective): length mismatches, a bad partition dim or full shape, a block that is
            not this rank's team block, mixed dtypes, a missing flat group.
    """
    n = len(blocks)
    if len(partition_dims) != n or len(full_shapes) != n:
        raise ValueError(f"from_team: {n} blocks, {len(partition_dims)} partition_dims, {len(full_shapes)} "
                         "full_shapes; expected one of each per matrix")
    W = domain.size
    if W > 1 and (domain.flat_group is None or dist.get_world_size(domain.flat_group) != W):
        raise ValueError(f"from_team: the {domain.remat_size}x{domain.tp_size} domain needs a flat_group of size {W}")
    meta = _common_dtype(blocks, "blocks")
    pds, fulls = [], []
    for i, x in enumerate(blocks):
        pds.append(_check_pd(partition_dims[i], i))
        fulls.append(_check_full_shape(full_shapes[i], i))
        _, nr, _, nc = team_block(fulls[i], W, domain.flat_rank)
        if tuple(x.shape) != (nr, nc):
            raise ValueError(f"from_team: block {i} has shape {tuple(x.shape)}, expected {(nr, nc)}: member "
                             f"{domain.flat_rank}'s team block of {fulls[i]} over {W} ranks")
    if W == 1 or not blocks:
        return [x.contiguous() for x in blocks]
    return _relayout("from_team", blocks, pds, fulls, domain, False, *meta, plan)
