"""Cost model of one Newton-Schulz orthogonalization (the only work that needs a whole Muon matrix).

[Note: what the NS cost counts] ``torch.optim.Muon`` (``torch/optim/_muon.py``,
``_zeropower_via_newtonschulz``) casts the ``(P, Q)`` update to bf16, transposes it when ``P > Q`` so that
``X`` is ``(m, n)`` with ``m = min(P, Q)``, ``n = max(P, Q)``, then runs ``ns_steps`` iterations of::

    A = X @ X.T                          # (m, n) @ (n, m): 2*m*m*n FLOPs
    B = addmm(A, A, A, beta=b, alpha=c)  # (m, m) @ (m, m): 2*m*m*m FLOPs
    X = addmm(X, B, X, beta=a)           # (m, m) @ (m, n): 2*m*m*n FLOPs

A matmul of ``(M, K) @ (K, N)`` is counted as ``2*M*N*K`` FLOPs (one multiply and one add per term). The
Frobenius norm, the division by it, the ``beta``/``alpha`` scaling inside ``addmm`` and the casts are
elementwise, ``O(m*n)`` per step against ``O(m*m*n)`` for the matmuls, and are ignored.
"""

from __future__ import annotations

from typing import Sequence

from .._layout import gram_wins

__all__ = ["ns_flops", "gram_ns_flops", "ns_cost"]


def _check_shape(shape: Sequence[int]) -> tuple[int, int]:
    if len(shape) != 2:
        raise ValueError(f"NS cost needs a 2-D (P, Q) shape, got {tuple(shape)!r}")
    p, q = shape
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in (p, q)):
        raise ValueError(f"NS cost needs non-negative integer dims, got shape {tuple(shape)!r}")
    return p, q


def ns_flops(shape: tuple[int, int], ns_steps: int = 5) -> int:
    """FLOPs of Newton-Schulz on a full ``(P, Q)`` matrix, as ``torch.optim.Muon`` computes it.

    With ``m = min(P, Q)`` and ``n = max(P, Q)``, each step costs ``4*m*m*n + 2*m**3`` FLOPs (three matmuls,
    ``2*M*N*K`` each); see [Note: what the NS cost counts] for the derivation and what is left out (the norm,
    scaling and casts, all elementwise).

    Args:
        shape: the full logical ``(P, Q)`` shape of the Muon matrix (never a shard's).
        ns_steps: number of Newton-Schulz iterations (``torch.optim.Muon`` default 5).

    Returns:
        FLOPs, an exact integer. A matrix with a zero dim costs 0.

    Raises:
        ValueError: ``shape`` is not two non-negative ints, or ``ns_steps`` is negative.
    """
    p, q = _check_shape(shape)
    if not isinstance(ns_steps, int) or isinstance(ns_steps, bool) or ns_steps < 0:
        raise ValueError(f"ns_steps must be a non-negative int, got {ns_steps!r} (shape {(p, q)})")
    m, n = min(p, q), max(p, q)
    per_step = 2 * m * m * n + 2 * m * m * m + 2 * m * m * n
    return ns_steps * per_step


def gram_ns_flops(shape: tuple[int, int], ns_steps: int = 5, restarts: int = 1) -> int:
    """FLOPs of Gram Newton-Schulz on a full ``(P, Q)`` matrix (``overlap_muon._ns.gram_zeropower``, [Note: Gram
    Newton-Schulz]).

    With ``m = min(P, Q)``, ``n = max(P, Q)`` and ``s = restarts + 1`` segments: ``R0 = X Xᵀ`` (``2m²n``), per
    restart ``X <- QX`` and ``R <- X Xᵀ`` (``4m²n``), the final ``QX`` (``2m²n``); per step four ``m x m``
    products (``8m³``) less ``2m³`` where a segment starts (``Q = I``) and ``4m³`` where it ends (no ``R``
    update): ``2m²n(2 + 2*restarts) + m³(8*ns_steps - 6*s)``. A matrix with a zero dim costs 0.

    Raises:
        ValueError: as :func:`ns_flops`.
    """
    p, q = _check_shape(shape)
    if ns_steps < 0 or restarts < 0:
        raise ValueError(f"ns_steps and restarts must be >= 0, got {ns_steps}, {restarts}")
    m, n = min(p, q), max(p, q)
    if m == 0 or ns_steps == 0:
        return 0
    segments = min(restarts, ns_steps - 1) + 1
    return 2 * m * m * n * (2 + 2 * (segments - 1)) + m ** 3 * max(0, 8 * ns_steps - 6 * segments)


def ns_cost(shape: tuple[int, int], ns_steps: int = 5, gram: bool = False) -> int:
    """FLOPs of the NS the runtime runs on ``shape``: Gram NS where ``gram`` and the per-shape rule pick it
    (``overlap_muon._layout.gram_wins``), else :func:`ns_flops`."""
    return gram_ns_flops(shape, ns_steps) if gram and gram_wins(shape) else ns_flops(shape, ns_steps)

