"""Team Newton-Schulz: ``k`` ranks of a process group share one matrix's NS.

[Note: team NS by columns] ``torch.optim.Muon``'s iteration on the oriented ``X`` (``(m, n)``, ``m <= n``: tall
matrices are transposed first) is ``A = X Xᵀ; B = b*A + c*A@A; X = a*X + B@X``. Split ``X`` by columns (the long
dim) over the team, member ``j`` holding ``X_j`` (``(m, n_j)``, ``torch.chunk`` sizes). Then::

    A   = sum_j X_j @ X_jᵀ                  # (m, m): each member's partial Gram, one all_reduce over the team
    B   = addmm(A, A, A, beta=b, alpha=c)   # (m, m): every member computes it whole, from the same A
    X_j = addmm(X_j, B, X_j, beta=a)        # (m, n_j): local, no communication

so per step a member does ``n_j / n`` of the two large products (``2 m^2 n`` multiply-adds each) plus the small
``m^3`` one, and the team all-reduces one ``m x m`` Gram: ``m/n`` of the matrix, far less than gathering it. Where
``m^3`` is not small (square matrices: a third of the FLOPs), each member can compute only its row block of ``B``
and the team all-gathers it (``split_poly``; ``scheduler.surplus.team_splits_poly`` weighs the FLOPs against the
extra collective). No member ever needs the whole ``X``: the runtime re-lays the shards straight into these column
blocks and back (``layer_sharded_a2a.to_team`` / ``from_team``), so a team wave has no home and no gather. The norm
is the square root of the all-reduced sum of squares of the blocks (:func:`team_norms`), rounded to bf16 as
``X.norm()`` rounds it.

Exactness: NOT bitwise. Each member's partial Gram is rounded to bf16 before the sum, where the reference rounds
the full-length fp32 sum once (on a team of more than 2 the all-reduce also rounds between hops), and the norm sums
in another order. For the matrices a team gets (hundreds of rows and more) it is as accurate as the bitwise path:
against NS in float64 (what both approximate) its error is at most 1.25x the bitwise path's own (measured at most
1.17x at 333 to 640 rows; ``tests/test_team_ns.py``); tiny matrices do worse (up to 2.9x below 64 rows, measured by
a break test over 20 seeds). How far the two are from each other depends on the input: about 1% (relative
Frobenius) for a full-rank matrix, up to about 23% for a low-rank one (a gradient of rank 1 to 16), where bf16 NS
amplifies rounding noise outside the input's span and the bitwise path itself is 40% to 164% away from float64.
So the per-step update bound of ``tests/test_surplus.py`` (``lr * ratio * 2**-7``) holds for full-rank gradients
only. The bench's ``surplus`` case reports the difference with the latency.

A ``None`` or size-1 group does no communication (one code path for world size 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from ._layout import team_row_counts

from ._ns import DEFAULT_NS_COEFFICIENTS, SYRK_BLOCK, Coefficients, _check_block, _schedule, sym_gram, sym_poly

__all__ = ["team_zeropower_full", "team_zeropower_blocks", "team_zeropower_oriented", "team_norms",
           "team_row_counts"]


def _team(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def team_norms(blocks: Sequence[Tensor], group: dist.ProcessGroup | None) -> list[Tensor]:
    """Frobenius norms of matrices split over a team, each member holding one block of each (a partition).

    Collective over ``group`` (one ``all_reduce`` of a fp32 vector, every member passes as many blocks).

    Args:
        blocks: this member's block of each matrix (any shape and float dtype; cast to bf16 first, as NS casts).

    Returns:
        Per matrix, a 0-dim bf16 tensor: ``sqrt`` of the team-wide fp32 sum of squares, rounded to bf16 like
        ``Tensor.norm`` of a bf16 matrix. The sum of squares adds the squares of the blocks' per-row bf16 norms
        (each an fp32 sum rounded to bf16; torch's bf16 reduction is ~25x faster than an fp32 upcast here): a
        relative error of about ``2**-8 / sqrt(rows)`` (measured 7e-5 at 2048 rows), far below a bf16 ulp, so the
        result is usually, not always, the reference's bf16 norm.
    """
    if not blocks:
        return []
    rows = [b.mT if not b.is_contiguous() and b.mT.is_contiguous() else b for b in blocks]  # read memory in order
    sums = torch.stack([r.bfloat16().norm(dim=-1).float().square().sum() for r in rows])
    if _team(group)[0] > 1:
        dist.all_reduce(sums, group=group)
    return list(sums.sqrt().bfloat16().unbind(0))


def team_zeropower_blocks(
    blocks: Sequence[Tensor],
    norms: Sequence[Tensor],
    group: dist.ProcessGroup | None,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    syrk: bool = False,
    syrk_block: int = SYRK_BLOCK,
    split_poly: bool | Sequence[bool] = False,
) -> list[Tensor]:
    """This member's column block of NS on each of several matrices split by columns; [Note: team NS by columns].

    Collective over ``group``: every member passes the same number of matrices with the same ``m`` each, the same
    coefficients and steps; per NS step one ``all_reduce`` carries the partial Grams of all of them (bf16).

    Args:
        blocks: per matrix, this member's ``(m, n_j)`` column block of the ORIENTED matrix (``m <= n``; the
            transpose of a tall update), any float dtype (cast to bf16 as the reference casts); ``n_j`` may be 0.
        norms: per matrix, the whole matrix's Frobenius norm (0-dim; :func:`team_norms`).
        group: the team; ``None`` or size 1 runs alone.
        ns_coefficients, ns_steps, eps: as :func:`overlap_muon._ns.zeropower`.
        syrk, syrk_block: compute the partial Gram and ``b*A + c*A@A`` as symmetric block products
            (``overlap_muon._ns.sym_gram`` / ``sym_poly``): fewer FLOPs, a further (small) rounding difference.
        split_poly: per matrix (or one for all): each member computes only its row block of ``B = b*A + c*A@A``
            (``team_row_counts(m, k)`` rows, in group-rank order) and the team all-gathers ``B`` (one all-gather
            per step for all such matrices): ``1/k`` of the ``2*m**3`` FLOPs for one more collective
            (``scheduler.surplus.team_splits_poly`` says when that pays).

    Returns:
        Per matrix, bf16 ``(m, n_j)``: this member's columns of the result.

    Raises:
        ValueError: a block is not 2-D, ``norms`` does not match ``blocks``, malformed coefficients, steps or block.
    """
    steps = _schedule(ns_coefficients, ns_steps)
    _check_block(syrk_block)
    if len(norms) != len(blocks) or any(b.ndim != 2 for b in blocks):
        raise ValueError(f"team_zeropower_blocks expects one 2-D (m, n_j) block and one norm per matrix, got shapes "
                         f"{[tuple(b.shape) for b in blocks]} and {len(norms)} norms")
    k, j = _team(group)
    split = [bool(split_poly)] * len(blocks) if isinstance(split_poly, bool) else [bool(f) for f in split_poly]
    if len(split) != len(blocks):
        raise ValueError(f"split_poly has {len(split)} entries for {len(blocks)} matrices")
    split = [f and k > 1 for f in split]
    xs = [b.bfloat16() / nrm.to(torch.bfloat16).clamp(min=eps) for b, nrm in zip(blocks, norms)]
    for a, b, c in steps:
        grams = [sym_gram(x, syrk_block) if syrk else x @ x.mT for x in xs]
        if k > 1 and len(grams) == 1:
            dist.all_reduce(grams[0], group=group)
        elif k > 1 and grams:
            flat = torch.cat([g.reshape(-1) for g in grams])
            dist.all_reduce(flat, group=group)
            grams = [f.view(g.shape) for f, g in zip(flat.split([g.numel() for g in grams]), grams)]
        upds: list[Tensor | None] = [
            None if sp else sym_poly(g, b, c, syrk_block) if syrk else torch.addmm(g, g, g, beta=b, alpha=c)
            for g, sp in zip(grams, split)]
        if any(split):
            _split_poly(grams, split, upds, b, c, k, j, group)
        xs = [torch.addmm(x, u, x, beta=a) for x, u in zip(xs, upds)]
    return xs


def team_zeropower_oriented(blocks: Sequence[Tensor], tall: Sequence[bool], group: dist.ProcessGroup | None,
                            split_poly: Sequence[bool], kw: dict) -> list[Tensor]:
    """:func:`team_zeropower_blocks` of blocks in the stored ``(P, Q)`` layout: a tall matrix's block is the
    transpose of its oriented block (columns of ``X`` are rows of a tall update). ``kw``: its NS options."""
    xs = [b.mT if t else b for b, t in zip(blocks, tall)]
    outs = team_zeropower_blocks(xs, team_norms(xs, group), group, split_poly=split_poly, **kw)
    return [o.mT.contiguous() if t else o for o, t in zip(outs, tall)]


def _split_poly(grams: list[Tensor], split: list[bool], upds: list[Tensor | None], b: float, c: float, k: int,
                j: int, group: dist.ProcessGroup | None) -> None:
    """Fill ``upds[i]`` for the ``split`` matrices: this member's rows of ``b*A + c*A@A`` (``addmm`` on a row
    block), then one all-gather of every member's rows of all of them (flat, padded to the largest member)."""
    idx = [i for i, f in enumerate(split) if f]
    counts = {i: team_row_counts(grams[i].size(0), k) for i in idx}
    mine = []
    for i in idx:
        g, lo = grams[i], sum(counts[i][:j])
        rows = g[lo : lo + counts[i][j]]
        mine.append(torch.addmm(rows, rows, g, beta=b, alpha=c).reshape(-1))
    sizes = [sum(counts[i][r] * grams[i].size(0) for i in idx) for r in range(k)]
    buf = grams[idx[0]].new_zeros(max(sizes))
    torch.cat(mine, out=buf[: sizes[j]])
    parts = [torch.empty_like(buf) for _ in range(k)]
    dist.all_gather(parts, buf, group=group)
    offs = [0] * k
    for i in idx:
        m = grams[i].size(0)
        blocks = []
        for r in range(k):
            n = counts[i][r] * m
            blocks.append(parts[r][offs[r] : offs[r] + n].view(counts[i][r], m))
            offs[r] += n
        upds[i] = torch.cat(blocks, dim=0)


