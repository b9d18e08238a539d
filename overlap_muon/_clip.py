"""Gradient clipping by the global norm, exact against ``torch.nn.utils.clip_grad_norm_``, for ``max_grad_norm``.

[Note: clipping and speculative waves] The clip coefficient ``min(1, max_norm / (||g|| + 1e-6))`` enters every
momentum update, but it is known only after the last gradient of the step. Two ways keep the overlap:
(a) send the homes what they need to apply the coefficient themselves (the raw gradient and momentum shards
instead of one bf16 NS input: three times the bytes, and the home redoes the elementwise math), or (b) speculate
that the coefficient is 1 (the waves launched in backward read the unclipped gradient) and, in ``step()``, multiply
the gradients only when clipping bites; the multiplication moves their version counters, so exactly those steps'
waves are re-run (``WavePipeline.commit``). Multiplying by a clamped coefficient of exactly 1.0 changes no bit, so
skipping it is exact. We keep (b): it sends no extra bytes, costs nothing on the steps where clipping does not bite
(in LLM training the norm exceeds the bound mostly early on), and is exact by construction because it runs
torch's own arithmetic. Its cost: the steps that clip lose their overlap (measured in the ``overlap`` bench case).
On CPU the decision reads one scalar on the host; on CUDA nothing is read: the gradients are always multiplied and
the waves' content check tells a coefficient of exactly 1.0 ([Note: a clip that does not bite] in
``_version_fix.py``).
Where clipping bites step after step, the runtime stops speculating after the first such step and launches the
waves in ``step()``, after the clip ([Note: learned clipping] in ``scheduler/dispatch.py``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ._lanes import flag_to_host
from ._placement import local_tensor
from ._version_fix import FlagQueue, host_read_free, note_device_clip, versions

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

__all__ = ["clip_grads_by_total_norm_", "ClipCount"]


def clip_grads_by_total_norm_(grads: Sequence[Tensor], max_norm: float) -> tuple[Tensor, bool | Tensor]:
    """Scale ``grads`` in place by ``min(1, max_norm / (total_norm + 1e-6))``, as ``clip_grad_norm_`` does.

    The arithmetic is ``torch.nn.utils.get_total_norm`` + ``clip_grads_with_norm_`` (torch 2.13, non-foreach
    path, which is what CPU tensors take): per-gradient 2-norms, the 2-norm of their stack, the clamped coefficient,
    one ``mul_`` per gradient. A DTensor gradient's norm is reduced over its mesh (``full_tensor()``), so
    TP-replicated and sharded gradients count once whatever their mesh (torch's own ``clip_grad_norm_`` cannot
    stack norms from different meshes).

    Args:
        grads: every gradient of the model (plain tensors or DTensors); modified in place when clipping bites.
        max_norm: the bound, > 0.

    Returns:
        ``(total_norm, clipped)``: the 0-d float total norm (before clipping) and whether the gradients were
        scaled (False when the coefficient is exactly 1.0: no bit would change). On a device (CUDA) the
        coefficient is not read: the gradients are always multiplied (by exactly 1.0 where it does not bite: same
        bits; the waves' content check sees it, [Note: a clip that does not bite] in ``_version_fix.py``) and
        ``clipped`` is a 0-d bool tensor on the device (:class:`ClipCount` counts it once readable).
    """
    if not grads:
        return torch.zeros(()), False
    norms = [torch.linalg.vector_norm(g) for g in grads]
    norms = [n.full_tensor() if isinstance(n, DTensor) else n for n in norms]
    device = norms[0].device
    total = torch.linalg.vector_norm(torch.stack([n.to(device) for n in norms]))
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    on_host = host_read_free(coef.device)
    if on_host and bool(coef == 1.0):  # [Note: clipping and speculative waves]: the one host read (CPU)
        return total, False
    before = [versions(g) for g in grads] if not on_host else []
    for g in grads:
        local_tensor(g).mul_(coef.to(g.device))
    if on_host:
        return total, True
    note_device_clip(list(grads), before, coef)
    return total, (coef < 1.0) | coef.isnan()


class ClipCount:
    """Counts the steps whose clip bit, without a host sync: a device flag is counted once the copy that carries
    it to the host has completed (``_lanes.flag_to_host``), a step or more later."""

    def __init__(self) -> None:
        self._pending = FlagQueue()

    def add(self, clipped: bool | Tensor) -> int:
        """Take this step's ``clipped``; returns how many steps' flags are now known to have bitten."""
        if not isinstance(clipped, Tensor):
            return int(clipped) + sum(self._pending.drain())
        self._pending.push(flag_to_host(clipped))
        return sum(self._pending.drain())
