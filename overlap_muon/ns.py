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

__all__ = ["zeropower", "ns_flops", "adjusted_lr", "spectral_unclamped_ratio", "ADJUST_LR_EXTENSIONS",
           "DEFAULT_NS_COEFFICIENTS"]

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


#: ``adjust_lr_fn`` values that ``torch.optim.Muon`` (torch 2.13) does not know and this package documents as
#: extensions. torch 2.13's ``Muon.__init__`` accepts only ``None``, ``"original"`` and ``"match_rms_adamw"`` (any
#: other value is a ``ValueError``, and its ``_adjust_lr`` would use ratio 1.0), so an extension has no reference
#: in torch to be bitwise equal to; its reference is the formula below.
ADJUST_LR_EXTENSIONS: tuple[str, ...] = ("spectral_unclamped",)


def spectral_unclamped_ratio(full_shape: Sequence[int]) -> float:
    """Learning-rate ratio ``sqrt(P / Q)`` of a full ``(P, Q)`` (fan_out, fan_in) Muon matrix.

    Muon's orthogonalized update has spectral norm about 1; scaling it by ``sqrt(fan_out / fan_in)`` gives the
    update the spectral norm that the spectral condition for feature learning asks of a hidden layer (Yang,
    Simon and Bernstein, "A Spectral Condition for Feature Learning", arXiv:2310.17813, condition on
    ``||dW||_* ~ sqrt(fan_out / fan_in)``). ``"original"`` (Keller Jordan) is the same ratio clamped below at 1,
    ``sqrt(max(1, P / Q))``; unclamped, wide matrices (``P < Q``) get a ratio below 1. torchtitan 0.3.0's
    DistMuon offers it under this name (``adjust_lr_fn="spectral_unclamped"``, ``math.sqrt(rows / columns)`` in
    ``torchtitan/distributed/flex_shard/dist_muon.py``, ``_adjust_muon_learning_rate``); this is the same float.

    Args:
        full_shape: the FULL logical ``(P, Q)`` shape (never a shard's), ``P >= 0``, ``Q > 0``.

    Returns:
        ``math.sqrt(P / Q)`` (a Python float, dimensionless).

    Raises:
        ValueError: ``full_shape`` does not have two dims, or ``Q <= 0`` or ``P < 0``.
    """
    if len(full_shape) < 2:
        raise ValueError(f"spectral_unclamped needs a (P, Q) shape, got {tuple(full_shape)!r}")
    P, Q = full_shape[0], full_shape[1]
    if Q <= 0 or P < 0:
        raise ValueError(f"spectral_unclamped needs P >= 0 and Q > 0, got shape {tuple(full_shape)!r}")
    return math.sqrt(P / Q)


def adjusted_lr(lr: float, adjust_lr_fn: str | None, full_shape: Sequence[int]) -> float:
    """``torch.optim.Muon``'s learning-rate adjustment, always on the FULL logical ``(P, Q)`` shape.

    ``None``/``"original"``: ``lr * sqrt(max(1, P/Q))`` (Keller Jordan); ``"match_rms_adamw"``:
    ``lr * 0.2 * sqrt(max(P, Q))`` (Moonshot, "Muon is Scalable for LLM Training", arXiv:2502.16982);
    ``"spectral_unclamped"`` (an extension, see :data:`ADJUST_LR_EXTENSIONS`): ``lr * sqrt(P/Q)``
    (:func:`spectral_unclamped_ratio`). Any other value gives ratio 1.0, as ``torch.optim._muon._adjust_lr`` does.
    """
    A, B = full_shape[0], full_shape[1]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        ratio = math.sqrt(max(1, A / B))
    elif adjust_lr_fn == "match_rms_adamw":
        ratio = 0.2 * math.sqrt(max(A, B))
    elif adjust_lr_fn == "spectral_unclamped":
        ratio = spectral_unclamped_ratio(full_shape)
    else:
        ratio = 1.0
    return lr * ratio