def _gather_rows(block: Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> Tensor:
    """All-gather row blocks of uneven height into the full ``(sum(counts), cols)`` tensor (member order)."""
    k = len(counts)
    if k == 1:
        return block
    cap = max(counts)
    buf = block.new_zeros((cap, block.size(1)))
    buf[: block.size(0)] = block
    parts = [torch.empty_like(buf) for _ in range(k)]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)], dim=0)


def team_zeropower_full(
    X: Tensor,
    group: dist.ProcessGroup | None,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    split_poly: bool = False,
) -> Tensor:
    """NS of a full ``(P, Q)`` matrix that every member of ``group`` holds, shared by the team.

    Orients ``X`` like ``torch.optim.Muon`` (transpose when ``P > Q``); each member normalizes the whole matrix as
    ``zeropower`` does, runs :func:`team_zeropower_blocks` on its column block ([Note: team NS by columns]) and the
    team all-gathers the blocks. Collective over ``group``.

    Args:
        X: ``(P, Q)`` float tensor, the same on every member.
        group: the team; ``None`` or size 1 runs alone.
        ns_coefficients, ns_steps, eps: as :func:`overlap_muon._ns.zeropower`.
        split_poly: also split ``b*A + c*A@A`` by rows (:func:`team_zeropower_blocks`).

    Returns:
        bf16 ``(P, Q)``, the same on every member.

    Raises:
        ValueError: ``X`` is not 2-D; malformed coefficients or steps.
    """
    if X.ndim != 2:
        raise ValueError(f"team_zeropower_full expects a (P, Q) matrix, got shape {tuple(X.shape)}")
    k, j = _team(group)
    tall = X.size(0) > X.size(1)
    x = X.mT if tall else X
    xb = X.bfloat16()
    norm = (xb.mT if tall else xb).norm()  # zeropower's norm, on zeropower's layout: bitwise the same
    counts = team_row_counts(x.size(1), k)  # torch.chunk sizes of the long dim
    lo = sum(counts[:j])
    mine = team_zeropower_blocks([x[:, lo : lo + counts[j]]], [norm], group, ns_coefficients=ns_coefficients,
                                 ns_steps=ns_steps, eps=eps, split_poly=split_poly)[0]
    full = _gather_rows(mine.mT.contiguous(), counts, group).mT  # the column blocks, as rows of the transpose
    return full.mT if tall else full.contiguous()
