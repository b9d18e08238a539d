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

import logging
import weakref
from typing import Any

from torch import Tensor, nn
from torch.distributed.tensor import DTensor

from . import _builder as builder
from ._comm import warm_up
from .config import OverlapMuonConfig
from ._domain import Domain
from ._hooks import ParamOwners, watch_for_ddp, weak_callback
from ._placement import local_tensor
from ._runtime import Runtime

logger = logging.getLogger("overlap_muon")

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
        recipe: :func:`_builder.place`'s keyword arguments (``muon_filter``, ``experts``, ``split``,
            ``max_grad_norm``, ``adamw_groups``, ``mesh``).
        qk_spec: the ``QKClip`` given, or ``None``.

    Attributes:
        muon: the Muon params as placed; runtime: the :class:`~overlap_muon._runtime.Runtime`; qk: the QK-clipper
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
        self._watch: Any = None  # hooks.watch_for_ddp's handle, until the first step
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
        """Sort and place the model's params, every check on every rank (``_builder.place``)."""
        return builder.place(self.model, self.config, self.rank, **self.recipe)

    def bind(self, placed: builder.Placement) -> None:
        """Groups, runtime, QK-clipper and hooks for the params of ``placed`` (collective: group creation)."""
        opt = self._opt()
        self.muon = placed.muon
        comm = builder.make_groups(placed, self.config, self.rank)
        if self.config.warm_up:  # [Note: warm-up] in _comm.py
            device = local_tensor(placed.muon[0].param).device if placed.muon else "cpu"
            opt.stats["warm_up_collectives"] += warm_up(comm, device, self.config.fused_a2a)
        self.domain, self.expert_domain = comm.dom_to, comm.expert[0] if comm.expert else Domain.single()
        self.names = {id(p): n for n, p in self.model.named_parameters()}
        ref = weakref.ref(opt)
        self.runtime = Runtime(placed.muon, self.config, opt.stats, opt._state, lambda: ref().param_groups, comm,
                               opt.defaults["ns_steps"])
        self.qk = builder.qk_clipper(self.qk_spec, self.model, placed, comm, self.rank, self.config)
        self.finalizer = self.runtime.wiring.hook(opt, self.model, weak_callback(self._sync_hook))
        if self.config.overlap and self._ddp is None:  # a DDP wrapped around the model later is attached
            self._watch = watch_for_ddp(self.model, weak_callback(self._found_ddp))
            self.runtime.wiring.handles.append(self._watch)
        self._bound = self._snapshot()

    def stop_watch(self) -> None:
        """A DDP is looked for until the first ``step()`` (a global forward pre-hook: not kept for the run)."""
        if self._watch is not None:
            self._watch.remove()
            self._watch = None

    def _found_ddp(self, ddp_model: nn.Module) -> None:
        logger.info("OverlapMuon: found a DistributedDataParallel around the model at its first forward; attached "
                    "(readiness from its averaged buckets)")
        self.attach_ddp(ddp_model)

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
        self.runtime.wiring.attach_ddp(ddp_model)

    def attach_pipeline_stage(self, stage: Any) -> None:
        """Readiness from a pipelining stage, kept across re-binding.

        Raises:
            TypeError: ``stage`` is not a pipelining stage (no ``submod``).
        """
        if not hasattr(stage, "submod") or not hasattr(stage, "scale_grads"):
            raise TypeError(f"attach_pipeline_stage expects a torch.distributed.pipelining stage, got "
                            f"{type(stage).__name__}")
        self._stages.append(weakref.ref(stage))
        self.runtime.wiring.attach_pipeline_stage(stage)

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
        foreign, lists, moved = follow_groups(opt.param_groups, self._bound[1], self.names,
                                                      dict(self.model.named_parameters()))
        counts = [f for f in foreign if f.startswith("param group ")]
        if counts:
            raise ValueError(
                f"OverlapMuon: params left or joined their param group after construction: {counts[:4]}. OverlapMuon "
                "plans its params, homes and waves once; to stop training a param, keep it in its group and leave "
                "its gradient None (requires_grad_(False)): a param without a gradient is skipped, as torch does. "
                "To change the set of params, build a new OverlapMuon")
        if foreign:
            raise ValueError(
                f"OverlapMuon: the param groups hold params that are not the model's: {foreign[:8]}; the optimizer "
                "follows params replaced in place of the model's own (fully_shard, Accelerate's preparation), not "
                "new ones: build a new OverlapMuon on the changed model")
        placed = self.place()  # without a device_mesh, the one the replaced params live on (builder._params_mesh)
        errors = rebind_errors(opt._state, moved, lists, placed)
        if errors:
            raise ValueError(f"OverlapMuon: the params were replaced, but {'; '.join(errors[:4])}")
        move_state(opt._state, moved)
        for group, params in zip(opt.param_groups, lists):
            group["params"], group["param_names"] = params, builder.param_names(self.model, params)
        self.finalizer()
        self._claim()
        self.bind(placed)
        self._reattach()
        return True

    def _reattach(self) -> None:
        ddp = self._ddp() if self._ddp is not None else None
        if ddp is not None:
            self.runtime.wiring.attach_ddp(ddp)
        for stage in [ref() for ref in self._stages]:
            if stage is not None:
                self.runtime.wiring.attach_pipeline_stage(stage)


