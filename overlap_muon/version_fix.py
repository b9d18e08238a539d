"""In-place foreach ops on DTensors bump version counters, so overlap mode sees a ``clip_grad_norm_``.

[Note: DTensor foreach versions] Overlap mode computes a wave from the gradients as backward leaves them and, at
``step()``, re-runs every wave whose gradients changed since: it compares each gradient's ``_version`` (and its
local tensor's) with the values it saw at launch (``pipeline.WavePipeline.stale``). torch (2.13 and earlier)
does not bump a DTensor's version counter for in-place *foreach* ops: ``torch._foreach_mul_([dt], c)`` changes
the local tensor and leaves both counters where they were (upstream: pytorch/pytorch#197502, open when this was
written). ``torch.nn.utils.clip_grad_norm_`` (default ``foreach``), ``clip_grad_value_`` and
``torch.amp.GradScaler.unscale_`` all edit gradients that way, so an FSDP2/TP user who clips between ``backward()``
and ``step()`` would get updates computed from the unclipped gradients: a silent difference from
``torch.optim.Muon``.

:func:`install` wraps the in-place foreach functions of the ``torch`` namespace (``torch._foreach_*_`` and
``torch._amp_foreach_non_finite_check_and_unscale_``, the names torch's own clipping, unscaling and optimizers
call) so that, after the original op, the DTensors of the mutated list (the first argument) get their version
counters incremented (``torch.autograd.graph.increment_version``), which is what the non-foreach ``Tensor.mul_``
already does and what the upstream fix does inside DTensor's dispatch. Nothing else changes: same op, same values,
no communication, no host-device sync. It is installed only where it is needed (``OverlapMuon(overlap=True)`` with
DTensor Muon params) and only when :func:`foreach_bumps_dtensor_versions` finds the bug, once per process.
Calls that reach the ops from C++ (``torch.ops.aten._foreach_mul_``, fused optimizer kernels) are not covered.
"""

from __future__ import annotations

import functools
import threading
from typing import Any, Callable

import torch

__all__ = ["foreach_bumps_dtensor_versions", "install", "installed", "INPLACE_FOREACH"]

#: The in-place foreach functions of the ``torch`` namespace that get wrapped (those present in this torch).
INPLACE_FOREACH: tuple[str, ...] = tuple(
    n for n in dir(torch) if (n.startswith("_foreach_") and n.endswith("_")) or n == "_amp_foreach_non_finite_check_and_unscale_"
)

_lock = threading.Lock()
_installed = False


def foreach_bumps_dtensor_versions(mesh: Any) -> bool:
    """Whether ``torch._foreach_mul_`` moves a DTensor's version counter (a probe on a 1-element replicated
    DTensor of ``mesh``'s device type; no collective, nothing shared). False on torch 2.13."""
    from torch.distributed.tensor import DTensor, Replicate

    local = torch.zeros(1, device=mesh.device_type)
    probe = DTensor.from_local(local, mesh, [Replicate()] * mesh.ndim, run_check=False)
    before = probe._version
    with torch.no_grad():
        torch._foreach_mul_([probe], 1.0)
    return probe._version != before


def _bumping(fn: Callable[..., Any]) -> Callable[..., Any]:
    from torch.distributed.tensor import DTensor

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        mutated = [t for t in self if isinstance(t, DTensor)] if isinstance(self, (list, tuple)) else []
        if mutated:
            torch.autograd.graph.increment_version(mutated)
        return out

    wrapper.__overlap_muon_version_fix__ = True  # type: ignore[attr-defined]
    return wrapper


def install(mesh: Any) -> bool:
    """Wrap :data:`INPLACE_FOREACH` (see [Note: DTensor foreach versions]) unless torch already bumps DTensor
    versions for them (probed on ``mesh``) or it is already installed. Idempotent and thread safe.

    Returns:
        True if the wrappers are in place after the call (installed now or earlier), False if torch needs none.
    """
    global _installed
    with _lock:
        if _installed:
            return True
        if foreach_bumps_dtensor_versions(mesh):
            return False
        for name in INPLACE_FOREACH:
            fn = getattr(torch, name)
            if not getattr(fn, "__overlap_muon_version_fix__", False):
                setattr(torch, name, _bumping(fn))
        _installed = True
        return True


def installed() -> bool:
    """Whether :func:`install` wrapped the foreach functions in this process."""
    return _installed
