"""Newton-Schulz of a sharded matrix in Gram space: no gather (the source document's parked gram_once and Refresh-k).

[Note: sharded Gram NS] Let a matrix be ``X`` (``P x Q``, the Gram side the short one: ``P <= Q``, a tall matrix
is read transposed), split along its long side over a group: rank ``r`` holds ``X_r`` (``P x Q_r``, ``Q_r`` may be
0). Each step of ``torch.optim.Muon``'s iteration is ``X <- p(X Xᵀ) X`` with ``p(R) = aI + bR + cR²``, so every
iterate is ``M X0`` for a ``P x P`` polynomial ``M`` in ``R0 = X0 X0ᵀ = sum_r X_r X_rᵀ``: one all-reduce of the
``P x P`` Gram gives every rank ``R0``, the iteration runs on ``P x P`` matrices, the same on every rank
(``Z = bR + cR²``, ``S = aI + Z``, ``M <- S M``, ``R <- S R S``: ``S`` is a polynomial in ``R`` and commutes with
it), and each rank applies ``M`` to its own block at the end. ``restart_every = k`` re-forms the Gram from the
current blocks every ``k`` steps (``X_r <- M X_r``, ``R <- sum_r X_r X_rᵀ``, ``M <- I``): ``ceil(ns_steps / k)``
all-reduces per matrix; ``k >= ns_steps`` is gram_once, ``k = 1`` re-forms it at every step (Megatron's
distributed mode), ``k = 4`` the source's Refresh-4.

Stability: ``R0`` squares the singular values, so in bf16 the small ones drown in its rounding (the source parked
gram_once for that). Here the blocks are the bf16 NS input as every path has it, but the Gram, its all-reduce, the
normalization (``||X||_F² = tr R0``) and the whole ``P x P`` iteration run in fp32, and ``M`` is applied in fp32
before the one rounding to bf16 of the result. Not bitwise with :func:`overlap_muon._ns.zeropower` (another order of
operations); its error against a float64 NS is measured per shape in ``tests/test_gram_mode.py`` and held there.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._ns import DEFAULT_NS_COEFFICIENTS, Coefficients, _schedule

__all__ = ["sharded_gram_zeropower", "gram_collectives", "gram_orientations"]


def gram_orientations(muon: list[Any], R: int, T: int) -> dict[int, bool]:
    """``mode="gram"``: the Muon params (by index) whose shards over the dense ``R x T`` domain split their long side
    only (every rank a disjoint block of it, the short side whole), each with ``tall`` (its rows are split: the
    Gram is over its columns). The others (replicated, transposed, split into parts, expert, 2-D blocks, or split
    along the short side, whose Gram would be the larger one) are layer-sharded."""
    out: dict[int, bool] = {}
    for m in muon:
        if R * T == 1 or m.domain or m.replicated or m.transposed or m.parts is not None or m.expert is not None:
            continue
        P, Q = m.full_shape
        rows = (T == 1) or (m.partition_dim == 0)  # remat splits rows; TP rows with partition_dim 0
        cols = R == 1 and m.partition_dim == 1
        if rows and P >= Q:
            out[m.index] = True
        elif cols and P <= Q:
            out[m.index] = False
    return out


def gram_collectives(ns_steps: int, restart_every: int) -> int:
    """All-reduces of one matrix's Gram: ``ceil(ns_steps / restart_every)`` (at least one)."""
    return max(1, math.ceil(ns_steps / max(1, restart_every)))


def _gram(x: Tensor, group: Any) -> Tensor:
    """``sum_r X_r X_rᵀ`` in fp32 over ``group`` (``None``: this rank's alone)."""
    r = x @ x.mT
    if group is not None:
        dist.all_reduce(r, group=group)
    return r


def sharded_gram_zeropower(
    shard: Tensor,
    group: Any,
    *,
    tall: bool,
    restart_every: int,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
) -> Tensor:
    """NS of a matrix split along its long side over ``group``, in Gram space ([Note: sharded Gram NS]).

    Every rank of ``group`` calls it with its block, in the same order (it issues ``gram_collectives(ns_steps,
    restart_every)`` all-reduces on ``group``).

    Args:
        shard: this rank's block of the matrix: ``(P, Q_r)`` columns of a wide ``(P, Q)`` (``tall=False``) or
            ``(Q_r, P)`` rows of a tall ``(Q, P)`` (``tall=True``); any float dtype (cast to bf16, the NS input);
            an empty block (``Q_r = 0``) takes part in the collectives.
        group: the process group the matrix is split over (``None``: the whole matrix is here).
        tall: the matrix is tall (its Gram side is its columns).
        restart_every: re-form the Gram from the blocks every this many steps (>= 1).
        ns_coefficients, ns_steps, eps: as :func:`overlap_muon._ns.zeropower`.

    Returns:
        This rank's block of the orthogonalized matrix, bf16, ``shard``'s shape.

    Raises:
        ValueError: ``shard`` is not 2-D, ``restart_every < 1``, or the coefficients/steps are malformed.
    """
    if shard.ndim != 2:
        raise ValueError(f"sharded_gram_zeropower expects a 2-D block, got shape {tuple(shard.shape)}")
    if not isinstance(restart_every, int) or restart_every < 1:
        raise ValueError(f"restart_every must be an int >= 1, got {restart_every!r}")
    steps = _schedule(ns_coefficients, ns_steps)
    x = shard.bfloat16().float()
    if tall:
        x = x.mT
    r = _gram(x, group)
    scale = 1.0 / r.trace().sqrt().clamp(min=eps)  # X / ||X||_F, as zeropower's first step
    x, r = x * scale, r * scale * scale
    eye = torch.eye(r.size(0), dtype=torch.float32, device=r.device)
    m = None
    for t, (a, b, c) in enumerate(steps):
        if t and t % restart_every == 0:
            x, m = m @ x, None
            r = _gram(x, group)
        z = b * r + c * (r @ r)
        s = z + a * eye
        m = s if m is None else s @ m
        if t + 1 < len(steps) and (t + 1) % restart_every:  # the next step needs R
            r = s @ r @ s
    if m is not None:
        x = m @ x
    out = x.bfloat16()
    return out.mT if tall else out
