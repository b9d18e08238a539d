"""The elementwise Muon math, one function per step of ``torch.optim.Muon``, used by every path.

Mirrors ``torch/optim/_muon.py`` (torch 2.13, ``_single_tensor_muon``) operation for operation, so that each
rank can run it on its own shard and get bit for bit what ``torch.optim.Muon`` gets on the whole matrix (the
ops are elementwise, DESIGN.md section 1):

=============================  ==============================================================
torch.optim.Muon               here
=============================  ==============================================================
``buf.lerp_(grad, 1 - mu)``    :func:`momentum_update` (out of place, for the speculative NS input) and
                               :func:`momentum_update_` (in place, when ``step()`` commits)
``grad.lerp(buf, mu)``         :func:`ns_input` (Nesterov; the bf16 cast of ``zeropower``)
``param.mul_(1 - lr * wd)``    :func:`apply_update`
``param.add_(O, alpha=-lr')``  :func:`apply_update` (``lr'`` = ``_adjust_lr`` on the FULL shape)
=============================  ==============================================================

``lr`` may be a Python float or a 0-d tensor (torch keeps a tensor lr as a tensor, so ``1 - lr * wd`` and the
adjusted lr are computed in its dtype); both are passed through unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .ns import _schedule, adjusted_lr

__all__ = ["check_hyperparameters", "momentum_update", "momentum_update_", "ns_input", "apply_update"]


def check_hyperparameters(
    lr: float | Tensor, weight_decay: float, momentum: float, eps: float, adjust_lr_fn: str | None,
    ns_coefficients: Any, ns_steps: int,
) -> None:
    """The checks (and messages) of ``torch.optim.Muon.__init__``, plus the NS schedule's.

    Raises:
        ValueError: a tensor ``lr`` with more than one element, a negative ``lr``/``momentum``/``weight_decay``/
            ``eps``, an unknown ``adjust_lr_fn``, or malformed ``ns_coefficients``/``ns_steps``.
    """
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
        raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
    if not (isinstance(eps, (int, float)) and eps >= 0):
        raise ValueError(f"eps should be >= 0 but is: {eps}")
    _schedule(ns_coefficients, ns_steps)


def momentum_update(buf: Tensor, grad: Tensor, momentum: float) -> Tensor:
    """The new momentum buffer, out of place: ``buf.lerp(grad, 1 - momentum)``.

    Args:
        buf: the momentum buffer (a local shard, the param's dtype); not modified.
        grad: the gradient shard, same shape.
        momentum: ``mu`` in ``[0, inf)``.

    Returns:
        A new tensor of ``buf``'s shape and dtype, bitwise equal to what ``buf.lerp_(grad, 1 - mu)`` leaves in
        ``buf`` (same kernel). Committed into ``buf`` only by ``step()`` (``buf.copy_(new)``).
    """
    return buf.lerp(grad, 1 - momentum)


def momentum_update_(buf: Tensor, grad: Tensor, momentum: float) -> None:
    """Commit the new momentum: ``buf.lerp_(grad, 1 - momentum)``, torch's own op (the same kernel as
    :func:`momentum_update`, so the committed buffer is bitwise the value the NS input was built from)."""
    buf.lerp_(grad, 1 - momentum)


def ns_input(grad: Tensor, new_buf: Tensor, momentum: float, nesterov: bool) -> Tensor:
    """The bf16 NS input shard: ``grad.lerp(new_buf, momentum)`` with Nesterov, else ``new_buf``, cast to bf16.

    The cast is ``zeropower``'s first op; doing it on the shard before routing is exact and halves the bytes.
    With bf16 params and ``nesterov=False`` the result aliases ``new_buf``; nothing downstream writes into it
    (``zeropower`` divides out of place, unlike torch 2.13's, see the README's exactness section).

    Returns:
        bf16 tensor of ``grad``'s shape.
    """
    u = grad.lerp(new_buf, momentum) if nesterov else new_buf
    return u.bfloat16()


def apply_update(
    param: Tensor, update: Tensor, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None,
    full_shape: Sequence[int],
) -> None:
    """Decoupled weight decay, then the scaled orthogonalized update, in place on a param shard.

    Args:
        param: the local param shard (any float dtype), updated in place.
        update: this rank's block of ``O = zeropower(U)`` (bf16), same shape as ``param``.
        lr: the learning rate now (float or 0-d tensor, as the param group holds it).
        weight_decay: ``lambda``.
        adjust_lr_fn: ``None``/``"original"``/``"match_rms_adamw"`` (:func:`overlap_muon.ns.adjusted_lr`).
        full_shape: the FULL logical ``(P, Q)`` of the matrix, never the shard's.
    """
    param.mul_(1 - lr * weight_decay)
    param.add_(update, alpha=-adjusted_lr(lr, adjust_lr_fn, full_shape))
