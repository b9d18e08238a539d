"""The elementwise Muon math, one function per step of ``torch.optim.Muon``, used by every path.

Mirrors ``torch/optim/_muon.py`` (torch 2.13, ``_single_tensor_muon``) operation for operation, so that each
rank can run it on its own shard and get bit for bit what ``torch.optim.Muon`` gets on the whole matrix (the
ops are elementwise, docs/design.md §1):

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

[Note: the apply follows torch's kernel path] ``param.add_(O, alpha=a)`` on a bf16 CPU param has two kernel
paths that round differently (torch 2.13, measured on AVX512 and matching the ATen source):

* vectorized (every operand contiguous): ``bf16(fp32(p) + bf16(a) * fp32(O))``, one rounding to bf16 (the product
  of two bf16 numbers is exact in fp32);
* element by element (an operand strided, and the tail of each vectorized run: the last ``n mod B`` elements of
  every thread chunk, ``B`` the vector width, 32 bf16 elements on AVX512): ``bf16(p + bf16(bf16(a) * O))``, the
  product rounded to bf16 first.

torch.optim.Muon applies the update of the FULL matrix: for a tall one (``P > Q``) ``O`` is the transpose of a
contiguous ``(Q, P)`` NS result, so every element takes the element-by-element path; otherwise ``O`` is contiguous
and only the tails do. Which elements are tails depends on the full shape, the vector width and the thread
count, not on the shard a rank holds, so applying a contiguous shard rounds some elements differently (one bf16
ulp; measured: 65 elements of 15 matrices in 3 steps on a 2x2 domain, tall ones mostly). :func:`apply_update`
therefore asks torch's own kernel which path each element of the full matrix takes (:func:`_scalar_path_elements`:
one ``add_`` of the full shape and layout on probe values whose two roundings differ, cached per shape and thread
count), and gives each element of the shard that path's result: the strided kernel itself when every element is
element-by-element (tall matrices: the update is handed over with a non-unit inner stride), else the vectorized
formula with the element-by-element one at the tail positions. fp32 and fp16 params (fp32 arithmetic on both
paths, fused multiply-add; measured) take a plain ``add_``, and so does CUDA, whose add kernel applies one fp32
functor on every path (read in the ATen source, not measured: no GPU was at hand). The lerps and ``mul_`` of the
other steps are path-independent for every dtype (measured on CPU).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from ._messages import warn_user
from ._ns import ADJUST_LR_FNS, _schedule, adjusted_lr


__all__ = ["check_hyperparameters", "momentum_update", "momentum_update_", "ns_input", "apply_update", "host_alphas",
           "CommitAtApply", "KeepForApply", "CommitAtPack", "create_momentum"]


def check_hyperparameters(
    lr: float | Tensor, weight_decay: float, momentum: float, eps: float, adjust_lr_fn: str | None,
    ns_coefficients: Any, ns_steps: int,
) -> None:
    """The checks (and messages) of ``torch.optim.Muon.__init__``, plus the NS schedule's.

    Raises:
        ValueError: a tensor ``lr`` with more than one element, a negative ``lr``/``momentum``/``weight_decay``/
            ``eps``, an ``adjust_lr_fn`` not in :data:`~overlap_muon._ns.ADJUST_LR_FNS`, or malformed
            ``ns_coefficients``/``ns_steps``.
    """
    if isinstance(lr, Tensor) and lr.numel() != 1:
        raise ValueError("Tensor lr must be 1-element")
    if not 0.0 <= lr:
        raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
    if not 0.0 <= momentum:
        raise ValueError(f"momentum should be >= 0 but is: {momentum}")
    if not 0.0 <= weight_decay:
        raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
    if adjust_lr_fn not in ADJUST_LR_FNS:
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


#: Elements from which a strided update is copied into the param's layout before ``add_`` (CPU, one thread, fp32
#: param, bf16 update: (128, 128) 14.0 us strided against 15.8 copied first, (256, 128) 32.7 against 24.9, (512, 256)
#: 251 against 88).
_DENSE_ADD_MIN = 1 << 15


def apply_update(
    param: Tensor, update: Tensor, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None,
    full_shape: Sequence[int], region: tuple[int, int, int, int] | None = None, alpha: float | None = None,
) -> None:
    """Decoupled weight decay, then the scaled orthogonalized update, in place on a param shard.

    Every element ends up bitwise equal to what ``param.mul_(1 - lr * wd); param.add_(O, alpha=-lr')`` of
    ``torch.optim.Muon`` gives it on the full matrix, whatever block of the matrix this rank holds ([Note: the
    apply follows torch's kernel path]).

    Args:
        param: the local param shard (any float dtype), updated in place.
        update: this rank's block of ``O = zeropower(U)`` (bf16), same shape as ``param``, any layout.
        lr: the learning rate now (float or 0-d tensor, as the param group holds it).
        weight_decay: ``lambda``.
        adjust_lr_fn: ``None``/``"original"``/``"match_rms_adamw"`` (:func:`overlap_muon._ns.adjusted_lr`).
        full_shape: the FULL logical ``(P, Q)`` of the matrix, never the shard's.
        region: ``(row0, rows, col0, cols)`` of the shard in the full matrix (``overlap_muon._layout.block``);
            ``None``: the shard is the whole matrix.
        alpha: ``-adjusted_lr`` already read on the host (:func:`host_alphas`); ``None``: computed here.
    """
    param.mul_(1 - lr * weight_decay)
    if alpha is None:
        alpha = -adjusted_lr(lr, adjust_lr_fn, full_shape)
    if param.dtype == torch.bfloat16 and update.dtype == torch.bfloat16 and param.device.type == "cpu":
        _add_like_full_matrix(param, update, alpha, (int(full_shape[0]), int(full_shape[1])), region)
    else:
        if param.numel() >= _DENSE_ADD_MIN and param.device.type == "cpu" and update.stride() != param.stride():
            # A tall matrix's update is the transpose of NS's result: torch's add_ walks it strided, several times
            # slower than a bf16 copy into param's layout and a dense add_ (the same bits: [Note: the apply follows
            # torch's kernel path], fp32 arithmetic on both paths).
            update = torch.empty_like(param, dtype=update.dtype).copy_(update)
        param.add_(update, alpha=alpha)


def host_alphas(lr: Tensor, adjust_lr_fn: str | None, shapes: Sequence[tuple[int, int]]) -> dict:
    """``-adjusted_lr(lr, adjust_lr_fn, shape)`` of a tensor ``lr`` for each full shape, as Python floats read in one
    transfer: ``add_(alpha=t)`` turns a tensor alpha into the same double (``t.item()``), once per call, so on
    CUDA torch.optim.Muon syncs once per param; read here, a step syncs once (none for a CPU ``lr``)."""
    keys = sorted(set(shapes))
    if not keys:
        return {}
    return dict(zip(keys, torch.stack([-adjusted_lr(lr, adjust_lr_fn, k) for k in keys]).tolist()))


# Probe values for _scalar_path_elements: p + a*u with a = u = 1 + 2^-7 and p = 2^-8 (all exact in bf16). In fp32,
# p + a*u = 1 + 2^-6 + 2^-8 + 2^-14, which rounds to bf16 as 1 + 3*2^-7; rounding a*u to bf16 first drops the 2^-14
# and leaves an exact tie, which rounds to even: 1 + 2^-6. So the result tells the two kernel paths apart.
_PROBE_P, _PROBE_U = 2.0**-8, 1.0 + 2.0**-7
_PROBE_VECTOR, _PROBE_SCALAR = 1.0 + 3 * 2.0**-7, 1.0 + 2.0**-6
_ALL = "all"


@functools.lru_cache(maxsize=512)
def _scalar_path_elements(P: int, Q: int, threads: int) -> Tensor | str | None:
    """Which elements of a full ``(P, Q)`` bf16 matrix torch.optim.Muon's ``param.add_(O, alpha)`` computes element
    by element on this CPU (``threads``: ``torch.get_num_threads()``, part of the cache key because the thread
    chunks move the tails).

    Runs that ``add_`` once, with torch's layouts (contiguous param; ``O`` the transpose of a contiguous ``(Q, P)``
    tensor when ``P > Q``), on probe values whose two paths round differently.

    Returns:
        ``"all"`` (every element), an int64 tensor of flat indices ``i*Q + j`` (possibly empty), or ``None`` when
        the probe recognises neither rounding (then a plain ``add_`` is used, with a warning).
    """
    p = torch.full((P, Q), _PROBE_P, dtype=torch.bfloat16)
    u = torch.full((Q, P) if P > Q else (P, Q), _PROBE_U, dtype=torch.bfloat16)
    p.add_(u.mT if P > Q else u, alpha=_PROBE_U)
    scalar = p == _PROBE_SCALAR
    if not bool((scalar | (p == _PROBE_VECTOR)).all()):
        warn_user("OverlapMuon: this CPU's bf16 add_ kernel rounds neither way the apply knows; bf16 params "
                      "may differ from torch.optim.Muon in the last bit")
        return None
    if bool(scalar.all()):
        return _ALL
    return scalar.flatten().nonzero().flatten()


@functools.lru_cache(maxsize=4096)
def _local_positions(P: int, Q: int, threads: int, region: tuple[int, int, int, int]) -> Tensor | str | None:
    """:func:`_scalar_path_elements` restricted to ``region`` = ``(row0, rows, col0, cols)``, as flat indices into
    the ``(rows, cols)`` shard (``"all"`` and ``None`` pass through)."""
    full = _scalar_path_elements(P, Q, threads)
    if not isinstance(full, Tensor):
        return full
    r0, rows, c0, cols = region
    i, j = full // Q, full % Q
    inside = (i >= r0) & (i < r0 + rows) & (j >= c0) & (j < c0 + cols)
    return (i[inside] - r0) * cols + (j[inside] - c0)


def _add_like_full_matrix(
    param: Tensor, update: Tensor, alpha: float | Tensor, full_shape: tuple[int, int],
    region: tuple[int, int, int, int] | None,
) -> None:
    """``param.add_(update, alpha)`` on a bf16 CPU shard, each element rounded the way torch's kernel rounds it in the
    full matrix ([Note: the apply follows torch's kernel path])."""
    P, Q = full_shape
    region = (0, P, 0, Q) if region is None else tuple(int(v) for v in region)
    where = _local_positions(P, Q, torch.get_num_threads(), region)
    if where is None:
        param.add_(update, alpha=alpha)
        return
    if where == _ALL:
        # torch's own strided kernel: hand the update over with inner stride 2, which no size can make contiguous
        strided = torch.empty((*update.shape, 2), dtype=update.dtype, device=update.device)[..., 0]
        strided.copy_(update)
        param.add_(strided, alpha=alpha)
        return
    # alpha as the kernel sees it: the Python number (or the 0-d tensor's value) cast to fp32, then to bf16
    a = float(torch.tensor(float(alpha), dtype=torch.float32).bfloat16())
    pf, uf = param.float(), update.float()
    out = torch.add(pf, uf, alpha=a)  # vectorized path: a * u is exact in fp32, one rounding to fp32
    if where.numel():
        flat_p, flat_u = pf.reshape(-1)[where], uf.reshape(-1)[where]
        out.view(-1)[where] = flat_p + (flat_u * a).bfloat16().float()  # element path: product rounded to bf16
    param.copy_(out)  # fp32 -> bf16, round to nearest even (both kernel paths end with this conversion)


class CommitAtApply:
    """How a speculative wave commits its momentum: the pack computes the new momentum out of place (the NS input's
    source), and the apply, at ``step()``, recomputes it in place with the same op (bitwise the same), so the wave
    holds no momentum copy."""

    def pack(self, bufs: Sequence[Tensor], grads: Sequence[Tensor], momentum: float) -> list[Tensor]:
        """The new momentum of each shard (what the NS input is built from)."""
        return [momentum_update(b, g, momentum) for b, g in zip(bufs, grads)]

    def commit(self, j: int, buf: Tensor, grad: Tensor, momentum: float) -> None:
        """Commit item ``j``'s new momentum into ``buf`` (its committed buffer)."""
        momentum_update_(buf, grad, momentum)


class KeepForApply(CommitAtApply):
    """``async_step``: the apply runs after ``step()`` returns, when ``.grad`` may already be zeroed: the wave keeps
    the new momentum from the pack and the apply copies it (one momentum-sized copy per wave in flight)."""

    def __init__(self) -> None:
        self.kept: list[Tensor] = []

    def pack(self, bufs: Sequence[Tensor], grads: Sequence[Tensor], momentum: float) -> list[Tensor]:
        self.kept = super().pack(bufs, grads, momentum)
        return self.kept

    def commit(self, j: int, buf: Tensor, grad: Tensor, momentum: float) -> None:
        buf.copy_(self.kept[j])


class CommitAtPack(CommitAtApply):
    """A synchronous step's wave, launched inside ``step()`` after its gradient-presence agreement: nothing can make
    it stale, so the pack commits the momentum in place (``torch.optim.Muon``'s own op, no copy) and the apply has
    nothing left to commit. ``bufs`` are the committed buffers themselves."""

    def pack(self, bufs: Sequence[Tensor], grads: Sequence[Tensor], momentum: float) -> list[Tensor]:
        for b, g in zip(bufs, grads):
            momentum_update_(b, g, momentum)
        return list(bufs)

    def commit(self, j: int, buf: Tensor, grad: Tensor, momentum: float) -> None:
        return None


def create_momentum(state: dict, muon: Sequence[Any]) -> None:
    """Zero momentum for the params of ``muon`` that have a gradient and no momentum yet, created on the calling
    thread (``step()``) before any lane task writes it."""
    for m in muon:
        if m.param.grad is not None and "momentum_buffer" not in state.get(m.param, ()):
            state[m.param]["momentum_buffer"] = torch.zeros_like(m.param, memory_format=torch.preserve_format)
