"""``async_step``'s forward-wait and coverage policy: which module's forward waits for which waves.

With ``async_step=True``, ``step()`` returns before its updates land, and each module's next forward waits for the
waves holding the params that forward reads (a prepended forward pre-hook, ``hooks/forward_wait.py``). This module
owns that policy: the hooks, the waits (FSDP2's all-gather streams and prefetched modules included), compiled
regions ([Note: forward waits under torch.compile] in ``hooks/forward_wait.py``), the coverage check for weights
read outside their module's forward (re-run whenever the set of params with a gradient grows), and the fallback
when no forward runs between two steps. The default step needs none of it ([Note: the step barrier] in
``_runtime.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Sequence
from typing import Any

from torch import Tensor, nn
from torch.nn.modules.module import register_module_parameter_registration_hook

from ._placement import MuonParam
from ._hooks import (compile_boundary, fsdp_param_streams, params_read_by_module, register_forward_waits,
                     weak_callback)
from ._messages import warn_user


__all__ = ["ParamIndex", "ForwardWaits"]

try:
    from torch.distributed.fsdp import FSDPModule
except Exception:  # pragma: no cover
    FSDPModule = ()  # type: ignore[assignment]


class ParamIndex:
    """Muon params by tensor and by wave. A grouped expert weight is several Muon matrices: hooks and waits see the
    param once, under its first index (``first``), and it stands for all of its matrices (``siblings``)."""

    def __init__(self, muon: Sequence[MuonParam]) -> None:
        self.first: dict[int, int] = {}
        self.siblings: dict[int, list[int]] = {}
        for m in muon:
            self.siblings.setdefault(self.first.setdefault(id(m.param), m.index), []).append(m.index)
        self.wave_of: dict[int, int] = {}
        """Muon index -> its wave (set by the optimizer whenever it plans)."""

    def all_of(self, indices: Iterable[int]) -> set[int]:
        """Every Muon index of the params behind ``indices``."""
        return {j for i in indices for j in self.siblings.get(i, (i,))}

    def of_tensors(self, params: Iterable[Tensor]) -> set[int]:
        """Every Muon index of ``params`` (non-Muon params are ignored)."""
        return self.all_of(self.first[id(p)] for p in params if id(p) in self.first)

    def waves_of(self, indices: Iterable[int]) -> list[int]:
        return sorted({self.wave_of[i] for i in indices})


class ForwardWaits:
    """The forward waits of one optimizer (``async_step=True``). Holds no reference to the optimizer: the hooks
    hold this object weakly and the optimizer owns it.

    Args:
        model: the model whose modules get the waits.
        muon: the Muon params.
        index: the optimizer's :class:`ParamIndex`.
        pipeline: the wave pipeline whose ``wait(waves, streams)`` makes the caller wait for those waves' updates.
        handles: where to add the hook handles (removed with the optimizer's).
    """

    def __init__(self, model: nn.Module, muon: Sequence[MuonParam], index: ParamIndex,
                 pipeline: Any, handles: list[Any]) -> None:
        self.muon, self.index, self._pipeline, self._handles = list(muon), index, pipeline, handles
        self._model_ref = weakref.ref(model)
        self._root_id = id(model)
        self.covered: set[int] = set()  # Muon params a forward wait covered
        self.checked: set[int] = set()  # Muon params whose coverage has been checked
        self.forward_ran = False  # a forward of the model ran (coverage is checked from then on)
        self.forward_since_step = False  # a forward ran since the last step() (else step() waits itself)
        self._warned_no_forward = False
        self._at_boundary = False  # a compiled module's wait ran eagerly in this forward (reset at the root's)
        first = index.first
        self._module_params = params_read_by_module(model, first)
        # Every ancestor of a reading module gets a hook too: any of them may be compiled, and then it is the
        # boundary that waits for its subtree ([Note: forward waits under torch.compile]).
        self._subtree = {id(mod): {first[id(p)] for p in mod.parameters() if id(p) in first} for mod in model.modules()}
        self._on_traced_cb = weak_callback(self.on_traced)
        hooked = [mod for mod in model.modules() if self._subtree[id(mod)]]
        self._handles += register_forward_waits(hooked, weak_callback(self.wait_module), self._on_traced_cb)
        # Pruning and parametrizations re-register a weight (weight_orig, parametrizations.weight.original) right
        # before they read it for a mask or a right-inverse: that read must see the landed update.
        self._handles.append(register_module_parameter_registration_hook(weak_callback(self.on_registered)))

    def on_registered(self, module: nn.Module, name: str, param: Any) -> None:
        """Any module registers ``param`` (``torch.nn.utils.prune``, ``parametrize``): wait for its update."""
        if param is not None and id(param) in self.index.first:
            ids = self.index.of_tensors([param])
            self._pipeline.wait(self.index.waves_of(ids))

    def wait_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: wait for the waves of ``module``'s params, and of the modules FSDP2 will
        prefetch from ``module``'s pre-forward (``set_modules_to_forward_prefetch``), since that all-gather reads
        their shards before their own pre-hooks run. FSDP2's all-gather streams wait too ([Note: FSDP2 streams]
        in ``hooks/forward_wait.py``). A compiled module waits for its whole subtree."""
        self._pipeline.lanes.refuse_capture(
            "with async_step=True a forward captured in a CUDA graph cannot wait for the last step's updates (the "
            "capture may not wait on events recorded outside it, and a replay runs no hook); use the default step "
            "(async_step=False), whose step() orders its updates before whatever the stream runs next, replays too")
        mods = [module]
        if isinstance(module, FSDPModule):
            for other in getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", ()):
                mods.extend(getattr(other, "_modules", ()))
        indices = {i for m in mods for i in self._module_params.get(m, ())}
        self.forward_ran = self.forward_since_step = True
        boundary = compile_boundary(module)
        if boundary or id(module) == self._root_id:  # the root's forward starts a new forward: forget the last
            self._at_boundary = boundary
        if boundary:
            indices |= self._subtree.get(id(module)) or {m.index for m in self.muon
                                                         if any(m.param is p for p in module.parameters())}
        indices = self.index.all_of(indices)
        self.covered |= indices
        self._pipeline.wait(self.index.waves_of(indices), streams=fsdp_param_streams(module))

    def on_traced(self) -> None:
        """Trace time: Dynamo inlined a wait hook into a graph. The wait has moved to the compiled module whose hook
        ran eagerly before the trace; without one the compiled forward could read weights before their update
        lands. (Checked per forward, not per module: a graph break may run a submodule eagerly between the
        boundary's wait and a later trace.)

        Raises:
            RuntimeError: no compiled module's wait ran eagerly in this forward (e.g. ``torch.compile`` of a function
                calling the model: no hook of ours runs eagerly).
        """
        if self._at_boundary:
            return
        model = self._model_ref()
        if model is not None and type(model).__module__.startswith("torch.nn."):
            # torch.compile wraps a torch.nn class's whole __call__ (its hooks included), not only its forward; since
            # torch 2.14 so does module.compile() of a torch.nn class
            raise RuntimeError(
                f"OverlapMuon (async_step=True): compiling a torch.nn module (the model is a torch.nn "
                f"{type(model).__name__}) traces its forward hooks too: torch.compile(module) of a torch.nn class "
                "compiles its whole __call__, and since torch 2.14 so does module.compile(). No forward wait can then "
                "run eagerly and the compiled forward could read weights before their update lands. Compile modules "
                "of your own classes (block.compile() for each block), use model.compile() on torch 2.13, or use the "
                "default async_step=False (no forward waits)."
            )
        raise RuntimeError(
            "OverlapMuon (async_step=True): torch.compile traces a module's forward wait, but no compiled module of "
            "the model ran its wait eagerly first (the model is compiled from outside, e.g. torch.compile of a "
            "function that calls it, or a compiled torch.nn class such as nn.Linear, whose hooks torch 2.14 traces "
            "under module.compile() too), so the compiled forward could read weights before their update lands. "
            "Supported: per-block block.compile() / torch.compile(block) and model.compile() / torch.compile(model) "
            "of classes of your own; or use the default async_step=False (no forward waits)."
        )

    def wait_gradients_read(self) -> None:
        """At the end of ``step()``: make the caller wait until every committed wave has read its gradients (its pack
        task), so that the user may zero, free or overwrite ``.grad`` once ``step()`` returns. CPU: the host waits
        (the exchanges and NS go on); CUDA: the current stream waits on the pack events.

        Raises:
            RuntimeError: a lane task of the wave failed (its traceback is chained).
        """
        for st in self._pipeline.in_flight():
            if st.h_pack is not None:
                st.h_pack.wait()

    def register_wait(self, module: nn.Module, params: Iterable[Tensor]) -> None:
        """Make ``module``'s forward wait for ``params``' updates."""
        mine = self.index.of_tensors(params)
        self._module_params[module] = self._module_params.get(module, set()) | mine
        self.covered |= mine
        self._handles += register_forward_waits([module], weak_callback(self.wait_module), self._on_traced_cb)

    def after_step(self, waves: Sequence[int]) -> None:
        """At the end of ``step()``: check coverage, and wait here if no forward ran since the last step."""
        if self.forward_ran:
            self._cover_unwaited()
        if self.muon and not self.forward_since_step:
            self._no_forward_wait(waves)
        self.forward_since_step = False

    def _cover_unwaited(self) -> None:
        """Muon params that got a gradient for the first time although no forward wait ran for them are read outside
        their module's forward (e.g. ``F.linear(x, self.lin.weight)`` in a parent); wait for them at the root
        module's forward from now on, and say how to give a precise wait point. Checked whenever the set of params
        with a gradient grows (a block unfrozen later is covered too)."""
        model = self._model_ref()
        fresh = [m.index for m in self.muon if m.param.grad is not None and m.index not in self.checked]
        self.checked.update(fresh)
        loose = [i for i in fresh if i not in self.covered]
        if not loose or model is None:
            return
        self.register_wait(model, [self.muon[i].param for i in loose])
        warn_user(
            f"OverlapMuon: Muon params {[self.muon[i].name for i in loose]} got a gradient but no forward of the "
            "module owning them ran; they are read elsewhere, so the model's own forward now waits for their "
            "updates. For a later, precise wait point use opt.register_wait(module, params).")

    def _no_forward_wait(self, waves: Sequence[int]) -> None:
        """No forward of the model ran since the last ``step()`` (the loss was built from the params directly, or
        the model is run through something that skips its modules' forwards): nothing would wait for these updates
        before the weights are read again, so wait now, as a forward would (CPU: the host; CUDA: the current
        stream), and say so once."""
        if not self._warned_no_forward:
            self._warned_no_forward = True
            warn_user(
                "OverlapMuon (async_step=True): no forward of the model ran since the last step(), so no forward wait "
                "could hold back reads of the updated weights; step() now waits for its updates itself (the "
                "overlap with the next forward is lost). Run the model's forward, or read weights after "
                "opt.wait_for(params).")
        self._pipeline.wait(list(waves))
