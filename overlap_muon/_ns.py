"""Newton-Schulz orthogonalization ("zeropower"), bitwise equal to ``torch.optim.Muon``'s on one matrix.

The default coefficients ``(3.4445, -4.7750, 2.0315)`` and 5 steps are those of ``torch.optim.Muon`` (which cites
Keller Jordan's Muon post, https://kellerjordan.github.io/posts/muon/). The cost model (``ns_flops``) is the
planner's (``overlap_muon._scheduler.cost``); this module, like every math and layout module, does not import it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ._layout import GRAM_MIN_ASPECT, gram_wins


__all__ = ["zeropower", "zeropower_each", "adjusted_lr", "ADJUST_LR_FNS", "gram_zeropower", "gram_wins",
           "DEFAULT_NS_COEFFICIENTS", "SYRK_BLOCK", "GRAM_MIN_ASPECT", "GRAM_RESTARTS", "sym_gram", "sym_poly",
           "split_ns"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

#: Rows per block row of the symmetric products (:func:`sym_gram`, :func:`sym_poly`). Measured on an AMX bf16 Xeon,
#: 1 thread, whole ``zeropower`` (5 steps), speed-up over the plain NS at 1024^2 / 2048x8192 / 4096^2: block 256:
#: 0.82 / 1.14 / 1.05; 512: 0.90 / 1.05 / 1.03; 1024: 1.03 (the plain product) / 1.03 / 0.95. 256 is the best
#: where NS is long enough to matter.
SYRK_BLOCK = 256

Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]]

#: The iterations after which Gram NS restarts (0-based: ``(2,)`` restarts before the third), the published
#: default for 5 steps ([Note: Gram Newton-Schulz]).
GRAM_RESTARTS = (2,)


def _schedule(ns_coefficients: Coefficients, ns_steps: int) -> list[tuple[float, float, float]]:
    """Per-step ``(a, b, c)``: one triple repeated ``ns_steps`` times, or an explicit per-step sequence."""
    if isinstance(ns_steps, bool) or not isinstance(ns_steps, int) or ns_steps < 0 or ns_steps >= 100:
        raise ValueError(f"ns_steps must be an int in [0, 100), got {ns_steps!r}")
    coeffs = tuple(ns_coefficients)
    if len(coeffs) == 3 and all(isinstance(c, (int, float)) for c in coeffs):
        return [tuple(float(c) for c in coeffs)] * ns_steps  # type: ignore[list-item]
    try:
        steps = [tuple(s) for s in coeffs]
    except TypeError:
        steps = []
    if not steps or any(len(s) != 3 for s in steps):
        raise ValueError(
            f"ns_coefficients must be (a, b, c) or a sequence of per-step (a, b, c) tuples, got {ns_coefficients!r}"
        )
    if len(steps) != ns_steps:
        raise ValueError(
            f"ns_coefficients gives {len(steps)} per-step tuples but ns_steps={ns_steps}; they must agree"
        )
    return steps  # type: ignore[return-value]


def _check_block(block: int) -> int:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"syrk block must be a positive int (rows per block row), got {block!r}")
    return block


def _mirror_upper(out: Tensor, block: int) -> Tensor:
    """Make ``out`` (``(..., m, m)``, upper block rows filled) exactly symmetric from its upper triangle, in place.

    The strictly-lower blocks are copied from the transposed upper ones; inside each diagonal block the lower
    triangle is taken from the upper one too (a selection, not arithmetic, so signed zeros survive), so the
    result is symmetric by construction, whatever order the GEMM kernel summed in.
    """
    m = out.size(-1)
    for i in range(0, m, block):
        j = min(i + block, m)
        if j < m:
            out[..., j:, i:j] = out[..., i:j, j:].mT
        d = out[..., i:j, i:j]
        upper = torch.ones(j - i, j - i, dtype=torch.bool, device=out.device).triu()
        out[..., i:j, i:j] = torch.where(upper, d, d.mT)
    return out


def sym_gram(x: Tensor, block: int = SYRK_BLOCK) -> Tensor:
    """``x @ x.mT`` computed as a symmetric rank-k update (SYRK): upper block rows, then a mirror.

    [Note: symmetric Gram] ``A = X Xᵀ`` is symmetric, so only its upper block triangle needs computing: block row
    ``i`` (rows ``i*block .. (i+1)*block``) is ``X[rows_i] @ X[i*block:].T``, a ``(block, n) @ (n, m - i*block)``
    matmul, and the strictly-lower blocks are copies of the transposed upper ones. That is
    ``m*(m + block)*n`` multiply-adds instead of ``m*m*n`` (``(1 + block/m)/2`` of the FLOPs; the BLAS routine is
    ``?syrk``, which torch does not expose for bf16). Mirroring is exact: every entry of a dense product is
    ``sum_k x[i,k]*x[j,k]``, and ``[j, i]`` sums the same products. What is not guaranteed is that a block row
    equals the same rows of the full product bit for bit: a CPU/GPU GEMM library picks its kernel (and the order
    in which it accumulates the ``n`` terms in fp32 before rounding to bf16) from the operands' shapes, so a
    ``(block, n) @ (n, w)`` product can round differently from the ``(m, n) @ (n, m)`` one. On the AMX bf16 CPU
    this was measured on (oneDNN via torch 2.13), it differs at 1024^2, 2048x8192 and 4096^2 for most block
    sizes; see ``tests/test_syrk.py`` and the bench's ``ns`` case for the figures.

    Args:
        x: ``(m, n)`` or ``(b, m, n)`` tensor (any float dtype; NS passes bf16).
        block: rows per block row, >= 1 (default :data:`SYRK_BLOCK`). ``block >= m`` is the plain product.

    Returns:
        ``(m, m)`` / ``(b, m, m)`` tensor of ``x``'s dtype, exactly symmetric.

    Raises:
        ValueError: ``x`` is not 2-D or 3-D, or ``block`` is not a positive int.
    """
    if x.ndim not in (2, 3):
        raise ValueError(f"sym_gram expects a (m, n) or (b, m, n) tensor, got shape {tuple(x.shape)}")
    block = _check_block(block)
    m = x.size(-2)
    if block >= m:
        return x @ x.mT
    out = x.new_empty((*x.shape[:-2], m, m))
    for i in range(0, m, block):
        out[..., i : i + block, i:] = x[..., i : i + block, :] @ x[..., i:, :].mT
    return _mirror_upper(out, block)


def sym_poly(gram: Tensor, b: float, c: float, block: int = SYRK_BLOCK) -> Tensor:
    """``b*A + c*(A @ A)`` for a symmetric ``A`` (``gram``), upper block rows then a mirror.

    ``A @ A`` of a symmetric ``A`` is symmetric (``[i, j] = sum_k A[i,k] A[k,j]`` and ``[j, i]`` sums the same
    products), so block row ``i`` is ``addmm(A[rows_i, i*block:], A[rows_i], A[:, i*block:], beta=b, alpha=c)``
    (the same fused ``beta``/``alpha`` epilogue as ``torch.optim.Muon``'s ``addmm``), ``(1 + block/m)/2`` of the
    FLOPs, and the lower blocks are mirrored. Exactness as in [Note: symmetric Gram] (measured, not guaranteed).

    Args:
        gram: ``(m, m)`` or ``(b, m, m)`` symmetric tensor (NS: bf16 ``X Xᵀ``).
        b, c: the NS step's coefficients.
        block: rows per block row, >= 1.

    Returns:
        Tensor of ``gram``'s shape and dtype, exactly symmetric.

    Raises:
        ValueError: ``gram`` is not 2-D or 3-D and square, or ``block`` is not a positive int.
    """
    if gram.ndim not in (2, 3) or gram.size(-1) != gram.size(-2):
        raise ValueError(f"sym_poly expects a square (m, m) or (b, m, m) tensor, got shape {tuple(gram.shape)}")
    block = _check_block(block)
    m = gram.size(-1)
    mm = torch.addmm if gram.ndim == 2 else torch.baddbmm
    if block >= m:
        return mm(gram, gram, gram, beta=b, alpha=c)
    out = torch.empty_like(gram)
    for i in range(0, m, block):
        rows = slice(i, i + block)
        out[..., rows, i:] = mm(gram[..., rows, i:], gram[..., rows, :], gram[..., :, i:], beta=b, alpha=c)
    return _mirror_upper(out, block)


def gram_zeropower(
    X: Tensor,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    restarts: Sequence[int] = GRAM_RESTARTS,
) -> Tensor:
    """Newton-Schulz by the Gram matrix: the same iteration as :func:`zeropower`, fewer FLOPs on wide matrices.

    [Note: Gram Newton-Schulz] (Zhang, Amsel, Chen and Dao, "Gram Newton-Schulz", 2026; the algorithm as stated in
    the README of github.com/Dao-AILab/gram-newton-schulz). For ``X`` of ``n x m``, ``n <= m``, each NS step is
    ``X <- p(X Xᵀ) X`` with ``p(R) = aI + bR + cR²``, so every iterate is ``Q X0`` for an ``n x n`` ``Q``, and
    ``R = X Xᵀ`` follows ``R <- p(R) R p(R)``. Gram NS forms ``R0 = X0 X0ᵀ`` once, iterates on ``n x n`` matrices
    (``Z = bR + cR²``, ``Q <- QZ + aQ``, ``R <- Z(RZ + aR) + a(RZ + aR)``) and touches ``X`` again only at the end
    (``Q X0``): ``(8k + 28) n³`` FLOPs for 5 steps with one restart on an ``n x kn`` matrix, against
    ``(20k + 10) n³``. The safeguard taken from the source: a *restart* after the second step (``X <- Q X``,
    ``R <- X Xᵀ``, ``Q <- I``), which stops the rounding errors of ``Q`` and ``R`` from compounding in half
    precision. What differs from the source: bf16 instead of fp16 (this CPU multiplies fp16 about 6x slower than
    bf16, measured 181 against 1029 GFLOP/s at 1024³, and ``torch.optim.Muon`` iterates in bf16 too), and the
    ``aI`` of each segment's first ``Q`` is added in fp32 before one rounding (a bf16 in-place diagonal add rounds
    worse). Accuracy against a float64 NS, relative Frobenius error as a multiple of plain bf16 NS's: 1.21 to 1.26
    at 1024x4096 and about 1.15 at 2048x8192 on random full-rank matrices, 0.83 to 0.94 on rank-16 ones, but 1.37
    on rank-128 ones at 1024x4096 and about 2.1 at 256x1024: ``R0 = X Xᵀ`` squares the singular values, so its
    bf16 rounding is noise of relative size ``sqrt(2^-9)`` on the small ones, which NS then amplifies. Not bitwise,
    and less accurate on gradients with a large null space; see ``docs/results.md``. Tried and not taken: forming
    the restart's ``R`` as ``P R0 Pᵀ`` from the segments' ``Q`` (``n x n`` products only, ``X`` touched once at
    the end): 1.73x and 1.55x faster than plain NS instead of 1.42x and 1.37x, the same full-rank error, but up to
    twice the error on rank-16 matrices.

    Args:
        X: ``(m, n)`` or ``(b, m, n)`` tensor, any float dtype (a tall matrix is transposed, as in
            :func:`zeropower`).
        ns_coefficients, ns_steps, eps: as :func:`zeropower`.
        restarts: the 0-based steps before which the iteration restarts (default :data:`GRAM_RESTARTS`).

    Returns:
        bf16 tensor of ``X``'s shape.

    Raises:
        ValueError: ``X`` is not 2-D or 3-D, or the coefficients/steps are malformed.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"gram_zeropower expects a (m, n) or (b, m, n) tensor, got shape {tuple(X.shape)}")
    steps = _schedule(ns_coefficients, ns_steps)
    x = X.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 3 and x.size(0) == 0:
        return X.bfloat16().clone()
    mm = torch.addmm if x.ndim == 2 else torch.baddbmm
    norms = x.norm() if x.ndim == 2 else torch.stack([m.norm() for m in x]).view(-1, 1, 1)
    x = x / norms.clamp(min=eps)
    eye = torch.eye(x.size(-2), dtype=torch.float32, device=x.device)
    r = x @ x.mT
    q = None
    for t, (a, b, c) in enumerate(steps):
        if t in restarts and q is not None:
            x = q @ x
            r, q = x @ x.mT, None
        z = mm(r, r, r, beta=b, alpha=c)
        q = (z.float() + a * eye).bfloat16() if q is None else mm(q, q, z, beta=a)
        if t + 1 < len(steps) and t + 1 not in restarts:  # the next step needs R
            rz = mm(r, r, z, beta=a)
            r = mm(rz, z, rz, beta=a)
    if q is not None:
        x = q @ x
    return x.mT if tall else x


