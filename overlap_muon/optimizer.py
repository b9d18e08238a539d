"""``OverlapMuon``: layer-sharded Muon whose optimizer work hides inside backward.

The torch.optim surface: ``step``, ``zero_grad``, ``no_sync``, ``state_dict`` / ``load_state_dict``,
``attach_ddp``, ``wait_for``, ``register_wait``, ``synchronize``, ``close``. Construction reads top to bottom in
``_builder.py`` (sort, place, check on every rank, groups, plan); the machinery (plan, hooks, launch, commit, the
step barrier) is the :class:`~overlap_muon._runtime.Runtime`; a wave's trip is ``_pipeline.py``. Only ``step()``
changes params and optimizer state.

[Note: exactness] Momentum, Nesterov, the bf16 cast, weight decay and the update are elementwise
(``overlap_muon._muon_math``), so each rank runs them on its own shard; only NS needs the whole matrix, which the
home assembles bit for bit, and the learning-rate ratio uses the full logical shape. The result equals
``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

import contextlib
import logging
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from . import _builder as builder
from .config import resolve_config
from ._messages import rerun_warnings, warn_user
from ._ns import DEFAULT_NS_COEFFICIENTS
from .qk_clip import QKClip
from ._binding import ParamBinding
from ._runtime import StepPhase
from .split import SplitArg
from ._state import checkpoint_errors, checkpoint_meta, init_adamw_state

__all__ = ["OverlapMuon", "StepPhase"]

logger = logging.getLogger("overlap_muon")



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
        max_grad_norm: when set, ``step()`` clips every gradient by the global norm exactly as ``clip_grad_norm_``
            would, keeping the overlap where clipping does not bite ([Note: clipping and speculative waves] in
            ``_clip.py``); ``last_grad_norm`` holds the norm. Needs DTensor params or one process.
        split: fused weights orthogonalized as their parts (split QKV, fused gate/up, per-head blocks): a mapping
            from param names (``fnmatch`` patterns) to a :class:`~overlap_muon.split.RowSplit`, or a callable
            ``(name, param) -> RowSplit | None``; equal to ``torch.optim.Muon`` on each part as its own param.
        adamw_groups: several AdamW groups, ``[{"params": selector, **overrides}, ...]`` (a ``(name, param) ->
            bool`` callable or names; a param goes to the first group that selects it, the rest to a last group with
            ``adamw_kwargs``: ``_sorting.adamw_param_groups``). They follow the Muon group in ``param_groups``.
        muon_filter: ``(name, param) -> bool`` picking Muon params; default ([Note: the default split] in
            ``overlap_muon/_sorting.py``): 2-D weights of ``nn.Linear`` and HF ``Conv1D`` modules, except embeddings
            (and weights tied to them) and the output head. A ``Conv1D`` weight (stored ``(in, out)``) is
            orthogonalized and lr-scaled as its ``(out, in)`` transpose, whichever the filter.
        device_mesh: the ``DeviceMesh`` over which the Muon params are DTensors: ``remat_dim`` and ``tp_dim`` name
            its domain dims (defaults ``"remat"``, ``"tp"``; ``None`` for a dim the domain lacks); any other dim
            (e.g. ``"dp_replicate"``) is a replicate dim whose indices each hold a domain of their own. A 1-D mesh
            is TP only when its dim is named ``tp_dim``, else remat only.
        remat_dim, tp_dim: see ``device_mesh`` (torchtitan: ``remat_dim="dp_shard"`` or ``"fsdp"``).
        tp_group, remat_group: explicit groups for plain-tensor params (each carrying ``partition_dim``; a plain
            param without one holds the whole matrix and is replicated: [Note: replicated params] in ``_placement.py``).
        experts: the expert params (MoE), routed on their own domain ([Note: two domains] in ``_discovery.py``): a
            pattern of names, a list of them, or a ``(name, param) -> bool`` callable; a 2-D linear of one expert, or
            a 3-D ``(E, P, Q)`` grouped weight (``E`` matrices, each as ``torch.optim.Muon`` on its own param).
        expert_mesh, ep_dim, etp_dim, etp_group: the expert params' ``DeviceMesh`` and its EP and expert-TP dims
            (3-D params ``Shard(0)`` on ``ep_dim``), or this rank's ETP group for plain shards; without either,
            every rank's experts are its own (docs/usage.md, "Experts").
        pp_dim, pp_group: pipeline parallelism, each rank building its optimizer on its own stage: the mesh dim
            whose indices hold different stages (outside every domain; the params live on the sub-mesh without
            it), or this rank's PP group for explicit groups. The construction checks then compare the ranks of a
            stage, and ``step()`` agrees within it ([Note: pipeline stages] in ``_discovery.py``). See
            :meth:`attach_pipeline_stage`.
        qk_clip: a :class:`~overlap_muon.qk_clip.QKClip`: after each step's updates, the query and key rows of
            the heads whose max attention logit (recorded by the model, ``qk_clip.record_max_logits``) exceeded
            ``tau`` are scaled down ([Note: QK-clip] in ``qk_clip.py``); ``stats["qk_clipped_heads"]`` counts them.
        mode, fused_a2a, batch_ns, balance, overlap, wave_plan, wave_slots, side_streams, nvtx, pg_timeout_s,
            warm_up, node_size, node_exchange, readiness_order, skip_nonfinite, syrk, gram_ns,
            check_grad_presence: options (``overlap_muon.config``); ``None`` takes the environment variable or the
            default.

    Attributes:
        domain, expert_domain: this rank's :class:`~overlap_muon._domain.Domain` (``R x T``, coordinates ``g, t``)
            and its expert domain (``1 x ETP``; ``1 x 1`` without one); ``domain.nodes``: the two-hop groups where
            the exchanges run node-aware (``node_exchange``), else ``None``.
        stats: counters: ``ns_matrices`` (NS'd on this rank), ``ns_calls``, ``waves_launched``, ``reruns`` (inputs
            changed), ``held_backwards`` (launched nothing), ``steps``, ``skipped_steps``, ``clipped_steps`` (on
            CUDA counted once the flag has reached the host, a step or more later: no sync), ``warm_up_collectives``
            (run at construction, ``warm_up``), ``strategy.*`` (``mode="auto"``'s picks).

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
        self, model: nn.Module, *, lr: float | Tensor = 1e-3, weight_decay: float = 0.1, momentum: float = 0.95,
        nesterov: bool = True, ns_coefficients: Any = DEFAULT_NS_COEFFICIENTS, ns_steps: int = 5, eps: float = 1e-7,
        adjust_lr_fn: str | None = None, max_grad_norm: float | None = None, split: SplitArg = None,
        adamw_kwargs: dict[str, Any] | None = None, muon_filter: Callable[[str, Tensor], bool] | None = None,
        device_mesh: Any = None, remat_dim: str | None = "remat", tp_dim: str | None = "tp",
        adamw_groups: list[dict[str, Any]] | None = None, tp_group: dist.ProcessGroup | None = None,
        remat_group: dist.ProcessGroup | None = None, experts: Any = None, expert_mesh: Any = None,
        ep_dim: str = "ep", etp_dim: str = "etp", etp_group: dist.ProcessGroup | None = None,
        pp_dim: str | None = "pp", pp_group: dist.ProcessGroup | None = None, qk_clip: QKClip | None = None,
        **options: Any,
    ) -> None:
        model, ddp = builder.unwrap(model)
        hp = dict(lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, eps=eps,
                  ns_coefficients=ns_coefficients, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn)
        builder.check_arguments(hp, max_grad_norm, muon_filter)
        self.max_grad_norm, self.config = max_grad_norm, resolve_config(**options)
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        mesh = dict(device_mesh=device_mesh, remat_dim=remat_dim, tp_dim=tp_dim, tp_group=tp_group,
                    remat_group=remat_group, expert_mesh=expert_mesh, ep_dim=ep_dim, etp_dim=etp_dim,
                    etp_group=etp_group, pp_dim=pp_dim, pp_group=pp_group)
        # What placement needs again when the params are replaced ([Note: following the param groups]).
        recipe = dict(muon_filter=muon_filter, experts=experts, split=split, max_grad_norm=max_grad_norm,
                      adamw_groups=adamw_groups, mesh=mesh)
        self._binding = ParamBinding(self, model, self.config, self._rank, recipe, qk_clip)
        placed = self._binding.place()
        if not placed.muon and self._rank == 0:
            warn_user("OverlapMuon: no param went to Muon (it takes the 2-D weights of nn.Linear and Hugging Face "
                      "Conv1D modules, except embeddings and the output head), so this is plain AdamW; pass "
                      "muon_filter=lambda name, p: ... to choose the Muon params")
        self._adamw, groups = builder.param_groups(placed.muon, placed.adamw_groups, adamw_kwargs, hp, model)
        super().__init__(groups, hp)
        self.stats: dict[str, int] = defaultdict(int)
        self._binding.bind(placed)
        self._link_adamw()  # State is created at a param's first gradient, as torch does ([Note: lazy state]).
        self._warned_reruns, self._built = ({}, set()), True
        if ddp is not None:
            self.attach_ddp(ddp)
        if self._rank == 0:
            logger.info("%s", self.config.describe())

    _rt = property(lambda self: self._binding.runtime)
    _muon = property(lambda self: self._binding.muon)
    _pipeline = property(lambda self: self._binding.runtime.pipeline)  # the tests' seams
    qk_clipper = property(lambda self: self._binding.qk, doc="The running QK-clip (``None`` without ``qk_clip=``).")
    domain = property(lambda self: self._binding.domain, doc="This rank's dense :class:`Domain` (``R x T``).")
    expert_domain = property(lambda self: self._binding.expert_domain,
                             doc="This rank's expert :class:`Domain` (``1 x ETP``; ``1 x 1`` without one).")

    def _follow_params(self) -> None:
        """[Note: following the param groups] in ``_binding.py``: re-bind when the params were replaced."""
        if self._binding.follow():
            self._link_adamw()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: params, domain layout, homes, waves and hooks are planned once.

        Raises:
            ValueError: called after construction (build a new ``OverlapMuon`` for a changed model).
        """
        if getattr(self, "_built", False):
            raise ValueError("OverlapMuon plans its params, homes, waves and hooks at construction; add_param_group "
                             "is not supported afterwards: build a new OverlapMuon for the changed model")
        super().add_param_group(param_group)

    def _link_adamw(self) -> None:
        """Share state and param groups with the inner AdamW and the pipeline (``load_state_dict`` replaces them)."""
        if self._binding.alive:
            self._rt.set_state(self._state)
        if self._adamw is not None:
            self._adamw.state = self._state
            self._adamw.param_groups = self.param_groups[1:]

    @property
    def state(self) -> Any:
        """The optimizer state, ``torch.optim.Optimizer.state``: ``state[param]`` holds ``"momentum_buffer"`` (Muon,
        sharded as its param) or AdamW's ``"step"``, ``"exp_avg"``, ``"exp_avg_sq"``. It may be edited, cleared or
        replaced (``opt.state = defaultdict(dict)``) between steps or between backward and ``step()``, as with
        torch's optimizers: the next step uses what it holds then ([Note: a wave's reads] in ``_wave_state.py``). With
        ``async_step``, reading or setting it first waits for the last step's updates (CPU: the host waits; CUDA:
        the current stream), so that an edit lands after them, as it would after torch's ``step()``."""
        self._await_updates()
        return self.__dict__["_state"]

    @state.setter
    def state(self, value: Any) -> None:
        self._await_updates()
        self.__dict__["_state"] = value
        if self.__dict__.get("_built"):  # (torch's __init__ sets it first)
            self._link_adamw()

    _state = property(lambda self: self.__dict__["_state"])  # the mapping, without the wait (the library's reads)

    def _await_updates(self) -> None:
        if self.__dict__.get("_built") and self._rt.async_step:
            self._rt.await_updates()

    def __setstate__(self, state: dict[str, Any]) -> None:
        """``Optimizer.__setstate__`` (``load_state_dict`` calls it), with the state mapping set through
        :attr:`state`, which the runtime and the inner AdamW share."""
        rest = {k: v for k, v in state.items() if k != "state"}
        super().__setstate__(rest)
        if "state" in state:
            self.state = state["state"]

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

        Params replaced since the last step (``fully_shard`` after construction, Accelerate's FSDP2 preparation,
        ``model.to(device)``) are followed first: [Note: following the param groups].

        Returns:
            the closure's loss, if a closure is given.

        Raises:
            RuntimeError: a lane task of an earlier wave failed (its traceback is chained).
            ValueError: the param groups hold a param that is not the model's, or a replaced param's state does not
                fit its successor (on every rank; nothing of the step is applied).
            ValueError: the ranks disagree on which Muon params have a gradient (on every rank; nothing of the step
                is applied).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._binding.stop_watch()
        self._follow_params()
        try:
            clip_params = list(self._binding.model.parameters()) if self.max_grad_norm is not None else []
            ok, norm, reruns = self._rt.commit_step(self.max_grad_norm, clip_params)
            self.last_grad_norm = norm if norm is not None else getattr(self, "last_grad_norm", None)
            if reruns or self.stats["reruns.extra_backward"]:
                rerun_warnings(self.stats, *self._warned_reruns, len(self._rt.waves))
            if self._adamw is not None and ok:
                self._adamw.param_groups = self.param_groups[1:]  # the dicts param_groups holds now (replaceable)
                self._adamw.step()
                init_adamw_state(self.param_groups[1:], self._state, self._rt.agreement.adamw_elsewhere())
            self._rt.finish()
            qk = self._binding.qk
            if qk is not None and ok:  # [Note: QK-clip]: on the landed updates
                self._rt.wait_for(qk.params())
                self.stats["qk_clipped_heads"] += qk.apply()
            self.stats["steps"] += 1
        finally:
            self._rt.end_step()
        return loss

    def synchronize(self) -> None:
        """Block until every committed wave has been applied (host waits; on CUDA the device too).

        Raises:
            RuntimeError: a lane task failed; its original exception (and traceback) is chained.
        """
        self._rt.synchronize()

    def wait_for(self, params: Iterable[Tensor]) -> None:
        """Wait until the committed updates of ``params`` have landed, for readers outside a module's forward
        (EMA, logging, evaluation on the side). CPU: the host waits; CUDA: the current stream waits.
        Non-Muon params are ignored (AdamW updates in ``step()`` itself)."""
        self._rt.wait_for(params)

    def register_wait(self, module: nn.Module, params: Iterable[Tensor]) -> None:
        """``async_step``: make ``module``'s forward wait for ``params``' updates (a precise wait point for weights
        read outside the forward of the module that owns them, e.g. a fused QKV built in the parent's forward).
        The default step needs none (its updates have landed when it returns): then this does nothing."""
        self._rt.register_wait(module, params)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation: backward passes inside launch nothing; the first backward after it launches
        the waves on the accumulated gradients, so NS runs once per matrix per optimizer step."""
        prev = self._rt.set_phase(StepPhase.ACCUMULATING)
        try:
            yield
        finally:
            self._rt.set_phase(prev)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Like ``Optimizer.zero_grad``; also drops the waves backward launched since the last ``step()``.

        No committed update reads a gradient after ``step()`` has returned (the default step waits for its
        applies; ``async_step`` keeps each wave's new momentum), so zeroing in place needs no wait."""
        self._rt.discard()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Waits for in-flight waves, then ``Optimizer.state_dict()`` plus an ``"overlap_muon"`` entry (the Muon
        param names, full shapes and partition dims that :meth:`load_state_dict` checks). Muon momentum stays
        sharded as the params are; a param has state from its first gradient on ([Note: lazy state] in
        ``overlap_muon/_state.py``)."""
        self._follow_params()
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
        self._follow_params()
        self.synchronize()
        self._rt.discard()
        errors = checkpoint_errors(state_dict, self._muon, self.param_groups, self._binding.names)
        if errors:
            raise ValueError("OverlapMuon.load_state_dict: checkpoint does not fit; nothing loaded: "
                             + "; ".join(errors))
        super().load_state_dict({k: v for k, v in state_dict.items() if k != "overlap_muon"})
        self._link_adamw()
        if self._adamw is not None:
            # What AdamW.load_state_dict does after loading (it calls its __setstate__): a plain-number ``step``
            # of an older checkpoint becomes the singleton tensor its step() requires, group flags get defaults.
            self._adamw.__setstate__({"state": self._state, "param_groups": self.param_groups[1:]})

    def attach_ddp(self, ddp_model: nn.Module) -> None:
        """Take gradient readiness from a DDP comm hook instead of the per-param hooks.

        Under DDP a per-param hook sees the local, un-averaged gradient; the comm hook signals a bucket's params
        once its all-reduce has completed, so waves read DDP's averaged gradients (with or without
        ``gradient_as_bucket_view``: [Note: DDP readiness] in ``hooks/ddp_readiness.py``). Called by the
        constructor when given a DDP model, and when a DDP wrapped around the model later runs its first forward.
        A comm hook the user registers afterwards (``fp16_compress_hook``, PowerSGD) is chained
        (``hooks.attach_ddp_readiness``); one registered before leaves DDP no room for ours: the waves then launch
        in ``step()`` and a warning says so.

        Raises:
            TypeError: ``ddp_model`` is not a ``DistributedDataParallel``.
        """
        self._binding.attach_ddp(ddp_model)

    def attach_pipeline_stage(self, stage: Any) -> None:
        """Launch the waves of ``stage``'s params once per schedule step, when its gradients are final (after the
        last micro-batch's backward, the reduction and the schedule's ``scale_grads``), instead of from per-param
        hooks that would launch them for every micro-batch: NS runs once per matrix per step and the scaling
        re-runs nothing ([Note: pipeline readiness] in ``hooks/pipeline_stage.py``). Call it once per stage of
        this rank that holds params of this optimizer (``torch.distributed.pipelining`` schedules: GPipe, 1F1B,
        Interleaved1F1B, ...).

        Raises:
            TypeError: ``stage`` is not a pipelining stage (no ``submod``).
        """
        self._binding.attach_pipeline_stage(stage)

    def close(self) -> None:
        """Wait for everything, remove the hooks and stop the lane threads. Idempotent."""
        if self._binding.alive:
            self.synchronize()
            self._binding.finalizer()

    def __deepcopy__(self, memo: dict) -> Any:
        raise TypeError(
            "OverlapMuon cannot be deep-copied: it is bound to its model's hooks, process groups and lane threads. "
            "Copy its state instead: opt.state_dict() / load_state_dict() on a new OverlapMuon"
        )

    waves = property(lambda self: list(self._rt.waves),
                     doc="The current wave plan (``Wave``: param indices into :attr:`muon_param_names`).")
    wave_plans = property(lambda self: list(self._rt.wave_plans), doc="The frozen plan of every wave (``overlap_muon."
                          "scheduler.kinds.WavePlan``: params, homes, exchange kind).")
    muon_param_names = property(lambda self: [m.name for m in self._muon],
                                doc="Names of the Muon params, in registration order (the indices waves use).")
