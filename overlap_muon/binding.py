"""The params an ``OverlapMuon`` drives and everything bound to them, and following them when they are replaced.

[Note: following the param groups] The runtime is bound to the params it was built on: its hooks sit on them, its
plan routes their layout. Frameworks replace them after the optimizer exists: Accelerate's FSDP2 preparation calls
``fully_shard`` and then swaps each ``param_groups`` entry for its sharded param
(``accelerate.utils.fsdp_utils.fsdp2_switch_optimizer_parameters``); ``fully_shard`` by hand replaces the model's
params and leaves the groups alone; ``model.to(device)`` moves them. ``swap_tensors``, ``to_empty()`` and ``.to()``
keep each param object, so only the device can change there; ``torch.nn.utils.prune`` re-registers a weight under
another name (``weight_orig``), the same tensor.

Each ``step()``, ``state_dict()`` and ``load_state_dict()`` first compares the model's params (as a set) and the
groups' param ids and the device with those of the binding (:meth:`ParamBinding.follow`; a few microseconds per
hundred params). When they differ, it re-binds, on every rank (these calls are collective in a distributed job, as
is the swap): each group entry becomes the model's param of the same name (a group entry that is neither the param
it replaced nor a param of the model is a ``ValueError`` naming it), placement runs again (the params' DTensor mesh
is taken as the ``device_mesh`` when the constructor got none: a 1-D FSDP mesh is the remat dim), the state of a
replaced param moves to its successor when the shapes fit (a ``ValueError`` otherwise), and the hooks move to the
new params. The step that re-binds launches every wave in ``step()`` (backward ran before the hooks moved); the
next ones overlap again.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import nn

from . import builder
from .config import OverlapMuonConfig
from .domain import Domain
from .hooks import ParamOwners, weak_callback
from .runtime import Runtime

__all__ = ["ParamBinding"]

# One live OverlapMuon drives a param at a time (its hooks would apply every update twice otherwise).
_OWNERS = ParamOwners(lambda opt: (b := opt.__dict__.get("_binding")) is not None and b.alive)


class ParamBinding:
    """Claims, places and binds one optimizer's params (groups, runtime, QK-clipper, hooks), and re-binds them when
    they are replaced ([Note: following the param groups]).

    Args:
        opt: the optimizer (held weakly): its param groups, state, counters and ``ns_steps``.
        model: the model (held as torch optimizers hold their params: the params it replaces are not).
        config: the options.
        rank: this rank.
        recipe: :func:`builder.place`'s keyword arguments (``muon_filter``, ``experts``, ``split``,
            ``max_grad_norm``, ``adamw_groups``, ``mesh``).
        qk_spec: the ``QKClip`` given, or ``None``.

    Attributes:
        muon: the Muon params as placed; runtime: the :class:`~overlap_muon.runtime.Runtime`; qk: the QK-clipper
        (``None`` without one); domain, expert_domain: this rank's domains; names: param id -> name at binding.

    Raises:
        RuntimeError: another live ``OverlapMuon`` drives the model's params (at construction).
    """

    def __init__(self, opt: Any, model: nn.Module, config: OverlapMuonConfig, rank: int, recipe: dict[str, Any],
                 qk_spec: Any) -> None:
        self._opt = weakref.ref(opt)
        self.model, self.config, self.rank, self.recipe, self.qk_spec = model, config, rank, recipe, qk_spec
        self.finalizer: weakref.finalize | None = None
        self._ddp: Any = None
        self._stages: list[Any] = []
        self._claim()

    @property
    def alive(self) -> bool:
        """Bound, and not closed."""
        return self.finalizer is not None and self.finalizer.alive

    def _claim(self) -> None:
        _OWNERS.claim(self.model.parameters(), self._opt(), "OverlapMuon: another live OverlapMuon already drives "
                      "this model's params; call its close() before building a new one on the same model")

    def place(self) -> builder.Placement:
        """Sort and place the model's params, every check on every rank (``builder.place``)."""
        return builder.place(self.model, self.config, self.rank, **self.recipe)

    def bind(self, placed: builder.Placement) -> None:
        """Groups, runtime, QK-clipper and hooks for the params of ``placed`` (collective: group creation)."""
        opt = self._opt()
        self.muon = placed.muon
        comm = builder.make_groups(placed, self.config, self.rank)
        self.domain, self.expert_domain = comm.dom_to, comm.expert[0] if comm.expert else Domain.single()
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        ref = weakref.ref(opt)
        self.runtime = Runtime(placed.muon, self.config, opt.stats, opt._state, lambda: ref().param_groups, comm,
                               opt.defaults["ns_steps"])
        self.qk = builder.qk_clipper(self.qk_spec, self.model, placed, comm, self.rank, self.config)
        self.finalizer = self.runtime.hook(opt, self.model, weak_callback(self._sync_hook))
        self._bound = self._snapshot()

    def _sync_hook(self, *_: Any) -> None:  # a state_dict pre-hook: the saved weights are the updated ones
        self.runtime.synchronize()

    def _snapshot(self) -> tuple:
        """What :meth:`follow` compares: the ids of the model's params (a set: pruning re-registers a weight under
        another name, the same tensor), of each group's params, and the device."""
        params = list(self.model.parameters())
        return (frozenset(id(p) for p in params), [[id(p) for p in g["params"]] for g in self._opt().param_groups],
                params[0].device if params else None)

    def attach_ddp(self, ddp_model: nn.Module) -> None:
        """Readiness from ``ddp_model``'s comm hook, kept across re-binding.

        Raises:
            TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"attach_ddp expects a DistributedDataParallel, got {type(ddp_model).__name__}")
        self._ddp = weakref.ref(ddp_model)
        self.runtime.attach_ddp(ddp_model)

    def attach_pipeline_stage(self, stage: Any) -> None:
        """Readiness from a pipelining stage, kept across re-binding.

        Raises:
            TypeError: ``stage`` is not a pipelining stage (no ``submod``).
        """
        if not hasattr(stage, "submod") or not hasattr(stage, "scale_grads"):
            raise TypeError(f"attach_pipeline_stage expects a torch.distributed.pipelining stage, got "
                            f"{type(stage).__name__}")
        self._stages.append(weakref.ref(stage))
        self.runtime.attach_pipeline_stage(stage)

    def follow(self) -> bool:
        """Re-bind when the params were replaced ([Note: following the param groups]); returns whether it did.

        Raises:
            ValueError: a group entry is not the model's param, or a replaced param's state does not fit its
                successor (on every rank; nothing is changed).
        """
        if self._snapshot() == self._bound:
            return False
        opt = self._opt()
        self.runtime.synchronize()
        self.runtime.discard()
        foreign, lists, moved = builder.follow_groups(opt.param_groups, self._bound[1], self.names,
                                                      dict(self.model.named_parameters()))
        if foreign:
            raise ValueError(
                f"OverlapMuon: the param groups hold params that are not the model's: {foreign[:8]}; the optimizer "
                "follows params replaced in place of the model's own (fully_shard, Accelerate's preparation), not "
                "new ones: build a new OverlapMuon on the changed model")
        mesh = dict(self.recipe["mesh"])
        if all(mesh[k] is None for k in ("device_mesh", "tp_group", "remat_group")):
            mesh["device_mesh"] = builder.dtensor_mesh(lists[0])
        placed = builder.place(self.model, self.config, self.rank, **dict(self.recipe, mesh=mesh))
        errors = builder.rebind_errors(opt._state, moved, lists, placed)
        if errors:
            raise ValueError(f"OverlapMuon: the params were replaced, but {'; '.join(errors[:4])}")
        builder.move_state(opt._state, moved)
        for group, params in zip(opt.param_groups, lists):
            group["params"] = params
        self.finalizer()
        self._claim()
        self.recipe["mesh"] = mesh
        self.bind(placed)
        self._reattach()
        return True

    def _reattach(self) -> None:
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is not None:
            self.runtime.attach_ddp(ddp)
        for stage in [ref() for ref in self._stages]:
            if stage is not None:
                self.runtime.attach_pipeline_stage(stage)
