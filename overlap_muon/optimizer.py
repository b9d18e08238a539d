"""``OverlapMuon``: layer-sharded Muon whose optimizer work hides inside backward and the next forward.

[Note: one step, data flowing] (DESIGN.md section 3) A Muon matrix's gradient becomes ready in backward; the
grad-ready hook marks it in the :class:`scheduler.WaveDispatcher`, which launches wave k (strictly in wave
order) once all of its matrices are ready. A wave is three lane tasks (``overlap_muon.lanes``): momentum update,
bf16 cast and ``all_to_all`` to the NS homes; batched NS on each home; ``all_to_all`` back and the update applied
to the param shards. The next forward's pre-hooks wait for the waves holding each module's params. With
``overlap=False`` the same waves run inside ``step()`` and ``step()`` waits for them.

[Note: exactness] Momentum, Nesterov, the bf16 cast, weight decay and the update are elementwise, so each rank
runs them on its own shard; only NS needs the whole matrix, which the home assembles bit for bit. NS of a
matrix therefore sees exactly the bf16 tensor ``torch.optim.Muon`` would build, and the learning-rate ratio
uses the full logical shape. The result equals ``torch.optim.Muon`` + ``torch.optim.AdamW`` bit for bit.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from hooks import GradReadyTracker, ddp_readiness_hook, register_forward_waits
from scheduler import ReadinessRecorder, WaveDispatcher, ns_flops, plan_waves
from scheduler.waves import Wave

from .config import OverlapMuonConfig, resolve_config
from .domain import Domain, chunk_sizes
from .lanes import LaneHandle, Lanes
from .layer_sharded_a2a import all_gather_full, from_homes, local_shard, to_homes
from .ns import DEFAULT_NS_COEFFICIENTS, _schedule, adjusted_lr, zeropower
from .profiling import prof_range, wave_range_name

__all__ = ["OverlapMuon"]

logger = logging.getLogger("overlap_muon")

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

try:
    from torch.distributed.fsdp import FSDPModule
except Exception:  # pragma: no cover
    FSDPModule = ()  # type: ignore[assignment]


def _local(t: Tensor) -> Tensor:
    """The local shard of a DTensor (sharing storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class _MuonParam:
    index: int
    name: str
    param: Tensor  # nn.Parameter, DTensor or plain; local shard via _local()
    full_shape: tuple[int, int]  # (P, Q), the logical shape NS and the lr ratio see
    partition_dim: int | None  # TP split: 0, 1 or None (DESIGN.md section 2)


def _is_strided_or_shard0(p: Any) -> bool:
    if isinstance(p, _StridedShard):
        return p.dim == 0
    return isinstance(p, Shard) and p.dim == 0


class OverlapMuon(torch.optim.Optimizer):
    """Layer-sharded Muon for 2-D weights plus ``torch.optim.AdamW`` for every other param.

    Args:
        model: the model (``nn.Module``); its params are sorted into Muon matrices (``muon_filter``) and AdamW
            params. Tied params are handled once.
        lr, weight_decay, momentum, nesterov, ns_coefficients, ns_steps, eps, adjust_lr_fn: Muon
            hyper-parameters with ``torch.optim.Muon``'s names, defaults and meaning. ``ns_coefficients`` may
            also be a sequence of ``ns_steps`` per-step ``(a, b, c)`` tuples.
        adamw_kwargs: passed verbatim to the ``torch.optim.AdamW`` of the non-Muon params (default ``{}``).
        muon_filter: ``(name, param) -> bool`` picking Muon params; default: 2-D weights of ``nn.Linear``.
        device_mesh: a 2-D ``DeviceMesh`` with dims ``("remat", "tp")``, or 1-D (dim named ``"tp"``: TP only,
            else remat only), over which the Muon params are DTensors (FSDP2 ``fully_shard`` over ``remat``,
            ``ColwiseParallel``/``RowwiseParallel`` over ``tp``).
        tp_group, remat_group: explicit groups for plain-tensor params (each carrying ``partition_dim`` in
            ``{0, 1, None}``, and optionally ``full_shape`` for uneven shards; even splits otherwise).
        mode, fused_a2a, batch_ns, balance, overlap, wave_slots, side_streams, nvtx, pg_timeout_s: toggles;
            ``None`` takes the environment variable or the default (``overlap_muon.config``).
        readiness_order: ``"reverse"`` (reverse registration order, how backward usually produces gradients)
            or ``"observed"`` (rank 0's order observed in the first step, broadcast, then fixed).
        skip_nonfinite: when True, a step in which any Muon gradient on any rank is non-finite is skipped on every
            rank (params, momentum and AdamW untouched; ``stats["skipped_steps"]`` counts them). Costs one
            all-reduce of a flag per step and moves each wave's apply after ``step()``. Off by default, which
            matches ``torch.optim.Muon`` (NaNs propagate).
        check_grad_presence: each wave first checks, with one small all_to_all over the domain, that every rank
            agrees on which of its params have a gradient, and raises ``ValueError`` on every rank if not
            (instead of mismatched exchanges waiting until the timeout). ``False`` saves that collective when
            gradient presence is known to match (FSDP2/TP models compute the same params on every rank).
        ns_delay_s: test hook: seconds slept before each NS task (makes overlap observable on CPU).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: a hyper-parameter is out of range, a Muon param is not 2-D, a param's placements or local
            shape do not fit the domain (the message names the param, its shape and the expectation), or a
            toggle is malformed. Raised on every rank, before any exchange.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: Any = DEFAULT_NS_COEFFICIENTS,
        ns_steps: int = 5,
        eps: float = 1e-7,
        adjust_lr_fn: str | None = None,
        adamw_kwargs: dict[str, Any] | None = None,
        muon_filter: Callable[[str, Tensor], bool] | None = None,
        device_mesh: Any = None,
        tp_group: dist.ProcessGroup | None = None,
        remat_group: dist.ProcessGroup | None = None,
        mode: str | None = None,
        fused_a2a: bool | None = None,
        batch_ns: bool | None = None,
        balance: str | None = None,
        overlap: bool | None = None,
        wave_slots: int | None = None,
        side_streams: bool | None = None,
        nvtx: bool | None = None,
        pg_timeout_s: float | None = None,
        readiness_order: str = "reverse",
        skip_nonfinite: bool = False,
        check_grad_presence: bool = True,
        ns_delay_s: float = 0.0,
    ) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"OverlapMuon expects an nn.Module, got {type(model).__name__}")
        if isinstance(lr, Tensor):
            if lr.numel() != 1:
                raise ValueError("Tensor lr must be 1-element")
            lr = float(lr.item())
        if not 0.0 <= lr:
            raise ValueError(f"Learning rate should be >= 0 but is: {lr}")
        if not 0.0 <= momentum:
            raise ValueError(f"momentum should be >= 0 but is: {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight decay should be >= 0 but is: {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(f"Adjust learning rate function {adjust_lr_fn} is not supported")
        if not (isinstance(eps, (int, float)) and eps >= 0):
            raise ValueError(f"eps should be >= 0 but is: {eps}")
        _schedule(ns_coefficients, ns_steps)  # validates
        if not (isinstance(ns_delay_s, (int, float)) and ns_delay_s >= 0):
            raise ValueError(f"ns_delay_s must be >= 0 seconds, got {ns_delay_s!r}")
        if readiness_order not in ("reverse", "observed"):
            raise ValueError(f"readiness_order must be 'reverse' or 'observed', got {readiness_order!r}")
        if muon_filter is not None and not callable(muon_filter):
            raise TypeError("muon_filter must be callable (name, param) -> bool")

        self.config: OverlapMuonConfig = resolve_config(
            mode=mode,
            overlap=overlap,
            fused_a2a=fused_a2a,
            batch_ns=batch_ns,
            balance=balance,
            wave_slots=wave_slots,
            side_streams=side_streams,
            nvtx=nvtx,
            pg_timeout_s=pg_timeout_s,
        )
        self._dist = dist.is_available() and dist.is_initialized()
        self._world = dist.get_world_size() if self._dist else 1
        self._rank = dist.get_rank() if self._dist else 0

        # ---- sort params ------------------------------------------------------------------------------
        linear_weights = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
        muon_named: list[tuple[str, Tensor]] = []
        adamw_params: list[Tensor] = []
        errors: list[str] = []
        for name, p in model.named_parameters():  # remove_duplicate=True: a tied param appears once
            if not p.requires_grad:
                continue
            pick = muon_filter(name, p) if muon_filter is not None else (id(p) in linear_weights and p.ndim == 2)
            if pick:
                if p.ndim != 2:
                    errors.append(f"Muon param {name!r} has shape {tuple(p.shape)}; Muon needs a 2-D matrix")
                    continue
                muon_named.append((name, p))
            else:
                adamw_params.append(p)

        # ---- domain --------------------------------------------------------------------------------------
        R, T, layouts, mesh_err = self._domain_layout(device_mesh, tp_group, remat_group)
        if mesh_err:
            errors.append(mesh_err)
        g = t = 0
        for lay in layouts if (layouts is not None and self._dist) else ():
            for gg, row in enumerate(lay):
                if self._rank in row:
                    g, t = gg, row.index(self._rank)
        self._muon: list[_MuonParam] = []
        for i, (name, p) in enumerate(muon_named):
            mp, err = self._describe_param(i, name, p, device_mesh, R, T, g, t)
            if err:
                errors.append(err)
            else:
                self._muon.append(mp)
        self._raise_everywhere(errors)

        timeout = datetime.timedelta(seconds=self.config.pg_timeout_s)
        if layouts is not None and self._dist:
            # Two group sets: the gather and the scatter lanes run concurrently ([Note: one process-group set
            # per communicating lane] in lanes.py).
            self._dom_to = Domain.from_all_layouts(layouts, timeout=timeout)
            self._dom_from = Domain.from_all_layouts(layouts, timeout=timeout)
            self._ctrl_group = dist.new_group(ranks=list(range(self._world)), timeout=timeout)
        else:
            self._dom_to = self._dom_from = Domain.single()
            self._ctrl_group = None
        self.domain = self._dom_to
        """This rank's :class:`~overlap_muon.domain.Domain` (sizes R x T, coordinates g, t)."""

        # ---- optimizer plumbing ---------------------------------------------------------------------------
        self._adamw = torch.optim.AdamW(adamw_params, **(adamw_kwargs or {})) if adamw_params else None
        muon_group = {
            "params": [m.param for m in self._muon],
            "algorithm": "muon",
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": ns_coefficients,
            "ns_steps": ns_steps,
            "eps": eps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        groups: list[dict[str, Any]] = [muon_group]
        if self._adamw is not None:
            for g in self._adamw.param_groups:
                g["algorithm"] = "adamw"
            groups.extend(self._adamw.param_groups)
        defaults = {k: v for k, v in muon_group.items() if k not in ("params", "algorithm")}
        super().__init__(groups, defaults)
        self._link_adamw()
        for m in self._muon:  # eager momentum: identical state_dict keys on every rank (issue: checkpoints)
            self.state[m.param]["momentum_buffer"] = torch.zeros_like(m.param, memory_format=torch.preserve_format)
        self._init_adamw_state()
        self._param_names = {id(p): n for n, p in model.named_parameters()}

        # ---- plan -------------------------------------------------------------------------------------------
        self._costs = [float(ns_flops(m.full_shape, ns_steps)) for m in self._muon]
        self._order = list(reversed(range(len(self._muon))))
        self._recorder: ReadinessRecorder | None = (
            ReadinessRecorder(len(self._muon)) if readiness_order == "observed" and self._muon else None
        )
        self._waves: list[Wave] = []
        self._wave_of: dict[int, int] = {}
        self._plan()
        self._lanes = Lanes(self._device(), side_streams=self.config.side_streams, delay_s=ns_delay_s)
        self._handles: dict[int, LaneHandle] = {}  # wave index -> its final (apply) task, this step
        self._inflight: list[LaneHandle] = []  # every task launched and not yet waited for
        self.skip_nonfinite = bool(skip_nonfinite)
        self.check_grad_presence = bool(check_grad_presence)
        self._staged: list[tuple[int, LaneHandle, LaneHandle, Callable]] = []  # skip_nonfinite: applies awaiting the verdict
        self._route_plans: dict[Any, dict] = {}
        self._lock = threading.RLock()
        self._accumulating = False
        self._step_count = 0
        self.stats: dict[str, int] = defaultdict(int)
        """Counters: ``ns_matrices`` (matrices NS'd on this rank), ``ns_calls`` (zeropower calls),
        ``waves_launched``, ``steps``."""
        self.timeline: list[tuple[str, int, float]] | None = None
        """When a list, ``(event, wave, time.perf_counter())`` records of launches and waits (tests)."""

        self._dispatcher = WaveDispatcher(self._waves, self._launch)
        self._tracker: GradReadyTracker | None = None
        self._wait_handles: list[Any] = []
        if self.config.overlap and self._muon:
            self._tracker = GradReadyTracker(
                [m.param for m in self._muon], self._on_ready, on_backward_end=self._on_backward_end
            )
            self._register_waits(model)
        self._built = True
        if self._rank == 0:
            logger.info("%s", self.config.describe())

    # ------------------------------------------------------------------------------------------------------
    # construction helpers
    # ------------------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        for m in self._muon:
            return _local(m.param).device
        return torch.device("cpu")

    def _raise_everywhere(self, errors: list[str]) -> None:
        """Raise on every rank if any rank found bad input (invariant 6), before any exchange."""
        if self._dist and self._world > 1:
            gathered: list[Any] = [None] * self._world
            dist.all_gather_object(gathered, errors)
            all_errors = []
            for r, errs in enumerate(gathered):
                all_errors.extend(errs if r == self._rank else [f"(rank {r}) {e}" for e in errs])
            errors = [e for e in errors] + [e for e in all_errors if e.startswith("(rank ")]
        if errors:
            raise ValueError("OverlapMuon: " + "; ".join(dict.fromkeys(errors)))

    def _domain_layout(
        self, mesh: Any, tp_group: Any, remat_group: Any
    ) -> tuple[int, int, list[list[list[int]]] | None, str | None]:
        """``(R, T, layouts of every domain, error)``; layouts ``None`` means one process, no groups."""
        if mesh is not None:
            if tp_group is not None or remat_group is not None:
                return 1, 1, None, "pass either device_mesh or tp_group/remat_group, not both"
            names = tuple(mesh.mesh_dim_names or ())
            grid = mesh.mesh
            if mesh.ndim == 2:
                if names != ("remat", "tp"):
                    return 1, 1, None, f"a 2-D device_mesh must have dims ('remat', 'tp'), got {names}"
                layout = grid.tolist()
            elif mesh.ndim == 1:
                layout = [grid.tolist()] if names == ("tp",) else [[r] for r in grid.tolist()]
            else:
                return 1, 1, None, f"device_mesh must be 1-D or 2-D ('remat', 'tp'), got {mesh.ndim}-D {names}"
            return len(layout), len(layout[0]), self._gather_layouts(layout), None
        if not self._dist or (tp_group is None and remat_group is None):
            return 1, 1, None, None
        tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [self._rank]
        remat_ranks = dist.get_process_group_ranks(remat_group) if remat_group is not None else [self._rank]
        info: list[Any] = [None] * self._world
        dist.all_gather_object(info, (sorted(remat_ranks), sorted(tp_ranks)))
        layout = [info[r][1] for r in sorted(remat_ranks)]
        return len(layout), len(layout[0]), self._gather_layouts(layout), None

    def _gather_layouts(self, layout: list[list[int]]) -> list[list[list[int]]]:
        if not self._dist or self._world == 1:
            return [layout]
        allp: list[Any] = [None] * self._world
        dist.all_gather_object(allp, layout)
        uniq: dict[str, list[list[int]]] = {}
        for lay in allp:
            uniq.setdefault(repr(lay), lay)
        return sorted(uniq.values(), key=lambda lay: lay[0][0])

    def _describe_param(
        self, i: int, name: str, p: Tensor, mesh: Any, R: int, T: int, g: int, t: int
    ) -> tuple[_MuonParam | None, str | None]:
        if isinstance(p, DTensor):
            pl = p.placements
            names = tuple(p.device_mesh.mesh_dim_names or ())
            full = (int(p.shape[0]), int(p.shape[1]))
            if mesh is None:
                return None, f"Muon param {name!r} is a DTensor but no device_mesh was given"
            mesh_names = tuple(mesh.mesh_dim_names or ())
            # The remat dim: "remat" on a 2-D mesh; the only dim of a 1-D mesh unless it is named "tp".
            if mesh.ndim == 2:
                remat_name: str | None = "remat"
            elif mesh_names == ("tp",):
                remat_name = None
            else:
                remat_name = mesh_names[0] if mesh_names else None
            by_name = dict(zip(names, pl))
            if not set(names) <= set(mesh_names):
                return None, (
                    f"Muon param {name!r} lives on mesh dims {names}, not on (a sub-mesh of) the device_mesh "
                    f"{mesh_names} passed"
                )
            remat_pl = by_name.get(remat_name, Replicate()) if remat_name else Replicate()
            tp_pl = by_name.get("tp", Replicate())
            if R > 1 and not _is_strided_or_shard0(remat_pl):
                return None, (
                    f"Muon param {name!r} (shape {full}) has placement {remat_pl} on the remat dim; expected "
                    "Shard(0) (FSDP2 fully_shard)"
                )
            if T > 1:
                if isinstance(tp_pl, Shard) and tp_pl.dim in (0, 1):
                    pd: int | None = tp_pl.dim
                elif isinstance(tp_pl, Replicate):
                    pd = None
                else:
                    return None, f"Muon param {name!r} has TP placement {tp_pl}; expected Shard(0), Shard(1) or Replicate"
            else:
                pd = None
        else:
            pd = getattr(p, "partition_dim", None) if T > 1 else None
            if T > 1 and not hasattr(p, "partition_dim"):
                return None, (
                    f"Muon param {name!r} with local shape {tuple(p.shape)} has no partition_dim attribute; "
                    f"plain tensors on a {R}x{T} domain need partition_dim in {{0, 1, None}}"
                )
            if pd not in (0, 1, None):
                return None, f"Muon param {name!r} has partition_dim={pd!r}; expected 0, 1 or None"
            fs = getattr(p, "full_shape", None)
            a, b = int(p.shape[0]), int(p.shape[1])
            if fs is not None:
                full = (int(fs[0]), int(fs[1]))
            elif pd == 0:
                full = (a * R * T, b)
            elif pd == 1:
                full = (a * R, b * T)
            else:
                full = (a * R, b)
        # Check the local block against the layout (DESIGN.md section 2).
        P, Q = full
        if pd == 0:
            rows = chunk_sizes(chunk_sizes(P, T)[t], R)[g]
            cols = Q
        elif pd == 1:
            rows, cols = chunk_sizes(P, R)[g], chunk_sizes(Q, T)[t]
        else:
            rows, cols = chunk_sizes(P, R)[g], Q
        loc = tuple(_local(p).shape)
        if loc != (rows, cols):
            return None, (
                f"Muon param {name!r} has local shape {loc}, expected {(rows, cols)} for full shape {full}, "
                f"partition_dim={pd} on a {R}x{T} domain at (g={g}, t={t})"
            )
        return _MuonParam(i, name, p, full, pd), None

    def _init_adamw_state(self) -> None:
        """Create the AdamW state now, as ``torch.optim.AdamW._init_group`` does on a param's first step (zero
        moments, ``step`` 0), so the state holds every param from construction on: DCP's ``set_state_dict``
        builds its load template from it (and skips its own warm-up step once any state exists)."""
        for group in self.param_groups[1:]:
            for p in group["params"]:
                st = self.state[p]
                if st:
                    continue
                if group["capturable"] or group["fused"]:
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                else:
                    st["step"] = torch.tensor(0.0, dtype=torch.float32)
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Only during construction: the Muon params, their domain layout, homes, waves and hooks are planned
        once from the model.

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
        """Share state and param-group dicts with the inner AdamW, so LR schedulers and state_dict see both."""
        if self._adamw is not None:
            self._adamw.state = self.state
            self._adamw.param_groups = self.param_groups[1:]

    def _plan(self) -> None:
        n = len(self._muon)
        if n == 0:
            self._waves, self._wave_of = [], {}
            return
        slots = self.config.wave_slots
        if slots is None:
            # Overlap: one matrix per home per wave; synchronous: one wave (fewest collectives).
            slots = self._dom_to.size if self.config.overlap else n
        self._waves = plan_waves(
            self._order, self._costs, self._dom_to.size, wave_slots=slots, balance=self.config.balance,
            taper=self.config.overlap,
        )
        self._wave_of = {i: w.index for w in self._waves for i in w.params}

    def _register_waits(self, model: nn.Module) -> None:
        """Forward pre-hooks (prepended, before FSDP2's all-gather) waiting for the waves of each module's params.

        A module that owns Muon params directly waits for them; an FSDP2 module also waits for the Muon params
        it manages (its subtree minus nested FSDP2 modules), since it all-gathers them in its own pre-hook.
        """
        index = {id(m.param): m.index for m in self._muon}
        waits: dict[nn.Module, set[int]] = {}

        def managed(mod: nn.Module) -> set[int]:
            out: set[int] = set()
            for p in mod.parameters(recurse=False):
                if id(p) in index:
                    out.add(index[id(p)])
            for child in mod.children():
                if not isinstance(child, FSDPModule):
                    out |= managed(child)
            return out

        for mod in model.modules():
            own = {index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index}
            if isinstance(mod, FSDPModule):
                own |= managed(mod)
            if own:
                waits[mod] = own
        self._module_params = waits
        self._wait_handles = register_forward_waits(list(waits), self._wait_module)
        # model.state_dict() (a checkpoint) must not read params whose Muon update is still in flight.
        self._wait_handles.append(model.register_state_dict_pre_hook(lambda *_: self.synchronize()))

    # ------------------------------------------------------------------------------------------------------
    # hooks -> dispatcher -> lanes
    # ------------------------------------------------------------------------------------------------------
    def _on_ready(self, i: int) -> None:
        if self._accumulating:
            return
        if self._dispatcher.launched > self._wave_of[i]:
            raise RuntimeError(
                f"OverlapMuon: Muon param {self._muon[i].name!r} received another gradient after its wave was "
                "launched in this step (a second backward before step()). For gradient accumulation run every "
                "micro-batch but the last under `with opt.no_sync():`, or use overlap=False."
            )
        if self._recorder is not None:
            self._recorder.mark_ready(i)
        self._dispatcher.mark_ready(i)

    def _on_backward_end(self) -> None:
        if not self._accumulating:
            self._dispatcher.flush()

    def _record(self, event: str, wave: int) -> None:
        if self.timeline is not None:
            self.timeline.append((event, wave, time.perf_counter()))

    def _launch(self, wave: Wave) -> None:
        """Issue one wave's three lane tasks (called in wave order on every rank)."""
        group = self.param_groups[0]
        items = [i for i in wave.params if self._muon[i].param.grad is not None]
        self.stats["waves_launched"] += 1
        self._record("launch", wave.index)
        # [Note: gradient presence] Which params take part is decided per rank (a param without a gradient is
        # skipped, as torch.optim.Muon does). Ranks that disagree would post mismatched all_to_alls and wait
        # until the timeout, so each wave first agrees on it (one small all_to_all on the same lane and group).
        check = self.check_grad_presence and self._dom_to.flat_group is not None
        if not items and not check:
            return
        k = wave.index
        lr = group["lr"]
        lr = float(lr.item()) if isinstance(lr, Tensor) else float(lr)
        wd, mu, nesterov = group["weight_decay"], group["momentum"], group["nesterov"]
        ns_kw = dict(ns_coefficients=group["ns_coefficients"], ns_steps=group["ns_steps"], eps=group["eps"])
        adj = group["adjust_lr_fn"]
        mps = [self._muon[i] for i in items]
        grads = [_local(m.param.grad) for m in mps]
        bufs = [_local(self.state[m.param]["momentum_buffer"]) for m in mps]
        homes = [wave.homes[i] for i in items]
        pds = [m.partition_dim for m in mps]
        shapes = [m.full_shape for m in mps]
        key = (k, tuple(items))
        plan_to = self._route_plans.setdefault(("to",) + key, {})
        plan_from = self._route_plans.setdefault(("from",) + key, {})
        fused = self.config.fused_a2a
        duplicated = self.config.mode == "duplicated"
        nv = self.config.nvtx
        dom_to, dom_from = self._dom_to, self._dom_from

        staged = self.skip_nonfinite  # apply only after the step's finiteness verdict (see step())

        def exchange(phase: str, dom: Domain, fn: Callable[[], Any]) -> Any:
            # Name the exchange in the error: a dead or stuck peer shows up here as a gloo/NCCL error or timeout.
            try:
                return fn()
            except ValueError:
                raise  # bad input, already named (raised on every rank before the collective)
            except Exception as e:
                raise RuntimeError(
                    f"OverlapMuon wave {k} {phase} failed on rank {self._rank} "
                    f"({'fused' if fused else 'two-stage'} {'all_gather' if duplicated else 'all_to_all'} over the "
                    f"runtime's {self._group_desc(dom)}; params {[m.name for m in mps]}): {e}"
                ) from e

        def to_home_task() -> tuple[list[Tensor], list[Tensor], list[int], list[Tensor]] | None:
            if check:
                exchange("a2a_to_home", dom_to, lambda: self._agree_on_gradients(wave, items, dom_to))
                if not items:  # no rank has a gradient for this wave
                    return None
            with prof_range(wave_range_name(k, "pack"), nvtx=nv):
                packed, new_bufs = [], []
                for g, buf in zip(grads, bufs):
                    if staged:  # out of place: a skipped step must leave the momentum untouched
                        buf = buf.lerp(g, 1 - mu)
                        new_bufs.append(buf)
                    else:
                        buf.lerp_(g, 1 - mu)
                    u = g.lerp(buf, mu) if nesterov else buf
                    packed.append(u.bfloat16())
            with prof_range(wave_range_name(k, "a2a_to_home"), nvtx=nv):
                if duplicated:
                    fulls = exchange("a2a_to_home", dom_to, lambda: all_gather_full(packed, pds, shapes, dom_to))
                    mine = list(range(len(items)))
                else:
                    fulls, mine = exchange(
                        "a2a_to_home",
                        dom_to,
                        lambda: to_homes(packed, homes, pds, shapes, dom_to, fused=fused, plan=plan_to),
                    )
            return packed, fulls, mine, new_bufs

        def ns_task() -> list[Tensor] | None:
            if h_to.result() is None:
                return None
            fulls = h_to.result()[1]
            self._record("ns_start", k)
            with prof_range(wave_range_name(k, "ns"), nvtx=nv):
                return self._ns_many(fulls, ns_kw)

        def apply(shards: list[Tensor], new_bufs: list[Tensor]) -> None:
            with prof_range(wave_range_name(k, "apply"), nvtx=nv):
                for j, (m, o) in enumerate(zip(mps, shards)):
                    if new_bufs:
                        bufs[j].copy_(new_bufs[j])
                    p = _local(m.param)
                    p.mul_(1 - lr * wd)
                    p.add_(o, alpha=-adjusted_lr(lr, adj, m.full_shape))

        def from_home_task() -> list[Tensor] | None:
            if h_to.result() is None:
                return None
            packed, _, mine, new_bufs = h_to.result()
            outs = h_ns.result()
            with prof_range(wave_range_name(k, "a2a_from_home"), nvtx=nv):
                if duplicated:
                    shards = [local_shard(o, pd, dom_to) for o, pd in zip(outs, pds)]
                else:
                    shards = exchange(
                        "a2a_from_home",
                        dom_from,
                        lambda: from_homes(outs, mine, packed, homes, pds, shapes, dom_from, fused=fused, plan=plan_from),
                    )
            if not staged:
                apply(shards, new_bufs)
            return shards

        h_to = self._lanes.submit("to_home", to_home_task)
        h_ns = self._lanes.submit("compute", ns_task, deps=[h_to])
        h_from = self._lanes.submit("from_home", from_home_task, deps=[h_ns])
        with self._lock:
            self._handles[k] = h_from
            self._inflight.extend([h_to, h_ns, h_from])
            if staged:
                self._staged.append((k, h_to, h_from, apply))

    def _commit_staged(self, ok: bool) -> None:
        """skip_nonfinite: after the verdict, queue each staged wave's apply (or drop it) on the from_home lane."""
        with self._lock:
            staged, self._staged = self._staged, []
        for k, h_to, h_from, apply in staged:
            if not ok:
                continue

            def task(h_to: LaneHandle = h_to, h_from: LaneHandle = h_from, apply: Callable = apply) -> None:
                if h_to.result() is not None:
                    apply(h_from.result(), h_to.result()[3])

            h = self._lanes.submit("from_home", task, deps=[h_from])
            with self._lock:
                self._handles[k] = h
                self._inflight.append(h)

    def _agree_on_gradients(self, wave: Wave, items: list[int], dom: Domain) -> None:
        """Raise on every rank of the domain if its ranks disagree on which params of ``wave`` have a gradient
        (each rank sends its 1-byte-per-param flags to every peer: one small ``all_to_all``).

        Raises:
            ValueError: some params have a gradient on some ranks of the domain and not on others.
        """
        g = dom.flat_group
        dev = self._device() if dist.get_backend(g) == "nccl" else torch.device("cpu")
        have = torch.tensor([1 if i in items else 0 for i in wave.params], dtype=torch.uint8, device=dev)
        # An all_to_all rather than an all_reduce: every rank hears from every peer directly, so a dead peer
        # shows as a reset connection at once instead of as a ring neighbour's timeout.
        everyone = torch.empty(dom.size * have.numel(), dtype=torch.uint8, device=dev)
        dist.all_to_all_single(everyone, have.repeat(dom.size), group=g)
        table = everyone.view(dom.size, -1)
        agree = (table == table[0]).all(dim=0).tolist()
        split = [self._muon[i].name for i, ok in zip(wave.params, agree) if not ok]
        if split:
            raise ValueError(
                f"Muon params {split} have a gradient on some ranks of the {dom.remat_size}x{dom.tp_size} domain "
                f"and not on others (this rank: {[self._muon[i].name for i in items if self._muon[i].name in split]} "
                "have one); every rank of a domain must compute the same params' gradients"
            )

    def _group_desc(self, dom: Domain) -> str:
        if self.config.fused_a2a or self.config.mode == "duplicated":
            g = dom.flat_group
            what = "flat R x T group"
        else:
            g = dom.remat_group or dom.tp_group
            what = "remat/TP groups"
        ranks = dist.get_process_group_ranks(g) if g is not None else [self._rank]
        return f"{what} {dom.remat_size}x{dom.tp_size}, global ranks {ranks}"

    def _ns_many(self, mats: list[Tensor], ns_kw: dict[str, Any]) -> list[Tensor]:
        """NS of each matrix, same-shape matrices batched (no flattening across matrices)."""
        self.stats["ns_matrices"] += len(mats)
        if not self.config.batch_ns:
            self.stats["ns_calls"] += len(mats)
            return [zeropower(m, **ns_kw) for m in mats]
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for j, m in enumerate(mats):
            by_shape.setdefault(tuple(m.shape), []).append(j)
        out: list[Tensor | None] = [None] * len(mats)
        for js in by_shape.values():
            self.stats["ns_calls"] += 1
            if len(js) == 1:
                out[js[0]] = zeropower(mats[js[0]], **ns_kw)
            else:
                res = zeropower(torch.stack([mats[j] for j in js]), **ns_kw)
                for r, j in enumerate(js):
                    out[j] = res[r]
        return out  # type: ignore[return-value]

    def _wait_module(self, module: nn.Module) -> None:
        """Forward pre-hook body: wait for the waves of ``module``'s params, and of the modules FSDP2 will
        prefetch from ``module``'s pre-forward (``set_modules_to_forward_prefetch``), since that all-gather reads
        their shards before their own pre-hooks run."""
        mods = [module]
        if isinstance(module, FSDPModule):
            state = module._get_fsdp_state()
            for other in getattr(state, "_states_to_forward_prefetch", ()):
                mods.extend(getattr(other, "_modules", ()))
        waves = sorted({self._wave_of[i] for m in mods for i in self._module_params.get(m, ())})
        for k in waves:
            h = self._handles.get(k)
            if h is None:
                continue
            self._record("wait_begin", k)
            with prof_range(f"OverlapMuon::wait::wave{k}", nvtx=self.config.nvtx):
                self._wait_handle(h)
            self._record("wait_end", k)

    def _wait_handle(self, h: LaneHandle) -> None:
        try:
            h.wait_on_current_stream()
        except BaseException as e:
            raise RuntimeError(
                f"OverlapMuon: a {h.lane} lane task failed (see the chained exception for its traceback); "
                "the step's Muon update is incomplete"
            ) from e

    # ------------------------------------------------------------------------------------------------------
    # public API
    # ------------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """One optimizer step.

        Overlap mode: launches the waves backward has not launched yet (params without a gradient are skipped),
        runs the AdamW part, and returns WITHOUT waiting for the Muon updates: the next forward waits per module,
        ``synchronize()`` waits for all. Synchronous mode (``overlap=False``): runs the waves and waits.

        Returns:
            the closure's loss, if a closure is given.

        Raises:
            RuntimeError: a lane task of an earlier wave failed (its traceback is chained).
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._accumulating = False
        ok = True
        if self.skip_nonfinite:
            ok = self._all_finite()
            if not ok:
                self.stats["skipped_steps"] += 1
        self._dispatcher.flush()
        if self.skip_nonfinite:
            self._commit_staged(ok)
        if self._adamw is not None and ok:
            self._adamw.step()
        if self._recorder is not None and self._step_count == 0:
            self._adopt_observed_order()
        self._dispatcher.reset()
        self._step_count += 1
        self.stats["steps"] += 1
        if not self.config.overlap:
            self.synchronize()
        else:
            self._reap()
        return loss

    def _reap(self) -> None:
        """Drop finished tasks (releases what CUDA tasks kept alive); surface a failed one now."""
        with self._lock:
            flags = [(h, h.done()) for h in self._inflight]
            self._inflight = [h for h, d in flags if not d]
        for h, d in flags:
            if d:
                self._wait_handle(h)

    def _all_finite(self) -> bool:
        """True when every Muon gradient on every rank is finite: one all-reduce of a flag on the control group."""
        bad = any(
            m.param.grad is not None and not bool(torch.isfinite(_local(m.param.grad)).all()) for m in self._muon
        )
        flag = torch.tensor([1.0 if bad else 0.0], device=self._device() if self._device().type == "cuda" else "cpu")
        if self._ctrl_group is not None:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._ctrl_group)
        return flag.item() == 0.0

    def synchronize(self) -> None:
        """Block until every launched wave has been applied (host waits; on CUDA the device too).

        Raises:
            RuntimeError: a lane task failed; its original exception (and traceback) is chained.
        """
        with self._lock:
            pending, self._inflight = self._inflight, []
        for h in pending:
            if h.event is not None:
                h.event.synchronize()
            self._wait_handle(h)

    def _adopt_observed_order(self) -> None:
        """After the first step: broadcast rank 0's observed readiness order and re-plan the waves with it."""
        assert self._recorder is not None
        self.synchronize()
        order = [self._recorder.order()]
        if self._ctrl_group is not None:
            dist.broadcast_object_list(order, src=0, group=self._ctrl_group)
        self._recorder = None
        self._order = list(order[0])
        self._plan()
        self._handles.clear()
        self._route_plans.clear()
        self._dispatcher = WaveDispatcher(self._waves, self._launch)

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
        """Like ``Optimizer.zero_grad``; zeroing in place first waits for the lanes still reading gradients."""
        if not set_to_none:
            self.synchronize()
        super().zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        """Waits for in-flight waves, then ``Optimizer.state_dict()``.

        Muon momentum stays sharded as the params are (a DTensor param's momentum is a DTensor with the same
        placements; a plain param's is its local block). Every Muon param has a momentum buffer from
        construction on, so every rank holds the same keys. An ``"overlap_muon"`` entry records the param names
        and shapes that :meth:`load_state_dict` checks.
        """
        self.synchronize()
        sd = super().state_dict()
        sd["overlap_muon"] = {
            "muon_params": [(m.name, list(m.full_shape), m.partition_dim) for m in self._muon],
            "num_adamw_params": sum(len(g["params"]) for g in self.param_groups[1:]),
        }
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Waits for in-flight waves, checks the checkpoint fits, then loads (the inner AdamW keeps sharing the
        loaded state and groups).

        Raises:
            ValueError: the checkpoint's Muon param names, full shapes, partition dims or group sizes differ from
                this optimizer's, or a momentum buffer's shape differs from its param's. Nothing is changed then.
        """
        self.synchronize()
        errors = []
        meta = state_dict.get("overlap_muon")
        if meta is not None:
            mine = [(m.name, list(m.full_shape), m.partition_dim) for m in self._muon]
            theirs = [tuple(x) if not isinstance(x, tuple) else x for x in meta["muon_params"]]
            theirs = [(n, list(s), d) for n, s, d in theirs]
            if theirs != mine:
                diff = [f"{a} vs {b}" for a, b in zip(theirs, mine) if a != b][:3]
                errors.append(
                    f"checkpoint has {len(theirs)} Muon params, this optimizer {len(mine)}; first differences "
                    f"(checkpoint vs this): {diff or 'lengths differ'}"
                )
        groups = state_dict.get("param_groups", [])
        if len(groups) != len(self.param_groups):
            errors.append(f"checkpoint has {len(groups)} param groups, this optimizer {len(self.param_groups)}")
        else:
            for gi, (a, b) in enumerate(zip(groups, self.param_groups)):
                if len(a["params"]) != len(b["params"]):
                    errors.append(f"param group {gi} has {len(a['params'])} params in the checkpoint, {len(b['params'])} here")
        if not errors:
            ids = [i for g in groups for i in g["params"]]
            params = [p for g in self.param_groups for p in g["params"]]
            by_id = dict(zip(ids, params))
            for pid, st in state_dict.get("state", {}).items():
                p = by_id.get(pid)
                if p is None or not isinstance(st, dict):
                    continue
                for key, v in st.items():
                    # every per-element entry (momentum_buffer, exp_avg, exp_avg_sq, ...) has its param's shape
                    if isinstance(v, Tensor) and v.ndim > 0 and tuple(v.shape) != tuple(p.shape):
                        what = "momentum of Muon param" if key == "momentum_buffer" else f"{key} of AdamW param"
                        errors.append(
                            f"{what} {self._param_names.get(id(p), pid)!r} has shape {tuple(v.shape)} in the "
                            f"checkpoint, expected {tuple(p.shape)}"
                        )
        if errors:
            raise ValueError("OverlapMuon.load_state_dict: checkpoint does not fit; nothing loaded: " + "; ".join(errors))
        sd = {k: v for k, v in state_dict.items() if k != "overlap_muon"}
        super().load_state_dict(sd)
        self._link_adamw()

    def attach_ddp(self, ddp_model: nn.Module) -> None:
        """Take gradient readiness from a DDP comm hook instead of the per-param hooks.

        Under DDP a per-param hook would see the local, un-averaged gradient; the comm hook signals a bucket's
        params once its all-reduce has completed, so waves read DDP's averaged gradients. Requires
        ``DistributedDataParallel(..., gradient_as_bucket_view=True)`` (see ``hooks.ddp_readiness_hook``).
        Params DDP finds unused are launched by ``step()``. A no-op with ``overlap=False`` (``step()`` runs after
        DDP has averaged everything).

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

        def on_ready(indices: list[int]) -> None:
            for i in indices:
                self._on_ready(i)

        state, hook = ddp_readiness_hook(
            on_ready, {id(m.param): m.index for m in self._muon}, process_group=ddp_model.process_group
        )
        ddp_model.register_comm_hook(state, hook)

    def close(self) -> None:
        """Wait for everything, remove the hooks and stop the lane threads."""
        self.synchronize()
        if self._tracker is not None:
            self._tracker.remove()
        for h in self._wait_handles:
            h.remove()
        self._lanes.shutdown()

    @property
    def waves(self) -> list[Wave]:
        """The current wave plan (param indices into :attr:`muon_param_names`)."""
        return list(self._waves)

    @property
    def muon_param_names(self) -> list[str]:
        """Names of the Muon params, in registration order (the indices waves use)."""
        return [m.name for m in self._muon]

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self._lanes.shutdown()
        except Exception:
            pass
