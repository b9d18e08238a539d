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
import logging
import warnings
import weakref
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .hooks import (
    GradReadyTracker, ParamOwners, ddp_readiness_hook, fsdp_param_streams, params_read_by_module,
    compile_boundary, register_forward_waits, weak_callback,
)
from .scheduler import ReadinessRecorder, WaveDispatcher, ns_flops, plan_by_domain, plan_waves, plan_waves_by_cost
from .scheduler.kinds import plan_kinds
from .scheduler.surplus import CPU_GLOO
from .scheduler.waves import Wave

from . import version_fix
from .checks import check_plan_everywhere, differs_across_ranks, option_errors, raise_everywhere
from .clip import clip_grads_by_total_norm_
from .config import OverlapMuonConfig, resolve_config
from .comm import build_comm
from .domain import Domain, discover_expert_layouts, discover_layouts, local_tensor, mesh_dims, my_coords
from .muon_math import check_hyperparameters
from .ns import DEFAULT_NS_COEFFICIENTS
from .pipeline import Hyper, WavePipeline
from .placement import place_params
from .sorting import adamw_param_groups, conv1d_weights, name_matches, sort_params, split_table
from .split import SplitArg
from .state import checkpoint_errors, checkpoint_meta, init_adamw_state

__all__ = ["OverlapMuon"]

logger = logging.getLogger("overlap_muon")

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

try:
    from torch.distributed.fsdp import FSDPModule
except Exception:  # pragma: no cover
    FSDPModule = ()  # type: ignore[assignment]

# One live OverlapMuon drives a param at a time (its hooks would apply every update twice otherwise).
_OWNERS = ParamOwners(lambda opt: getattr(opt, "_finalizer", None) is not None and opt._finalizer.alive)


def _remove_all(handles: list, pipeline: WavePipeline, fixed: bool) -> None:
    """Finalizer of an OverlapMuon (``close()`` or garbage collection): unhook, stop the lane threads, and give
    back the version fix (the last overlap optimizer removes it)."""
    for h in handles:
        h.remove()
    pipeline.close()
    if fixed:
        version_fix.release()


def _layout_errors(muon_named: list[tuple[str, Tensor]], expert_ids: set[int], expert_layout: bool) -> list[str]:
    """Collective: an expert layout given with no expert param selected, or expert counts that differ by rank
    (which would otherwise surface as a plan mismatch naming an unrelated param)."""
    errors = ["expert_mesh/etp_group given but experts= selects no Muon param"] if expert_layout and not expert_ids else []
    held = [(n, int(p.shape[0]) if p.ndim == 3 else 1) for n, p in muon_named if id(p) in expert_ids]
    per_rank = differs_across_ranks(held)  # on every rank, whatever it holds
    if per_rank is not None:
        errors.append(f"the ranks hold different expert params (name, experts held) -- "
                      f"{'; '.join(f'rank {r}: {h}' for r, h in enumerate(per_rank))[:600]}; every EP rank must hold "
                      "the same expert params with the same number of experts")
    return errors