# [Note: following the param groups]: the re-binding's pieces.
def follow_groups(groups: list[dict[str, Any]], bound: list[list[int]], names: dict[int, str],
                  named: dict[str, Tensor]) -> tuple[list[str], list[list[Tensor]], list[tuple[int, Tensor]]]:
    """Each group entry as the model's param: kept when it is one (Accelerate swapped it in), else the model's
    param of the name the entry had (``fully_shard`` replaced it in the model only).

    Args:
        groups: the optimizer's param groups now; bound: the param ids per group at the last binding; names: param
            id -> name at the last binding; named: the model's params by name now.

    Returns:
        ``(foreign, lists, moved)``: the entries that are neither (names or shapes, for the error), the new params
        of each group, and ``(old param id, new param)`` for every entry that changed. Nothing is modified.
    """
    mine = {id(p) for p in named.values()}
    foreign: list[str] = []
    lists: list[list[Tensor]] = []
    moved: list[tuple[int, Tensor]] = []
    for gi, group in enumerate(groups):
        was = bound[gi] if gi < len(bound) else []
        if len(group["params"]) != len(was):
            now = {id(p) for p in group["params"]}
            left = [names.get(i, f"an unnamed param (position {k})") for k, i in enumerate(was) if i not in now]
            foreign.append(f"param group {gi} has {len(group['params'])} params, {len(was)} when it was built"
                           + (f" ({left[:4]} left it)" if left else ""))
            continue
        new = []
        for old_id, p in zip(was, group["params"]):
            q = p if id(p) in mine else named.get(names.get(id(p), ""))
            if q is None:
                foreign.append(f"{names.get(id(p), 'an unnamed param')} of shape {tuple(p.shape)} (group {gi})")
                continue
            if id(q) != old_id:
                moved.append((old_id, q))
            new.append(q)
        lists.append(new)
    return foreign, lists, moved


def rebind_errors(state: dict[Tensor, Any], moved: list[tuple[int, Tensor]], lists: list[list[Tensor]],
                  placed: builder.Placement) -> list[str]:
    """Why the followed ``lists`` cannot be bound: the placement sorts them into other groups, or a replaced param's
    state does not fit its successor (a different shape, or a plain tensor against a DTensor)."""
    fresh = builder.group_params(placed.muon, placed.adamw_groups)
    errors = [f"param group {gi} would hold {[tuple(p.shape) for p in b][:4]} by placement, "
              f"{[tuple(p.shape) for p in a][:4]} by the groups" for gi, (a, b) in enumerate(zip(lists, fresh))
              if [id(p) for p in a] != [id(p) for p in b]]
    if len(lists) != len(fresh):
        errors.append(f"placement makes {len(fresh)} param groups, the optimizer has {len(lists)}")
    by_id = {id(k): k for k in state}
    for old_id, new in moved:
        for key, v in (state[by_id[old_id]] if old_id in by_id else {}).items():
            if isinstance(v, Tensor) and v.ndim > 0 and (
                    tuple(v.shape) != tuple(new.shape) or isinstance(v, DTensor) != isinstance(new, DTensor)
                    or isinstance(v, DTensor) and v.placements != new.placements):
                errors.append(f"its state {key!r} of shape {tuple(v.shape)} does not fit the new param of shape "
                              f"{tuple(new.shape)}; replace the params before the first step, or load the state "
                              "with load_state_dict after replacing them")
    return errors


def move_state(state: dict[Tensor, Any], moved: list[tuple[int, Tensor]]) -> None:
    """Key each replaced param's state by its successor (checked by :func:`rebind_errors`)."""
    by_id = {id(k): k for k in state}
    for old_id, new in moved:
        if old_id in by_id:
            state[new] = state.pop(by_id[old_id])
