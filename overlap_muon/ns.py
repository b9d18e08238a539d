"""Newton-Schulz orthogonalization ("zeropower"), bitwise equal to ``torch.optim.Muon``'s on one matrix.

The default coefficients ``(3.4445, -4.7750, 2.0315)`` and 5 steps are those of ``torch.optim.Muon`` (which cites
Keller Jordan's Muon post, https://kellerjordan.github.io/posts/muon/). The cost model (:func:`ns_flops`) lives in
``scheduler.cost`` because the planner must not import this package; it is re-exported here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

from scheduler.cost import ns_flops

__all__ = ["zeropower", "ns_flops", "adjusted_lr", "DEFAULT_NS_COEFFICIENTS"]

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)

Coefficients = tuple[float, float, float] | Sequence[tuple[float, float, float]]


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


def zeropower(
    X: Tensor,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
) -> Tensor:
    """Orthogonalize ``X`` with the quintic Newton-Schulz iteration of ``torch.optim.Muon``.

    Args:
        X: ``(m, n)`` or batched ``(b, m, n)`` tensor of any float dtype. A batch is a stack of independent
            matrices: each one is normalized by its own Frobenius norm (no flattening across matrices).
        ns_coefficients: ``(a, b, c)`` applied at every step, or a sequence of ``ns_steps`` per-step tuples
            (Polar-Express-style schedules).
        ns_steps: number of iterations, in ``[0, 100)``.
        eps: floor of the norm, ``X / max(||X||_F, eps)``.

    Returns:
        bf16 tensor of ``X``'s shape. On one matrix it is bitwise equal to
        ``torch.optim._muon._zeropower_via_newtonschulz``: same cast, transpose of tall matrices, normalization
        and ``addmm`` sequence (``baddbmm`` for batches, which is bitwise equal per matrix where the platform's
        batched matmul is batch-invariant; the tests check it).

    Raises:
        ValueError: ``X`` is not 2-D or 3-D, or the coefficients/steps are malformed.
    """
    if X.ndim not in (2, 3):
        raise ValueError(f"zeropower expects a (m, n) or (b, m, n) tensor, got shape {tuple(X.shape)}")
    steps = _schedule(ns_coefficients, ns_steps)
    x = X.bfloat16()
    tall = X.size(-2) > X.size(-1)
    if tall:
        x = x.mT
    if x.ndim == 2:
        x = x / x.norm().clamp(min=eps)
        for a, b, c in steps:
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
            gram = x @ x.mT
            upd = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)
            x = torch.baddbmm(x, upd, x, beta=a)
    if tall:
        x = x.mT
    return x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, full_shape: Sequence[int]) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment, always on the FULL logical ``(P, Q)`` shape.

    ``None``/``"original"``: ``lr * sqrt(max(1, P/Q))`` (Keller Jordan); ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(P, Q))`` (Moonshot, "Muon is Scalable for LLM Training", arXiv:2502.16982).
    """
    A, B = full_shape[0], full_shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    else:
        ratio = 1.0
    return lr * ratio