def _fsdp_roots(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` with no FSDP2 ancestor (one of them becomes the root at the first forward;
    ``set_post_optim_event`` is read from the root's state)."""
    out: list[nn.Module] = []

    def walk(mod: nn.Module) -> None:
        if isinstance(mod, FSDPModule):
            out.append(mod)
            return
        for child in mod.children():
            walk(child)

    walk(model)
    return out


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
        from torch.nn.parallel import DistributedDataParallel

        if not isinstance(model, nn.Module):
            raise TypeError(f"OverlapMuon expects an nn.Module, got {type(model).__name__}")
        ddp = model if isinstance(model, DistributedDataParallel) else None
        model = ddp.module if ddp is not None else model
        model = getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model
        check_hyperparameters(lr, weight_decay, momentum, eps, adjust_lr_fn, ns_coefficients, ns_steps)
        if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
            raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
        self.max_grad_norm = max_grad_norm
        if muon_filter is not None and not callable(muon_filter):
            raise TypeError("muon_filter must be callable (name, param) -> bool")
        self.config: OverlapMuonConfig = resolve_config(**options)
        self._rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        _OWNERS.claim(model.parameters(), self, "OverlapMuon: another live OverlapMuon already drives this model's "
                      "params; call its close() before building a new one on the same model")

        # ---- sort params ([Note: the default split] in sorting.py); place the Muon matrices in the domain -------
        # Errors are raised on every rank: the mesh/domain's first (it makes every per-param check meaningless),
        # then the params'.
        multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        muon_named, adamw_named, expert_ids, errors = sort_params(model, muon_filter, experts)
        conv1d = conv1d_weights(model)
        layouts, mesh_err = discover_layouts(device_mesh, tp_group, remat_group, remat_dim, tp_dim)
        elayouts, emesh_err = discover_expert_layouts(expert_mesh, etp_group, ep_dim, etp_dim)
        raise_everywhere([e for e in (mesh_err, emesh_err) if e])
        R, T, g, t = my_coords(layouts, self._rank)
        _, ET, _, et = my_coords(elayouts, self._rank)
        dims = mesh_dims(device_mesh, remat_dim, tp_dim)[0] if device_mesh is not None else None
        self._muon, described = place_params(muon_named, expert_ids, conv1d, split, (device_mesh, dims, R, T, g, t),
                                             (expert_mesh, ep_dim, etp_dim, ET, et))
        errors += described
        expert_layout = expert_mesh is not None or etp_group is not None
        left = [n for n, p in adamw_named if p.ndim == 3]
        if experts is not None and left and self._rank == 0:
            warnings.warn(f"OverlapMuon: experts= is given but the 3-D params {left[:8]} are not selected; they go to "
                          "AdamW. Widen the pattern if they are grouped expert weights.", stacklevel=2)
        errors += _layout_errors(muon_named, expert_ids, expert_layout) + option_errors(self.config)
        if multi and any(getattr(p, "partition_dim", None) is not None and not isinstance(p, DTensor)
                         and not (expert_layout if id(p) in expert_ids else layouts) for _, p in muon_named):
            if self._rank == 0:
                warnings.warn(
                    "OverlapMuon: some plain Muon params carry a partition_dim but their domain has no TP/ETP group "
                    "(no tp_group/device_mesh, or no etp_group/expert_mesh for experts): each rank orthogonalizes its "
                    "tensor as a whole matrix. If they are shards of larger matrices, pass the group.", stacklevel=2)
        if isinstance(split, dict):
            unused = [k for k in split if not any(name_matches(m.name, k) for m in self._muon)]
            errors += [f"split patterns {unused} match no Muon param (Muon params: {[m.name for m in self._muon][:8]}"
                       f"{' ...' if len(self._muon) > 8 else ''})"] if unused else []
        if max_grad_norm is not None and (R * T > 1 or multi and expert_ids) and any(
                not isinstance(m.param, DTensor) for m in self._muon):
            errors.append("max_grad_norm needs DTensor params on a multi-rank domain (a plain shard's norm cannot "
                          "be reduced without knowing which peers hold copies); clip the gradients yourself")
        all_named = dict(model.named_parameters(remove_duplicate=False))
        try:
            adamw_groups_ = adamw_param_groups(adamw_named, adamw_groups, {n for n, _ in muon_named}, all_named)
        except ValueError as e:
            errors.append(str(e))
            adamw_groups_ = []
        raise_everywhere(errors)
        if self._rank == 0:
            self._log_split(adamw_groups_, all_named)

        # ---- runtime groups (collective over the default group): overlap_muon.comm ----------------------------
        distributed = layouts is not None and dist.get_world_size() > 1
        dp_on = distributed and len(layouts) > 1 and self.config.dp_slots and self.config.mode == "layer_sharded"
        if dp_on and self.config.surplus != "idle":
            warnings.warn(f"OverlapMuon: surplus={self.config.surplus!r} is not combined with DP slots yet; the waves "
                          "run as surplus='idle' (the replicas still share the NS work)", stacklevel=2)
        comm = build_comm(layouts, elayouts, self._rank, timeout_s=self.config.pg_timeout_s, dp_slots=dp_on,
                          team=not dp_on and self.config.surplus in ("team", "auto"), experts=bool(expert_ids))
        self.domain = comm.dom_to
        """This rank's :class:`~overlap_muon.domain.Domain` (sizes R x T, coordinates g, t)."""
        self.expert_domain = comm.expert[0] if comm.expert else Domain.single()
        """This rank's expert domain (``1 x ETP``; ``1 x 1`` without ETP or without expert params)."""

        # ---- optimizer plumbing: one Muon group, then the inner AdamW's groups --------------------------------
        self._adamw = torch.optim.AdamW(adamw_groups_, **(adamw_kwargs or {})) if adamw_groups_ else None
        muon_group = dict(params=list({id(m.param): m.param for m in self._muon}.values()), algorithm="muon", lr=lr, weight_decay=weight_decay,
                          momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients, ns_steps=ns_steps,
                          eps=eps, adjust_lr_fn=adjust_lr_fn)
        groups: list[dict[str, Any]] = [muon_group]
        for grp in self._adamw.param_groups if self._adamw is not None else ():
            grp["algorithm"] = "adamw"
            groups.append(grp)
        super().__init__(groups, {k: v for k, v in muon_group.items() if k not in ("params", "algorithm")})
        self._link_adamw()
        # State is created at a param's first gradient, as torch does ([Note: lazy state] in state.py).
        self._param_names = {id(p): n for n, p in model.named_parameters()}
        self._model_params = list(model.parameters())
        self.stats: dict[str, int] = defaultdict(int)
        """Counters: ``ns_matrices`` (matrices NS'd on this rank), ``ns_calls`` (zeropower calls),
        ``waves_launched``, ``reruns`` (waves re-run at ``step()`` because their inputs changed), ``steps``,
        ``skipped_steps``."""
        device = local_tensor(self._muon[0].param).device if self._muon else torch.device("cpu")
        self._pipeline = WavePipeline(self._muon, self.state, comm.dom_to, comm.dom_from, self.config, device,
                                      self.stats, comm.ctrl, expert_doms=comm.expert, dp_slots=comm.dp,
                                      team_group=comm.team)
        self._async = self.config.overlap and self.config.async_step
        self._pipeline.keep_momentum = self._async  # the apply runs after step() returns: it must not read .grad
        self._pipeline.adamw_params = [p for g in self.param_groups[1:] for p in g["params"]]
        # A grouped expert weight is several Muon matrices: hooks and waits see the param once, under its first
        # index (``_first``), and stand for all of its matrices (``_siblings``).
        self._first: dict[int, int] = {}
        self._siblings: dict[int, list[int]] = defaultdict(list)
        for m in self._muon:
            self._siblings[self._first.setdefault(id(m.param), m.index)].append(m.index)

        # ---- plan and hooks ----------------------------------------------------------------------------------
        self._costs = [float(sum(ns_flops((len(r), m.ns_shape[1]), ns_steps) for r in m.parts) if m.parts
                             else ns_flops(m.ns_shape, ns_steps)) for m in self._muon]
        self._recorder = ReadinessRecorder(len(self._muon)) if self.config.readiness_order == "observed" else None
        self._plan(list(reversed(range(len(self._muon)))))
        check_plan_everywhere(self._muon, self._waves, [p.describe() for p in self._plans])
        self._accumulating = False
        self._commit_at_launch = False  # step() of a synchronous step: its waves commit momentum as they pack
        self._warned_reruns = False
        self._step_count = 0
        self._model_ref = weakref.ref(model)
        self._handles: list[Any] = []
        self._tracker: GradReadyTracker | None = None
        self._covered: set[int] = set()  # Muon params a forward wait covered (async_step)
        self._coverage_checked: set[int] = set()  # Muon params whose forward-wait coverage has been checked
        self._forward_ran = False  # a forward wait ran (a forward of the model)
        self._forward_since_step = False  # a forward wait ran since the last step() (else step() waits itself)
        self._warned_no_forward = False
        self._module_params: dict[nn.Module, set[int]] = {}
        self._at_boundary = False  # a compiled module's wait ran eagerly in this forward (reset at the root's)
        self._root_id = id(model)
        self._subtree: dict[int, set[int]] = {}  # id(module) -> Muon indices of its params, recursively
        self._on_traced_cb: Callable[[], None] | None = None
        if self.config.overlap and self._muon:
            self._tracker = GradReadyTracker([m.param for m in self._muon], weak_callback(self._on_ready),
                                             on_backward_end=weak_callback(self._on_backward_end))
            self._handles.append(self._tracker)
            if self._async:  # [Note: the step barrier]: only the asynchronous step needs forward waits
                self._register_waits(model)
        self._handles.append(model.register_state_dict_pre_hook(weak_callback(self._sync_hook)))
        self._fsdp_roots = _fsdp_roots(model)
        if self.config.overlap:  # [Note: DTensor foreach versions]: every gradient edit must move a version
            dtensors = [m.param for m in self._muon if isinstance(m.param, DTensor)]
            version_fix.acquire(dtensors[0].device_mesh if dtensors else None)
        self._finalizer = weakref.finalize(self, _remove_all, self._handles, self._pipeline, self.config.overlap)
        self._built = True
        if ddp is not None:
            self.attach_ddp(ddp)
        if self._rank == 0:
            logger.info("%s", self.config.describe())

    # ------------------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------------------
    def _log_split(self, adamw_groups: list[dict[str, Any]], named: dict[str, Tensor]) -> None:
        """Rank 0, at construction: which params went to Muon and which to AdamW (a table, then one summary line)."""
        names: dict[int, str] = {}
        for n, p in named.items():  # a tied param: its first name, then "= alias"
            names[id(p)] = f"{names[id(p)]} = {n}" if id(p) in names else n
        mu = [(m.name, m.full_shape, m.transposed) for m in self._muon]
        aw = [(names.get(id(p), "?"), tuple(p.shape), gi) for gi, grp in enumerate(adamw_groups) for p in grp["params"]]
        nb = (sum(m.full_shape[0] * m.full_shape[1] * m.param.element_size() for m in self._muon),
              sum(p.numel() * p.element_size() for grp in adamw_groups for p in grp["params"]))
        table, summary = split_table(mu, aw, nb)
        logger.info("%s", table)
        logger.info("%s", summary)

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
        cfg = self.config

        def one(sub_order: list[int], members: list[int], d: int) -> list[Wave]:
            dp = self._pipeline.dp
            size = self.expert_domain.size if d else self.domain.size * (dp.size if dp is not None else 1)
            costs = [self._costs[i] for i in members]
            if cfg.overlap and cfg.wave_slots is None and cfg.wave_plan == "cost":
                return plan_waves_by_cost(sub_order, costs, [self._muon[i].full_shape for i in members], size,
                                          balance=cfg.balance)
            slots = cfg.wave_slots or (size if cfg.overlap else len(members))
            return plan_waves(sub_order, costs, size, wave_slots=slots, balance=cfg.balance, taper=cfg.overlap)

        self._waves: list[Wave] = plan_by_domain(order, [m.domain for m in self._muon], one)
        dp = self._pipeline.dp
        self._plans = plan_kinds(
            self._waves, [m.full_shape for m in self._muon], [self.domain.size, self.expert_domain.size],
            mode=cfg.mode, surplus=cfg.surplus, fused=cfg.fused_a2a, dp_size=dp.size if dp is not None else 1,
            no_team={m.index for m in self._muon if m.transposed or m.parts is not None},  # NS'd whole instead
            cost_model=None if self._pipeline.lanes.cuda else CPU_GLOO)
        self._pipeline.set_plans(self._plans)
        self._wave_of = {i: w.index for w in self._waves for i in w.params}
        self._dispatcher = WaveDispatcher(self._waves, self._launch)

    def _register_waits(self, model: nn.Module) -> None:
        """Forward pre-hooks (prepended, before FSDP2's all-gather) waiting for the waves of the params each
        module's forward reads (``hooks.params_read_by_module``)."""
        index = self._first
        self._module_params = params_read_by_module(model, index)
        # Every ancestor of a reading module gets a hook too: any of them may be compiled, and then it is the
        # boundary that waits for its subtree ([Note: forward waits under torch.compile] in hooks/forward_wait.py).
        self._subtree = {id(mod): {index[id(p)] for p in mod.parameters() if id(p) in index} for mod in model.modules()}
        hooked = [mod for mod in model.modules() if self._subtree[id(mod)]]
        self._on_traced_cb = weak_callback(self._on_traced)
        self._handles += register_forward_waits(hooked, weak_callback(self._wait_module), self._on_traced_cb)

    # ------------------------------------------------------------------------------------------------------
    # hooks -> dispatcher -> pipeline; forward waits -> pipeline
    # ------------------------------------------------------------------------------------------------------
    def _on_ready(self, first: int) -> None:
        if self._accumulating:
            return
        for i in self._siblings[first]:
            if self._dispatcher.launched > self._wave_of[i]:
                # A new backward before step(): its gradients supersede the waves already launched.
                self._pipeline.discard()
                self._dispatcher.reset()
            if self._recorder is not None:
                self._recorder.mark_ready(i)
            self._dispatcher.mark_ready(i)

    def _on_backward_end(self) -> None:
        if not self._accumulating:
            self._dispatcher.flush()

    def _launch(self, wave: Wave) -> None:
        self._pipeline.launch(wave, Hyper.of(self.param_groups[0]), committed=self._commit_at_launch)

    def _waves_of(self, indices: Iterable[int]) -> list[int]:
        return sorted({self._wave_of[i] for i in indices})

    def _all_of(self, indices: Iterable[int]) -> set[int]:
        """Every Muon index of the params behind ``indices`` (a grouped expert weight's first index stands for all)."""
        return {j for i in indices for j in self._siblings.get(i, (i,))}

    def _wait_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: wait for the waves of ``module``'s params, and of the modules FSDP2 will
        prefetch from ``module``'s pre-forward (``set_modules_to_forward_prefetch``), since that all-gather reads
        their shards before their own pre-hooks run. FSDP2's all-gather streams wait too ([Note: FSDP2 streams]
        in ``hooks/forward_wait.py``). A compiled module waits for its whole subtree: the hooks inside it trace to
        nothing ([Note: forward waits under torch.compile] in ``hooks/forward_wait.py``)."""
        mods = [module]
        if isinstance(module, FSDPModule):
            for other in getattr(module._get_fsdp_state(), "_states_to_forward_prefetch", ()):
                mods.extend(getattr(other, "_modules", ()))
        indices = {i for m in mods for i in self._module_params.get(m, ())}
        self._forward_ran = True  # a forward of the model is running (coverage is checked from then on)
        self._forward_since_step = True
        boundary = compile_boundary(module)
        if boundary or id(module) == self._root_id:  # the root's forward starts a new forward: forget the last
            self._at_boundary = boundary
        if boundary:
            indices |= self._subtree.get(id(module)) or {m.index for m in self._muon
                                                         if any(m.param is p for p in module.parameters())}
        indices = self._all_of(indices)
        self._covered |= indices
        self._pipeline.wait(self._waves_of(indices), streams=fsdp_param_streams(module))

    def _on_traced(self) -> None:
        """Trace time: Dynamo inlined a wait hook into a graph. The wait has moved to the compiled module whose hook
        ran eagerly before the trace ([Note: forward waits under torch.compile]); without one the compiled forward
        could read weights before their update lands. (Checked per forward, not per module: a graph break may run
        a submodule eagerly between the boundary's wait and a later trace.)

        Raises:
            RuntimeError: no compiled module's wait ran eagerly in this forward (e.g. ``torch.compile`` of a function
                calling the model: no hook of ours runs eagerly).
        """
        if self._at_boundary:
            return
        model = self._model_ref()
        if model is not None and type(model).__module__.startswith("torch.nn."):
            # torch.compile wraps a torch.nn class's whole __call__ (its hooks included) instead of its forward
            raise RuntimeError(
                f"OverlapMuon (async_step=True): torch.compile(model) of a torch.nn {type(model).__name__} traces the "
                "model's forward hooks too (torch compiles a torch.nn class's whole __call__, not only its forward), "
                "so no forward wait can run eagerly and the compiled forward could read weights before their update "
                "lands. Use model.compile() (the hooks then run eagerly), compile its children, or the default "
                "async_step=False (no forward waits)."
            )
        raise RuntimeError(
            "OverlapMuon (async_step=True): torch.compile traces a module's forward wait, but no compiled module of the "
            "model ran its wait eagerly first (the model is compiled from outside, e.g. torch.compile of a function "
            "that calls it), so the compiled forward could read weights before their update lands. Supported: "
            "per-block block.compile() / torch.compile(block), model.compile(), and torch.compile(model) of a model "
            "class of your own; or use the default async_step=False (no forward waits)."
        )

    def _sync_hook(self, *_: Any) -> None:
        self.synchronize()

    def _cover_unwaited(self) -> None:
        """``async_step``, at each step after a forward of the model ran: Muon params that got a gradient for the
        first time although no forward wait ran for them are read outside their module's forward (e.g.
        ``F.linear(x, self.lin.weight)`` in a parent); wait for them at the root module's forward from now on, and
        say how to give a precise wait point. Checked whenever the set of params with a gradient grows (a block
        unfrozen later is covered too)."""
        model = self._model_ref()
        fresh = [m.index for m in self._muon if m.param.grad is not None and m.index not in self._coverage_checked]
        self._coverage_checked.update(fresh)
        loose = [i for i in fresh if i not in self._covered]
        if not loose or model is None:
            return
        self.register_wait(model, [self._muon[i].param for i in loose])
        warnings.warn(
            f"OverlapMuon: Muon params {[self._muon[i].name for i in loose]} got a gradient but no forward of the "
            "module owning them ran; they are read elsewhere, so the model's own forward now waits for their "
            "updates. For a later, precise wait point use opt.register_wait(module, params).",
            stacklevel=3,
        )

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
        self._accumulating = False
        self._pipeline.reap()
        ok = self._pipeline.all_finite() if self.config.skip_nonfinite else True
        if self.max_grad_norm is not None and ok:
            # model.parameters() order: the norm of the stacked norms depends on it, as in clip_grad_norm_
            grads = [p.grad for p in self._model_params if p.grad is not None]
            self.last_grad_norm, clipped = clip_grads_by_total_norm_(grads, self.max_grad_norm)
            self.stats["clipped_steps"] += clipped
        self.stats["skipped_steps"] += not ok
        self._commit_at_launch = ok and not self.config.overlap and not self._pipeline.has_pending()
        if self._commit_at_launch:
            self._pipeline.agree_before_launch()  # one agreement for the whole synchronous step
        try:
            self._dispatcher.flush()
        finally:
            self._commit_at_launch = False
        reruns = self._pipeline.commit(self._waves, self.param_groups[0], validate=self.config.overlap, skip=not ok)
        if reruns and not self._warned_reruns:
            self._warned_reruns = True
            warnings.warn(
                f"OverlapMuon: {reruns} of {len(self._waves)} waves were re-run in step() because their inputs "
                "changed after backward launched them (gradients edited in place, e.g. clipping, unscaling or a "
                "collective, DDP averaging without attach_ddp, a changed momentum/NS setting, or optimizer state "
                "loaded between backward and step). The result is exact; the overlap of those waves is lost.",
                stacklevel=2,
            )
        if self._adamw is not None and ok:
            self._adamw.step()
            init_adamw_state(self.param_groups[1:], self.state, self._pipeline.adamw_elsewhere())
        if self._async and self._forward_ran:
            self._cover_unwaited()
        if self._recorder is not None and self._recorder.recorded:
            self._adopt_observed_order()
        self._dispatcher.reset()
        self._step_count += 1
        self.stats["steps"] += 1
        if not self._async:
            self._barrier()
        elif self._muon and not self._forward_since_step:
            self._no_forward_wait()
        else:
            self._pipeline.wait_gradients_read()  # the applies read no gradient: the user may zero them now
        self._forward_since_step = False
        return loss

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

    def _no_forward_wait(self) -> None:
        """No forward of the model ran since the last ``step()`` (the loss was built from the params directly, or
        the model is run through something that skips its modules' forwards): nothing would wait for these updates
        before the weights are read again, so wait now, as a forward would (CPU: the host; CUDA: the current
        stream), and say so once."""
        if not self._warned_no_forward:
            self._warned_no_forward = True
            warnings.warn(
                "OverlapMuon (async_step=True): no forward of the model ran since the last step(), so no forward wait "
                "could hold back reads of the updated weights; step() now waits for its updates itself (the "
                "overlap with the next forward is lost). Run the model's forward, or read weights after "
                "opt.wait_for(params).",
                stacklevel=3,
            )
        self._pipeline.wait([w.index for w in self._waves])

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
        index = self._first
        self._pipeline.wait(self._waves_of(self._all_of(index[id(p)] for p in params if id(p) in index)))

    def register_wait(self, module: nn.Module, params: Iterable[Tensor]) -> None:
        """Make ``module``'s forward wait for ``params``' updates (a precise wait point for weights read outside
        the forward of the module that owns them, e.g. a fused QKV built in the parent's forward)."""
        index = self._first
        mine = self._all_of(index[id(p)] for p in params if id(p) in index)
        self._module_params[module] = self._module_params.get(module, set()) | mine
        self._covered |= mine
        self._handles += register_forward_waits([module], weak_callback(self._wait_module), self._on_traced_cb)

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
        prev = self._accumulating
        self._accumulating = True
        if self._tracker is not None:
            self._tracker.enabled = False
        try:
            yield
        finally:
            self._accumulating = prev
            if self._tracker is not None:
                self._tracker.enabled = not prev

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
                                         dict(self._first),
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