def zeropower(
    X: Tensor,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    syrk: bool = False,
    syrk_block: int = SYRK_BLOCK,
    gram: bool = False,
) -> Tensor:
    """Orthogonalize ``X`` with the quintic Newton-Schulz iteration of ``torch.optim.Muon``.

    Args:
        X: ``(m, n)`` or batched ``(b, m, n)`` tensor of any float dtype. A batch is a stack of independent
            matrices: each one is normalized by its own Frobenius norm (no flattening across matrices).
        ns_coefficients: ``(a, b, c)`` applied at every step, or a sequence of ``ns_steps`` per-step tuples
            (Polar-Express-style schedules).
        ns_steps: number of iterations, in ``[0, 100)``.
        eps: floor of the norm, ``X / max(||X||_F, eps)``.
        syrk: compute ``X Xᵀ`` and ``b*A + c*A@A`` as symmetric products (:func:`sym_gram`, :func:`sym_poly`):
            fewer FLOPs, but NOT bitwise equal to ``torch.optim.Muon`` on every platform and shape (see
            [Note: symmetric Gram]); the ``OVERLAP_MUON_SYRK`` toggle, off by default.
        syrk_block: rows per block row of the symmetric products, >= 1.
        gram: where :func:`gram_wins` for ``X``'s shape, run :func:`gram_zeropower` instead (not bitwise: [Note:
            Gram Newton-Schulz]); square-ish matrices keep the plain iteration. The ``OVERLAP_MUON_GRAM_NS`` toggle.

    Returns:
        bf16 tensor of ``X``'s shape. With ``syrk=False``, on one matrix it is bitwise equal to
        ``torch.optim._muon._zeropower_via_newtonschulz``: same cast, transpose of tall matrices, normalization
        and ``addmm`` sequence (``baddbmm`` for batches, which is bitwise equal per matrix where the platform's
        batched matmul is batch-invariant; the tests check it).

    Raises:
        ValueError: ``X`` is not 2-D or 3-D, the coefficients/steps are malformed, or ``syrk_block`` is not a
            positive int.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"zeropower expects a (m, n) or (b, m, n) tensor, got shape {tuple(X.shape)}")
    if gram and gram_wins(X.shape):
        return gram_zeropower(X, ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps)
    steps = _schedule(ns_coefficients, ns_steps)
    _check_block(syrk_block)
    x = X.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        for a, b, c in steps:
            if syrk:
                gram = sym_gram(x, syrk_block)
                upd = sym_poly(gram, b, c, syrk_block)
            else:
                gram = x @ x.T
                upd = torch.addmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.addmm(x, upd, x, beta=a)
    else:
        if x.size(0) == 0:
            return X.bfloat16().clone()
        # Per-matrix norms: the same reduction as the unbatched path, one matrix at a time.
        norms = torch.stack([m.norm() for m in x]).clamp(min=eps).view(-1, 1, 1)
        x = x / norms
        for a, b, c in steps:
            if syrk:
                gram = sym_gram(x, syrk_block)
                upd = sym_poly(gram, b, c, syrk_block)
            else:
                gram = x @ x.mT
                upd = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, upd, x, beta=a)
    if tall:
        x = x.mT
    return x


# The adjustments torch.optim.Muon knows as of torch 2.14 (2.13 lacks "spectral_unclamped"; OverlapMuon accepts it
# on every torch).
ADJUST_LR_FNS = (None, "original", "match_rms_adamw", "spectral_unclamped")


def adjusted_lr(lr: float, adjust_lr_fn: str | None, full_shape: Sequence[int]) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment, always on the FULL logical ``(P, Q)`` shape.

    ``None``/``"original"``: ``lr * sqrt(max(1, P/Q))`` (Keller Jordan); ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(P, Q))`` (Moonshot, "Muon is Scalable for LLM Training", arXiv:2502.16982);
    ``"spectral_unclamped"`` (torch 2.14): ``lr * sqrt(P/Q)``, the spectral scaling of Bernstein's "Deriving Muon",
    not clamped below at 1. Any other value gives ratio 1.0, as ``torch.optim._muon._adjust_lr`` does
    (``check_hyperparameters`` rejects them).
    """
    A, B = full_shape[0], full_shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = math.sqrt(A / B)
    else:
        ratio = 1.0
    return lr * ratio


