"""``OverlapMuon``: layer-sharded Muon whose optimizer work hides inside backward and the next forward.

This class wires the parts: params sorted into Muon matrices and AdamW params; the domain and its checks
(``overlap_muon.domain``); gradient-ready hooks (``hooks``) -> the wave dispatcher (``scheduler``) -> the wave
pipeline (``overlap_muon.pipeline``, where [Note: one matrix from hook to forward wait] follows one matrix
through a step); forward pre-hooks -> pipeline waits. ``step()`` commits: only it changes params and state.

[Note: exactness] Momentum, Nesterov, the bf16 cast, weight decay and the update are elementwise
(``overlap_muon.muon_math``), so each rank runs them on its own shard; only NS needs the whole matrix, which the
home assembles bit for bit, and the learning-rate ratio uses the full logical shape. The result equals
``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import builder, version_fix
from .checks import check_plan_everywhere
from .clip import clip_grads_by_total_norm_
from .config import OverlapMuonConfig, resolve_config
from .domain import Domain, local_tensor
from .forward_waits import ForwardWaits, ParamIndex
from .hooks import GradReadyTracker, ParamOwners, ddp_readiness_hook, weak_callback
from .muon_math import check_hyperparameters
from .ns import DEFAULT_NS_COEFFICIENTS
from .pipeline import Hyper, WavePipeline
from .scheduler import ReadinessRecorder, WaveDispatcher
from .scheduler.waves import Wave
from .split import SplitArg
from .state import checkpoint_errors, checkpoint_meta, init_adamw_state

__all__ = ["OverlapMuon", "StepPhase"]

logger = logging.getLogger("overlap_muon")

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

# One live OverlapMuon drives a param at a time (its hooks would apply every update twice otherwise).
_OWNERS = ParamOwners(lambda opt: getattr(opt, "_finalizer", None) is not None and opt._finalizer.alive)


class StepPhase(enum.Enum):
    """Where an ``OverlapMuon`` is in the training step (as FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()
    """Between steps: backward's gradient-ready hooks launch waves, speculatively."""
    ACCUMULATING = enum.auto()
    """Inside ``no_sync()``: backward launches nothing (the last micro-batch's backward will)."""
    STEP = enum.auto()
    """Inside ``step()``: waves launched now are validated and committed by this call."""
    SYNC_STEP = enum.auto()
    """Inside a synchronous ``step()`` after its gradient-presence agreement: launched waves commit their momentum
    as they pack (nothing can make them stale)."""


def _remove_all(handles: list, pipeline: WavePipeline, fixed: bool) -> None:
    """Finalizer of an OverlapMuon (``close()`` or garbage collection): unhook, stop the lane threads, and give
    back the version fix (the last overlap optimizer removes it)."""
    for h in handles:
        h.remove()
    pipeline.close()
    if fixed:
        version_fix.release()


class OverlapMuon(torch.optim.Optimizer):
    """Layer-sharded Muon for 2-D weights plus ``torch.optim.AdamW`` for every other param.

    Args:
        model: the model (``nn.Module``; a ``DistributedDataParallel`` is unwrapped and attached, see
            :meth:`attach_ddp`); its params are sorted into Muon matrices (``muon_filter``) and AdamW params.
            Tied params are handled once. Params with ``requires_grad=False`` are kept too (updated once they get
            a gradient, as torch optimizers do).
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: Muon
            hyper-parameters with ``torch.optim.Muon``'s names, defaults and meaning (``lr`` may be a 0-d tensor,
            kept as one). ``ns_coefficients`` may also be a sequence of ``ns_steps`` per-step ``(a, b, c)``.
        adamw_kwargs: passed verbatim to the ``torch.optim.AdamW`` of the non-Muon params (default ``{}``).
        max_grad_norm: when set, ``step()`` clips every gradient (Muon and AdamW, every rank) by the global norm,
            exactly as ``torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)`` between backward and
            ``step()`` would, keeping the overlap on steps where clipping does not bite ([Note: clipping and
            speculative waves] in ``overlap_muon/clip.py``); ``last_grad_norm`` holds the norm before clipping.
            Needs DTensor params or one process (a plain-tensor shard cannot tell which peers hold copies).
        split: fused weights orthogonalized as their parts (split QKV, fused gate/up, per-head blocks): a mapping
            from param names (``fnmatch`` patterns) to a :class:`~overlap_muon.split.RowSplit`, or a callable
            ``(name, param) -> RowSplit | None``; equal to ``torch.optim.Muon`` on each part as its own param.
        adamw_groups: several AdamW groups: ``[{"params": selector, **overrides}, ...]``; the selector is a
            ``(name, param) -> bool`` callable or an iterable of param names (or params); the overrides (``lr``,
            ``weight_decay``, ...) replace ``adamw_kwargs`` for that group; a param goes to the first group that
            selects it, the rest to a last group with ``adamw_kwargs`` (``overlap_muon.sorting.adamw_param_groups``).
            The groups follow the Muon group in ``param_groups`` (each with ``algorithm="adamw"``), so LR schedulers
            and ``state_dict`` cover them.
        muon_filter: ``(name, param) -> bool`` picking Muon params; default ([Note: the default split] in
            ``overlap_muon/sorting.py``): 2-D weights of ``nn.Linear`` and HF ``Conv1D`` modules, except embeddings
            (and weights tied to them) and the output head. A ``Conv1D`` weight (stored ``(in, out)``) is
            orthogonalized and lr-scaled as its ``(out, in)`` transpose, whichever the filter.
        device_mesh: the ``DeviceMesh`` over which the Muon params are DTensors: ``remat_dim`` and ``tp_dim`` name
            its domain dims (defaults ``"remat"``, ``"tp"``; ``None`` for a dim the domain lacks); any other dim
            (e.g. ``"dp_replicate"``) is a replicate dim whose indices each hold a domain of their own. A 1-D mesh
            is TP only when its dim is named ``tp_dim``, else remat only.
        remat_dim, tp_dim: see ``device_mesh`` (torchtitan: ``remat_dim="dp_shard"`` or ``"fsdp"``).
        tp_group, remat_group: explicit groups for plain-tensor params (each carrying ``partition_dim``; a plain
            param without one holds the whole matrix and is replicated: [Note: replicated params] in ``domain.py``).
        experts: the expert params (MoE), routed on their own domain ([Note: two domains] in ``discovery.py``): an
            ``fnmatch`` pattern of param names, a list of them, or a ``(name, param) -> bool`` callable. A selected
            param is a Muon param (with a custom ``muon_filter``, the filter must pick it too): a 2-D linear of one
            expert, or a 3-D ``(E, P, Q)`` grouped weight, which is ``E`` matrices for NS (equal to
            ``torch.optim.Muon`` on each ``(P, Q)`` matrix as its own param; named ``"{name}[e]"``, ``e`` local).
        expert_mesh, ep_dim, etp_dim: the ``DeviceMesh`` over which expert params are DTensors, and its
            expert-parallel and expert-TP dim names (3-D params: ``Shard(0)`` on ``ep_dim``; ``Shard(1)``,
            ``Shard(2)`` or ``Replicate`` on ``etp_dim``). Every EP index holds its own experts; the ETP ranks
            of one index are the expert domain.
        etp_group: for plain-tensor expert params sharded over expert TP: this rank's ETP group (each param
            carrying ``partition_dim`` 0 or 1 of its ``(P, Q)`` matrices). Without ``expert_mesh`` and
            ``etp_group`` every rank's experts are its own (ETP 1): NS runs locally, nothing is exchanged.
        mode, fused_a2a, batch_ns, balance, overlap, wave_plan, wave_slots, side_streams, nvtx, pg_timeout_s,
            readiness_order, skip_nonfinite, syrk, check_grad_presence: options (``overlap_muon.config``); ``None``
            takes the environment variable or the default.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a hyper-parameter is out of range, the mesh does not have the named dims (this error alone:
            the per-param checks would be meaningless), a Muon param is not a real 2-D matrix, a param's placements
            or local shape do not fit the domain (the message names the param, its shape and the expectation), an
            ``adamw_groups`` entry names a missing or Muon param, or an option is malformed. Raised on every rank,
            before any exchange.
        RuntimeError: another live ``OverlapMuon`` drives the same params (``close()`` it first).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float | Tensor = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = DEFAULT_NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        max_grad_norm: float | None = None,
        split: SplitArg = None,
        adamw_kwargs: dict[str, Any] | None = None,
        muon_filter: Callable[[str, Tensor], bool] | None = None,
        device_mesh: Any = None,
        remat_dim: str | None = "remat",
        tp_dim: str | None = "tp",
        adamw_groups: list[dict[str, Any]] | None = None,
        tp_group: dist.ProcessGroup | None = None,
        remat_group: dist.ProcessGroup | None = None,
        experts: Any = None,
        expert_mesh: Any = None,
        ep_dim: str = "ep",
        etp_dim: str = "etp",
        etp_group: dist.ProcessGroup | None = None,
        **options: Any,
    ) -> None:
        model, ddp = builder.unwrap(model)
        check_hyperparameters(lr, weight_decay, momentum, eps, adjust_lr_fn, ns_coefficients, ns_steps)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        if muon_filter is not None and not callable(muon_filter):
            raise TypeError("muon_filter must be callable (name, param) -> bool")
        self.max_grad_norm = max_grad_norm
        self.config: OverlapMuonConfig = resolve_config(**options)
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        _OWNERS.claim(model.parameters(), self, "OverlapMuon: another live OverlapMuon already drives this model's "
                      "params; call its close() before building a new one on the same model")
        # 1. sort, place, check on every rank (builder.py)
        placed = builder.place(model, self.config, self._rank, muon_filter=muon_filter, experts=experts, split=split,
                               max_grad_norm=max_grad_norm, adamw_groups=adamw_groups,
                               mesh=dict(device_mesh=device_mesh, remat_dim=remat_dim, tp_dim=tp_dim, tp_group=tp_group,
                                         remat_group=remat_group, expert_mesh=expert_mesh, ep_dim=ep_dim,
                                         etp_dim=etp_dim, etp_group=etp_group))
        self._muon = placed.muon
        # 2. the runtime's groups (comm.py), then torch.optim's plumbing: one Muon group, then AdamW's
        comm = builder.make_groups(placed, self.config, self._rank)
        self.domain = comm.dom_to
        """This rank's :class:`~overlap_muon.domain.Domain` (sizes R x T, coordinates g, t)."""
        self.expert_domain = comm.expert[0] if comm.expert else Domain.single()
        """This rank's expert domain (``1 x ETP``; ``1 x 1`` without ETP or without expert params)."""
        self._adamw = torch.optim.AdamW(placed.adamw_groups, **(adamw_kwargs or {})) if placed.adamw_groups else None
        muon_group = dict(params=list({id(m.param): m.param for m in self._muon}.values()), algorithm="muon", lr=lr,
                          weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                          ns_coefficients=ns_coefficients, ns_steps=ns_steps, eps=eps, adjust_lr_fn=adjust_lr_fn)
        groups = [muon_group] + [dict(g, algorithm="adamw") for g in (self._adamw.param_groups if self._adamw else ())]
        super().__init__(groups, {k: v for k, v in muon_group.items() if k not in ("params", "algorithm")})
        self._link_adamw()  # State is created at a param's first gradient, as torch does ([Note: lazy state]).
        self._model_params = list(model.parameters())
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        # 3. the runtime (pipeline.py) and the plan
        self.stats: dict[str, int] = defaultdict(int)
        """Counters: ``ns_matrices`` (matrices NS'd on this rank), ``ns_calls`` (zeropower calls),
        ``waves_launched``, ``reruns`` (waves re-run at ``step()`` because their inputs changed), ``steps``,
        ``skipped_steps``."""
        self._build_runtime(comm, ns_steps)
        # 4. hooks
        self._phase = StepPhase.IDLE
        self._step_count = 0
        self._warned_reruns = False
        self._handles: list[Any] = []
        self._tracker: GradReadyTracker | None = None
        self._waits: ForwardWaits | None = None
        self._hook(model)
        self._built = True
        if ddp is not None:
            self.attach_ddp(ddp)
        if self._rank == 0:
            logger.info("%s", self.config.describe())

    def _build_runtime(self, comm: Any, ns_steps: int) -> None:
        """The wave pipeline on this rank's groups, and the waves planned in reverse registration order (compared
        across ranks)."""
        device = local_tensor(self._muon[0].param).device if self._muon else torch.device("cpu")
        self._pipeline = WavePipeline(self._muon, self.state, comm.dom_to, comm.dom_from, self.config, device,
                                      self.stats, comm.ctrl, expert_doms=comm.expert, dp_slots=comm.dp,
                                      team_group=comm.team)
        self._async = self.config.overlap and self.config.async_step
        self._pipeline.keep_momentum = self._async  # the apply runs after step() returns: it must not read .grad
        self._pipeline.adamw_params = [p for g in self.param_groups[1:] for p in g["params"]]
        self._index = ParamIndex(self._muon)
        self._costs = builder.ns_costs(self._muon, ns_steps)
        self._recorder = ReadinessRecorder(len(self._muon)) if self.config.readiness_order == "observed" else None
        self._plan(list(reversed(range(len(self._muon)))))
        check_plan_everywhere(self._muon, self._waves, [p.describe() for p in self._plans])

    def _hook(self, model: nn.Module) -> None:
        """Gradient-ready hooks (overlap mode), ``async_step``'s forward waits, the ``state_dict`` wait, the version
        fix; the finalizer that undoes them."""
        if self.config.overlap and self._muon:
            self._tracker = GradReadyTracker([m.param for m in self._muon], weak_callback(self._on_ready),
                                             on_backward_end=weak_callback(self._on_backward_end))
            self._handles.append(self._tracker)
            if self._async:  # [Note: the step barrier]: only the asynchronous step needs forward waits
                self._waits = ForwardWaits(model, self._muon, self._index, self._pipeline, self._handles)
        self._handles.append(model.register_state_dict_pre_hook(weak_callback(self._sync_hook)))
        self._fsdp_roots = builder.fsdp_roots(model)
        if self.config.overlap:  # [Note: DTensor foreach versions]: every gradient edit must move a version
            dtensors = [m.param for m in self._muon if isinstance(m.param, DTensor)]
            version_fix.acquire(dtensors[0].device_mesh if dtensors else None)
        self._finalizer = weakref.finalize(self, _remove_all, self._handles, self._pipeline, self.config.overlap)

    # ------------------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------------------
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: params, domain layout, homes, waves and hooks are planned once.

        Raises:
            ValueError: called after construction (build a new ``OverlapMuon`` for a changed model).
        """
        if getattr(self, "_built", False):
            raise ValueError(
                "OverlapMuon plans its params, homes, waves and hooks at construction; add_param_group is not "
                "supported afterwards: build a new OverlapMuon for the changed model"
            )
        super().add_param_group(param_group)

    def _link_adamw(self) -> None:
        """Share state and param-group dicts with the inner AdamW and the pipeline (``load_state_dict`` replaces
        them), so LR schedulers, ``state_dict`` and the waves see one state."""
        if getattr(self, "_pipeline", None) is not None:
            self._pipeline.state = self.state
        if self._adamw is not None:
            self._adamw.state = self.state
            self._adamw.param_groups = self.param_groups[1:]

    def _plan(self, order: list[int]) -> None:
        """Plan the waves for a gradient-ready ``order`` (``builder.plan``) and hand their frozen plans to the
        pipeline."""
        dp = self._pipeline.dp
        self._waves, self._plans = builder.plan(order, self._muon, self._costs, self.config,
                                                (self.domain.size, self.expert_domain.size),
                                                dp.size if dp is not None else 1, self._pipeline.lanes.cuda)
        self._pipeline.set_plans(self._plans)
        self._index.wave_of = {i: w.index for w in self._waves for i in w.params}
        self._dispatcher = WaveDispatcher(self._waves, self._launch)

    # ------------------------------------------------------------------------------------------------------
    # hooks -> dispatcher -> pipeline; forward waits -> pipeline
    # ------------------------------------------------------------------------------------------------------
    def _on_ready(self, first: int) -> None:
        if self._phase is StepPhase.ACCUMULATING:
            return
        for i in self._index.siblings[first]:
            if self._dispatcher.launched > self._index.wave_of[i]:
                # A new backward before step(): its gradients supersede the waves already launched.
                self._pipeline.discard()
                self._dispatcher.reset()
            if self._recorder is not None:
                self._recorder.mark_ready(i)
            self._dispatcher.mark_ready(i)

    def _on_backward_end(self) -> None:
        if self._phase is not StepPhase.ACCUMULATING:
            self._dispatcher.flush()

    def _launch(self, wave: Wave) -> None:
        self._pipeline.launch(wave, Hyper.of(self.param_groups[0]), committed=self._phase is StepPhase.SYNC_STEP)

    def _sync_hook(self, *_: Any) -> None:
        self.synchronize()

    # ------------------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step: the only call that changes params and optimizer state.

        Launches the waves backward has not (params without a gradient are skipped), re-runs the waves whose
        gradients or momentum/NS hyper-parameters changed since backward launched them ([Note: one matrix from
        hook to forward wait], step 3), queues every wave's update with the ``lr`` and ``weight_decay`` of now,
        runs the AdamW part, and returns with the Muon updates ordered before anything after it ([Note: the step
        barrier]: CPU, the host waits; CUDA, the current stream waits, no host sync). With ``async_step=True`` it
        returns once every wave has read its gradients, before the updates land: the next forward waits per
        module, :meth:`synchronize` and :meth:`wait_for` wait on demand.

        Returns:
            the closure's loss, if a closure is given.

        Raises:
            RuntimeError: a lane task of an earlier wave failed (its traceback is chained).
            ValueError: the ranks disagree on which Muon params have a gradient (on every rank; nothing of the step
                is applied).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._phase = StepPhase.STEP
        try:
            ok = self._prepare_step()
            self._launch_rest(ok)
            self._commit(ok)
            self._finish_step()
        finally:
            self._phase = StepPhase.IDLE
        return loss

    def _prepare_step(self) -> bool:
        """Surface earlier lane errors; the non-finite check and the clip. Returns whether the step applies."""
        self._pipeline.reap()
        ok = self._pipeline.all_finite() if self.config.skip_nonfinite else True
        if self.max_grad_norm is not None and ok:
            # model.parameters() order: the norm of the stacked norms depends on it, as in clip_grad_norm_
            grads = [p.grad for p in self._model_params if p.grad is not None]
            self.last_grad_norm, clipped = clip_grads_by_total_norm_(grads, self.max_grad_norm)
            self.stats["clipped_steps"] += clipped
        self.stats["skipped_steps"] += not ok
        return ok

    def _launch_rest(self, ok: bool) -> None:
        """Launch the waves backward did not. A synchronous step agrees on gradient presence once, first, and its
        waves then commit their momentum as they pack (:attr:`StepPhase.SYNC_STEP`)."""
        if ok and not self.config.overlap and not self._pipeline.has_pending():
            self._pipeline.agree_before_launch()
            self._phase = StepPhase.SYNC_STEP
        try:
            self._dispatcher.flush()
        finally:
            self._phase = StepPhase.STEP

    def _commit(self, ok: bool) -> None:
        """Validate the waves (stale ones re-run), queue their applies with the hyper-parameters of now, AdamW."""
        reruns = self._pipeline.commit(self._waves, self.param_groups[0], validate=self.config.overlap, skip=not ok)
        if reruns and not self._warned_reruns:
            self._warned_reruns = True
            warnings.warn(
                f"OverlapMuon: {reruns} of {len(self._waves)} waves were re-run in step() because their inputs "
                "changed after backward launched them (gradients edited in place, e.g. clipping, unscaling or a "
                "collective, DDP averaging without attach_ddp, a changed momentum/NS setting, or optimizer state "
                "loaded between backward and step). The result is exact; the overlap of those waves is lost.",
                stacklevel=4,
            )
        if self._adamw is not None and ok:
            self._adamw.step()
            init_adamw_state(self.param_groups[1:], self.state, self._pipeline.adamw_elsewhere())

    def _finish_step(self) -> None:
        """Re-plan once from the observed order, then order the updates before what follows: the step barrier, or
        (``async_step``) the forward waits' policy and a wait for the gradient reads."""
        if self._recorder is not None and self._recorder.recorded:
            self._adopt_observed_order()
        self._dispatcher.reset()
        self._step_count += 1
        self.stats["steps"] += 1
        if self._waits is None:
            self._barrier()
            return
        self._waits.after_step([w.index for w in self._waves])
        self._pipeline.wait_gradients_read()  # the applies read no gradient: the user may zero them now

    def _barrier(self) -> None:
        """[Note: the step barrier] The default: ``step()`` orders its updates before anything after it, so every
        later reader (the next forward, ``model.unshard()``, a step post-hook, ``load_state_dict``, an averager
        wrapping the optimizer, user code) sees the updated weights. CPU: the host waits for every apply. CUDA: no
        host sync: the current stream waits on the apply events, and each FSDP2 root gets an event recorded after
        that wait through ``FSDPModule.set_post_optim_event`` (FSDP2's public hook: its next all-gathers wait on
        it instead of on the whole current stream). The backward overlap is kept: the waves were launched and
        validated speculatively; what is given up is the overlap with the next forward (``async_step``)."""
        self._pipeline.wait([w.index for w in self._waves])
        if self._pipeline.lanes.cuda and self._fsdp_roots:
            event = self._pipeline.lanes.current_stream_event()
            for root in self._fsdp_roots:
                root.set_post_optim_event(event)

    def synchronize(self) -> None:
        """Block until every committed wave has been applied (host waits; on CUDA the device too).

        Raises:
            RuntimeError: a lane task failed; its original exception (and traceback) is chained.
        """
        self._pipeline.synchronize()

    def wait_for(self, params: Iterable[Tensor]) -> None:
        """Wait until the committed updates of ``params`` have landed, for readers outside a module's forward
        (EMA, logging, evaluation on the side). CPU: the host waits; CUDA: the current stream waits.
        Non-Muon params are ignored (AdamW updates in ``step()`` itself)."""
        self._pipeline.wait(self._index.waves_of(self._index.of_tensors(params)))

    def register_wait(self, module: nn.Module, params: Iterable[Tensor]) -> None:
        """``async_step``: make ``module``'s forward wait for ``params``' updates (a precise wait point for weights
        read outside the forward of the module that owns them, e.g. a fused QKV built in the parent's forward).
        The default step needs none (its updates have landed when it returns): then this does nothing."""
        if self._waits is not None:
            self._waits.register_wait(module, params)

    def _adopt_observed_order(self) -> None:
        """After the first step: broadcast rank 0's observed readiness order and re-plan the waves with it."""
        assert self._recorder is not None
        self.synchronize()
        order = [self._recorder.order()]
        if self._pipeline.ctrl_group is not None:
            dist.broadcast_object_list(order, src=0, group=self._pipeline.ctrl_group)
        self._recorder = None
        self._plan(list(order[0]))

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside launch nothing; the first backward after it launches
        the waves on the accumulated gradients, so NS runs once per matrix per optimizer step."""
        prev = self._phase
        self._phase = StepPhase.ACCUMULATING
        if self._tracker is not None:
            self._tracker.enabled = False
        try:
            yield
        finally:
            self._phase = prev
            if self._tracker is not None:
                self._tracker.enabled = prev is not StepPhase.ACCUMULATING

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``Optimizer.zero_grad``; also drops the waves backward launched since the last ``step()``.

        No committed update reads a gradient after ``step()`` has returned (the default step waits for its
        applies; ``async_step`` keeps each wave's new momentum), so zeroing in place needs no wait."""
        self._pipeline.discard()
        self._dispatcher.reset()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Waits for in-flight waves, then ``Optimizer.state_dict()`` plus an ``"overlap_muon"`` entry (the Muon
        param names, full shapes and partition dims that :meth:`load_state_dict` checks). Muon momentum stays
        sharded as the params are; a param has state from its first gradient on ([Note: lazy state] in
        ``overlap_muon/state.py``)."""
        self.synchronize()
        sd = super().state_dict()
        sd["overlap_muon"] = checkpoint_meta(self._muon, self.param_groups[1:])
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Waits for in-flight waves, checks the checkpoint fits, then loads (the inner AdamW keeps sharing the
        loaded state and groups).

        An AdamW ``step`` saved as a plain number (older checkpoints) is converted to a tensor, as
        ``torch.optim.AdamW.load_state_dict`` does.

        Raises:
            ValueError: the checkpoint's Muon param names, full shapes, partition dims or group sizes differ from
                this optimizer's, or a state tensor's shape differs from its param's. Nothing is changed then.
        """
        self.synchronize()
        self._pipeline.discard()
        errors = checkpoint_errors(state_dict, self._muon, self.param_groups, self._param_names)
        if errors:
            raise ValueError("OverlapMuon.load_state_dict: checkpoint does not fit; nothing loaded: " + "; ".join(errors))
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "overlap_muon"})
        self._link_adamw()
        if self._adamw is not None:
            # What AdamW.load_state_dict does after loading (it calls its __setstate__): a plain-number ``step``
            # of an older checkpoint becomes the singleton tensor its step() requires, group flags get defaults.
            self._adamw.__setstate__({"state": self.state, "param_groups": self.param_groups[1:]})

    def attach_ddp(self, ddp_model: nn.Module) -> None:
        """Take gradient readiness from a DDP comm hook instead of the per-param hooks.

        Under DDP a per-param hook sees the local, un-averaged gradient; the comm hook signals a bucket's params
        once its all-reduce has completed, so waves read DDP's averaged gradients. Requires
        ``DistributedDataParallel(..., gradient_as_bucket_view=True)`` (see ``hooks.ddp_readiness_hook``).
        Without it the per-param hooks still give exact results (``step()`` sees DDP's in-place averaging and
        re-runs those waves) but nothing overlaps. Called by the constructor when given a DDP model.

        Raises:
            TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        """
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(ddp_model, DistributedDataParallel):
            raise TypeError(f"attach_ddp expects a DistributedDataParallel, got {type(ddp_model).__name__}")
        if not self.config.overlap or not self._muon:
            return
        if self._tracker is not None:
            self._tracker.remove()
            self._tracker = None
        on_ready = weak_callback(self._on_ready)
        state, hook = ddp_readiness_hook(lambda idx: [on_ready(i) for i in idx],
                                         dict(self._index.first),
                                         process_group=ddp_model.process_group)
        ddp_model.register_comm_hook(state, hook)

    def close(self) -> None:
        """Wait for everything, remove the hooks and stop the lane threads. Idempotent."""
        if self._finalizer.alive:
            self.synchronize()
            self._finalizer()

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            "OverlapMuon cannot be deep-copied: it is bound to its model's hooks, process groups and lane threads. "
            "Copy its state instead: opt.state_dict() / load_state_dict() on a new OverlapMuon"
        )

    @property
    def waves(self) -> list[Wave]:
        """The current wave plan (param indices into :attr:`muon_param_names`)."""
        return list(self._waves)

    @property
    def wave_plans(self) -> list[Any]:
        """The frozen plan of every wave (``overlap_muon.scheduler.kinds.WavePlan``: params, homes, exchange kind)."""
        return list(self._plans)

    @property
    def muon_param_names(self) -> list[str]:
        """Names of the Muon params, in registration order (the indices waves use)."""
        return [m.name for m in self._muon]
