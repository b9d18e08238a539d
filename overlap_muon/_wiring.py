"""The hooks' wiring of one optimizer: where its readiness comes from (per-param gradient hooks, DDP's comm hook,
a pipelining stage), ``async_step``'s forward waits, the ``state_dict`` waits and the version fix, and how all of
it is undone.

The runtime (``_runtime.py``) receives the readiness (``on_ready``, ``on_backward_end``, ``on_ddp_backward_end``);
this room only connects it. Every callback holds the runtime weakly (``hooks.weak_callback``): a dropped optimizer
is not kept alive by its hooks.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any

from torch import nn

from . import _version_fix as version_fix
from ._forward_waits import ForwardWaits
from ._hooks import GradReadyTracker, attach_ddp_readiness, watch_stage, weak_callback
from ._lanes import flag_to_host
from ._messages import warn_user

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

__all__ = ["Wiring"]


def _remove_all(handles: list, pipeline: Any, fixed: list[bool]) -> None:
    """Finalizer of an OverlapMuon (``close()`` or garbage collection): unhook, stop the lane threads, and give
    back the version fix (the last overlap optimizer removes it)."""
    for h in handles:
        h.remove()
    pipeline.close()
    if fixed[0]:
        version_fix.release()


class Wiring:
    """The hooks of one runtime ``rt`` (a ``_runtime.Runtime``: its params, config, pipeline and callbacks).

    Attributes:
        tracker: the per-param gradient-ready hooks (``None`` without overlap, or once DDP or a stage reports).
        waits: ``async_step``'s forward waits (``None`` otherwise).
        ddp_copies: an attached DDP without ``gradient_as_bucket_view`` ([Note: DDP readiness]).
        fixed: ``[whether this optimizer holds the version fix]``.
    """

    def __init__(self, rt: Any) -> None:
        self._rt = weakref.ref(rt)
        self.handles: list[Any] = []
        self.tracker: GradReadyTracker | None = None
        self.waits: ForwardWaits | None = None
        self.ddp_copies = False
        self.fixed = [False]
        self.warned_capture = False

    def hook(self, owner: Any, model: nn.Module, sync_hook: Callable[..., None]) -> weakref.finalize:
        """Gradient-ready hooks (overlap mode), ``async_step``'s forward waits, the ``state_dict`` wait, the version
        fix; returns the finalizer of ``owner`` that undoes them."""
        rt = self._rt()
        muon, config = rt.muon, rt.config
        if config.overlap and muon:
            self.tracker = GradReadyTracker([m.param for m in muon], weak_callback(rt.on_ready),
                                            on_backward_end=weak_callback(rt.on_backward_end),
                                            settle=rt.backwards.accumulating)
            self.handles.append(self.tracker)
            if rt.async_step:  # [Note: the step barrier]: only the asynchronous step needs forward waits
                self.waits = ForwardWaits(model, muon, rt.index, rt.pipeline, self.handles)
        # A submodule's state_dict() runs its own pre-hooks only: hook each module that holds a Muon param.
        mine = {id(m.param) for m in muon}
        self.handles += [mod.register_state_dict_pre_hook(sync_hook) for mod in model.modules()
                         if mod is model or any(id(p) in mine for p in mod.parameters(recurse=False))]
        self.fixed[0] = config.overlap  # the version fix is this optimizer's to give back (_remove_all)
        if config.overlap:  # [Note: DTensor foreach versions]: every gradient edit must move a version
            dtensors = [m.param for m in muon if isinstance(m.param, DTensor)]
            version_fix.acquire(dtensors[0].device_mesh if dtensors else None, flag_to_host)
        return weakref.finalize(owner, _remove_all, self.handles, rt.pipeline, self.fixed)

    def _drop_tracker(self) -> None:
        if self.tracker is not None:  # per-param hooks would read the gradients before DDP's reduction
            self.tracker.remove()
            self.tracker = None

    def attach_ddp(self, ddp_model: nn.Module) -> None:
        """Readiness from DDP's comm hook instead of the per-param hooks (``OverlapMuon.attach_ddp``)."""
        rt = self._rt()
        if not rt.config.overlap or not rt.muon:
            return
        self._drop_tracker()
        on_ready = weak_callback(rt.on_ready)
        self.ddp_copies = not getattr(ddp_model, "gradient_as_bucket_view", True)  # [Note: DDP readiness]
        if not attach_ddp_readiness(ddp_model, lambda idx: [on_ready(i) for i in idx], dict(rt.index.first),
                                    weak_callback(rt.on_ddp_backward_end)):
            warn_user("OverlapMuon: this DDP model already has a comm hook (DDP takes one), so the waves launch in "
                      "step() and nothing overlaps; register your comm hook after OverlapMuon(ddp_model), which "
                      "chains it, to keep the overlap")

    def attach_pipeline_stage(self, stage: Any) -> None:
        """Readiness from a pipelining stage, once its gradients are final ([Note: pipeline readiness] in
        ``hooks/pipeline_stage.py``), instead of the per-param hooks (``OverlapMuon.attach_pipeline_stage``)."""
        rt = self._rt()
        if not rt.config.overlap or not rt.muon:
            return
        self._drop_tracker()
        mine = [(rt.index.first[id(p)], p) for p in stage.submod.parameters() if id(p) in rt.index.first]
        on_ready = weak_callback(rt.on_ready)
        self.handles.append(watch_stage(stage, lambda: [on_ready(i) for i, p in mine if p.grad is not None]))

    def unhook_overlap(self) -> None:
        """The overlap is off for good ([Note: overlap where it pays]): nothing of it stays (the gradient-ready
        hooks, the version fix)."""
        self._drop_tracker()
        if self.fixed[0]:
            self.fixed[0] = False
            version_fix.release()

    def warn_captured(self) -> None:
        """[Note: CUDA graph capture] A backward captured in a CUDA graph (torchtitan's default: its
        ``training.disable_cuda_graphs=False``) runs the hooks during capture only, and nothing may be queued on
        the lanes then; on replay no hook runs. So such a backward launches nothing and ``step()`` launches every
        wave (exact, no overlap). ``step()`` itself inside a capture, and ``async_step``'s forward waits inside one,
        raise a clear error (``Lanes.refuse_capture``): their event queries and waits cannot be captured. Said
        once."""
        if not self.warned_capture:
            self.warned_capture = True
            warn_user("OverlapMuon: backward runs inside a CUDA graph capture, whose replays run no hook, so the "
                      "waves launch in step() and nothing overlaps (exact); capture the forward only, or set "
                      "torchtitan's training.disable_cuda_graphs=True, to keep the overlap")