def zeropower_each(mats: Sequence[Tensor], kw: dict, batch: bool, stats: dict[str, int]) -> list[Tensor]:
    """:func:`zeropower` of each matrix (``kw`` its keyword arguments). With ``batch``, same-shape matrices go
    through one batched call (no flattening across matrices; not bitwise where batched bf16 matmul is not
    batch-invariant). Counts ``stats["ns_matrices"]`` and ``stats["ns_calls"]``."""
    stats["ns_matrices"] += len(mats)
    if not batch:
        stats["ns_calls"] += len(mats)
        return [zeropower(m, **kw) for m in mats]
    by_shape: dict[tuple[int, ...], list[int]] = {}
    for j, m in enumerate(mats):
        by_shape.setdefault(tuple(m.shape), []).append(j)
    out: list[Tensor | None] = [None] * len(mats)
    for js in by_shape.values():
        stats["ns_calls"] += 1
        if len(js) == 1:
            out[js[0]] = zeropower(mats[js[0]], **kw)
        else:
            res = zeropower(torch.stack([mats[j] for j in js]), **kw)
            for r, j in enumerate(js):
                out[j] = res[r]
    return out  # type: ignore[return-value]


def split_ns(fulls: Sequence[Tensor], parts: Sequence[Sequence[Sequence[int]] | None],
             ns_many: Callable[[list[Tensor]], list[Tensor]]) -> list[Tensor]:
    """NS of each full matrix, or of each of its parts put back in place; ``ns_many`` batches by shape.

    Args:
        fulls: ``(P, Q)`` bf16 matrices assembled on this home.
        parts: per matrix, its row sets (``None``: the whole matrix).
        ns_many: list of matrices -> list of their NS results.

    Returns:
        ``(P, Q)`` bf16 results, one per input.
    """
    mats: list[Tensor] = []
    where: list[tuple[int, Tensor | None]] = []
    for j, (full, rows) in enumerate(zip(fulls, parts)):
        if rows is None:
            mats.append(full)
            where.append((j, None))
            continue
        for r in rows:
            idx = torch.tensor(r, device=full.device)
            mats.append(full.index_select(0, idx))
            where.append((j, idx))
    outs = ns_many(mats)
    result: list[Tensor | None] = [None] * len(fulls)
    for (j, idx), o in zip(where, outs):
        if idx is None:
            result[j] = o
            continue
        if result[j] is None:
            result[j] = torch.empty(fulls[j].shape, dtype=o.dtype, device=o.device)
        result[j].index_copy_(0, idx, o)
    return result  # type: ignore[return-value]
