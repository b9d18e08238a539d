"""Building an ``OverlapMuon``, top to bottom: sort the params, place the Muon matrices in their domain, check
everything on every rank, make the runtime's groups, plan the waves.

Every function here runs at construction; ``place``, ``make_groups`` and ``plan`` run again when the optimizer
re-binds params a framework replaced (``_binding.py``), and ``plan`` once more when the observed gradient-ready order
replaces the assumed one (``readiness_order="observed"``). Errors are raised on every rank before any collective of the
runtime ([Note: what is checked where] below); the only collectives are the checks' own (``_checks.py``) and the
group creation (``_comm.py``).

[Note: what is checked where] The mesh or groups are checked first: every per-param check would be meaningless
without a domain. Then each param's placement and shape (``_placement.py``), the expert layout, the options (the
ranks must agree on them), the ``split`` patterns, ``max_grad_norm``'s needs and the AdamW groups; all errors of a
rank are gathered and raised together, on every rank (``_checks.raise_everywhere``). The wave plan is compared across
ranks after it is made (``_checks.check_plan_everywhere``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._checks import differs_across_ranks, option_errors, raise_everywhere
from ._comm import CommContext, build_comm, node_spans, stage_group, stage_replicas
from .config import OverlapMuonConfig
from ._discovery import discover_expert_layouts, discover_layouts, discover_stages, mesh_dims, my_coords
from ._placement import MuonParam
from ._messages import warn_user
from ._muon_math import check_hyperparameters
from ._placement import place_params
from ._scheduler import plan_by_domain, plan_waves, plan_waves_by_cost
from ._scheduler.cost import ns_cost
from ._scheduler.kinds import WavePlan, plan_kinds
from ._ns_strategy import Strategies
from ._scheduler.surplus_cost import PROFILES, SurplusCostModel
from ._scheduler.waves import Wave
from ._sorting import adamw_param_groups, conv1d_weights, name_matches, sort_params, split_table

__all__ = ["Placement", "unwrap", "check_arguments", "place", "make_groups", "param_groups", "plan", "ns_costs"]

logger = logging.getLogger("overlap_muon")

try:
    from torch.distributed.tensor import DTensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

@dataclass
class Placement:
    """The params, sorted and placed (the first half of construction)."""

    muon: list[MuonParam]
    """The Muon matrices (a grouped expert weight is one per expert)."""
    adamw_groups: list[dict[str, Any]]
    """The AdamW param groups (``_sorting.adamw_param_groups``)."""
    layouts: list[list[list[int]]] | None
    """Every dense domain's ``layout[g][t] = global rank`` (``None``: one process or no domain)."""
    elayouts: list[list[list[int]]] | None
    """The same for the expert domains."""
    has_experts: bool
    """Some rank of the job has expert params (the expert groups are made on every rank)."""
    stages: list[list[int]] | None = None
    """Every pipeline stage's ranks ([Note: pipeline stages] in ``_discovery.py``; ``None``: one process)."""


def unwrap(model: nn.Module) -> tuple[nn.Module, nn.Module | None]:
    """``(the module whose params are optimized, the DDP wrapper or None)``; a ``torch.compile`` wrapper is looked
    through.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: its params are FSDP1's flat parameters (``FullyShardedDataParallel``): no matrix is left.
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, nn.Module):
        what = type(model).__name__
        raise TypeError(
            f"OverlapMuon expects the model (an nn.Module), got a {what}: pass the model, not its parameters, "
            "as OverlapMuon(model, lr=...); it sorts the params into Muon and AdamW by their modules and names"
            if what in ("generator", "list", "tuple", "dict") or isinstance(model, torch.Tensor) else
            f"OverlapMuon expects the model (an nn.Module), got a {what}")
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if any(isinstance(m, FSDP1) for m in model.modules()) or any(getattr(p, "_is_flat_param", False)
                                                                   for p in model.parameters()):
        raise ValueError(
            "OverlapMuon: the model's params are FSDP1 flat parameters (FullyShardedDataParallel, or Lightning's "
            "FSDPStrategy, flattens each wrapped module's weights into one 1-D FlatParameter), which hold no matrix "
            "Muon can orthogonalize; shard with FSDP2 instead: torch.distributed.fsdp.fully_shard on each block and "
            "the model, then OverlapMuon(model, device_mesh=mesh) (Lightning: ModelParallelStrategy)")
    ddp = model if isinstance(model, DistributedDataParallel) else None
    model = ddp.module if ddp is not None else model
    return (getattr(model, "_orig_mod", model) if type(model).__name__ == "OptimizedModule" else model), ddp


def check_arguments(hp: dict[str, Any], max_grad_norm: Any, muon_filter: Any) -> None:
    """The constructor's arguments: ``hp``, ``torch.optim.Muon``'s hyper-parameters (its checks and messages:
    ``_muon_math.check_hyperparameters``), then ours.

    Raises:
        ValueError: a hyper-parameter is out of range, or ``max_grad_norm`` is not a positive number or ``None``.
        TypeError: ``muon_filter`` is not callable.
    """
    check_hyperparameters(hp["lr"], hp["weight_decay"], hp["momentum"], hp["eps"], hp["adjust_lr_fn"],
                          hp["ns_coefficients"], hp["ns_steps"])
    if max_grad_norm is not None and not (isinstance(max_grad_norm, (int, float)) and max_grad_norm > 0):
        raise ValueError(f"max_grad_norm must be a positive number or None, got {max_grad_norm!r}")
    if muon_filter is not None and not callable(muon_filter):
        raise TypeError("muon_filter must be callable (name, param) -> bool")


def param_groups(muon: list[MuonParam], adamw_groups: list[dict[str, Any]], adamw_kwargs: dict[str, Any] | None,
                 hp: dict[str, Any], model: nn.Module) -> tuple[torch.optim.AdamW | None, list[dict[str, Any]]]:
    """The inner ``torch.optim.AdamW`` (``None`` without AdamW params) and the optimizer's param groups: one Muon
    group (``hp``, ``algorithm="muon"``; a grouped expert weight once), then AdamW's (``algorithm="adamw"``); each
    names its params (``param_names``, as ``torch.optim`` records them: checkpointers key the state by them)."""
    adamw = torch.optim.AdamW(adamw_groups, **(adamw_kwargs or {})) if adamw_groups else None
    muon_group = dict(params=group_params(muon, [])[0], algorithm="muon", **hp)
    groups = [muon_group] + [dict(g, algorithm="adamw") for g in (adamw.param_groups if adamw else ())]
    for g in groups:
        g["param_names"] = param_names(model, g["params"])
    return adamw, groups


#: Wrapper modules whose names are not part of a param's name (activation checkpointing, torch.compile, FSDP1).
_WRAPPERS = {"_checkpoint_wrapped_module", "_orig_mod", "_fsdp_wrapped_module"}


def param_names(model: nn.Module, params: list[Tensor]) -> list[str]:
    """The model's name of each of ``params``, without wrapper modules' names (the names ``torch.distributed.
    checkpoint.state_dict`` gives a model's params)."""
    names = {id(p): ".".join(s for s in n.split(".") if s not in _WRAPPERS) for n, p in model.named_parameters()}
    return [names[id(p)] for p in params]


def group_params(muon: list[MuonParam], adamw_groups: list[dict[str, Any]]) -> list[list[Tensor]]:
    """The params of each param group: the Muon group (a grouped expert weight once), then each AdamW group."""
    return [list({id(m.param): m.param for m in muon}.values())] + [list(g["params"]) for g in adamw_groups]


def place(model: nn.Module, config: OverlapMuonConfig, rank: int, *, muon_filter: Callable | None, experts: Any,
          split: Any, max_grad_norm: float | None, adamw_groups: Any, mesh: dict[str, Any]) -> Placement:
    """Sort the params into Muon and AdamW, place the Muon matrices in their domain, check everything on every rank
    ([Note: what is checked where]); rank 0 logs the split.

    ``mesh``: ``device_mesh``, ``remat_dim``, ``tp_dim``, ``tp_group``, ``remat_group``, ``expert_mesh``,
    ``ep_dim``, ``etp_dim``, ``etp_group``, ``pp_dim``, ``pp_group`` as the constructor got them.

    Raises:
        ValueError / TypeError: as ``OverlapMuon`` documents, on every rank.
    """
    multi = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    muon_named, adamw_named, expert_ids, errors = sort_params(model, muon_filter, experts)
    m = dict(mesh, device_mesh=_params_mesh(muon_named, expert_ids, mesh))
    layouts, mesh_err = discover_layouts(m["device_mesh"], m["tp_group"], m["remat_group"], m["remat_dim"], m["tp_dim"])
    elayouts, emesh_err = discover_expert_layouts(m["expert_mesh"], m["etp_group"], m["ep_dim"], m["etp_dim"])
    stages = discover_stages(m["device_mesh"], m["pp_dim"], m["pp_group"])
    raise_everywhere([e for e in (mesh_err, emesh_err, _missing_mesh(muon_named, expert_ids, m)) if e])
    R, T, g, t = my_coords(layouts, rank)
    _, ET, _, et = my_coords(elayouts, rank)
    dims = mesh_dims(m["device_mesh"], m["remat_dim"], m["tp_dim"])[0] if m["device_mesh"] is not None else None
    muon, described = place_params(muon_named, expert_ids, conv1d_weights(model), split,
                                   (m["device_mesh"], dims, R, T, g, t),
                                   (m["expert_mesh"], m["ep_dim"], m["etp_dim"], ET, et))
    expert_layout = m["expert_mesh"] is not None or m["etp_group"] is not None
    _warn_layout(rank, multi, experts, adamw_named, muon_named, expert_ids, expert_layout, layouts)
    stage_errors, experts_anywhere = _layout_errors(muon_named, expert_ids, expert_layout, len(adamw_named), stages)
    errors += described + stage_errors
    errors += option_errors(config)
    errors += _split_errors(split, muon)
    if max_grad_norm is not None and (R * T > 1 or multi and expert_ids) and any(
            not isinstance(x.param, DTensor) for x in muon):
        errors.append("max_grad_norm needs DTensor params on a multi-rank domain (a plain shard's norm cannot "
                      "be reduced without knowing which peers hold copies); clip the gradients yourself")
    all_named = dict(model.named_parameters(remove_duplicate=False))
    try:
        groups = adamw_param_groups(adamw_named, adamw_groups, {n for n, _ in muon_named}, all_named)
    except ValueError as e:
        errors.append(str(e))
        groups = []
    raise_everywhere(errors)
    if rank == (stages[_stage_index(stages, rank)][0] if stages else 0):  # each stage's first rank
        _log_split(muon, groups, all_named)
    return Placement(muon, groups, layouts, elayouts, experts_anywhere, stages)


def _stage_index(stages: list[list[int]], rank: int) -> int:
    return next(i for i, s in enumerate(stages) if rank in s)


def _params_mesh(muon_named: list[tuple[str, Tensor]], expert_ids: set[int], m: dict[str, Any]) -> Any:
    """The ``device_mesh`` given; without one (and without groups), the one mesh every dense Muon DTensor lives on, as
    ``fully_shard`` or a TP plan left them (``None`` when they live on several: :func:`_missing_mesh` says so)."""
    if any(m[k] is not None for k in ("device_mesh", "tp_group", "remat_group")):
        return m["device_mesh"]
    meshes: list[Any] = []
    for _, p in muon_named:
        if isinstance(p, DTensor) and id(p) not in expert_ids and not any(p.device_mesh == x for x in meshes):
            meshes.append(p.device_mesh)
    return meshes[0] if len(meshes) == 1 else None


def _missing_mesh(muon_named: list[tuple[str, Tensor]], expert_ids: set[int], m: dict[str, Any]) -> str | None:
    """One error (not one per param) when the dense Muon params are DTensors, no ``device_mesh`` was given and none
    can be taken from them (:func:`_params_mesh`)."""
    dts = [(n, p) for n, p in muon_named if isinstance(p, DTensor) and id(p) not in expert_ids]
    if m["device_mesh"] is not None or not dts:
        return None
    n, p = dts[0]
    names = tuple(p.device_mesh.mesh_dim_names or ())
    why = "explicit groups were given" if m["tp_group"] is not None or m["remat_group"] is not None else \
        "they live on several meshes"
    return (f"{len(dts)} Muon params are DTensors (e.g. {n!r} on mesh dims {names or p.device_mesh.shape}) but no "
            f"device_mesh was given and {why}: pass the mesh of the dense weights and name its FSDP and TP dims, "
            f"e.g. OverlapMuon(model, device_mesh=model.get_parameter({n!r}).device_mesh, remat_dim=..., tp_dim=...)")


def _warn_layout(rank: int, multi: bool, experts: Any, adamw_named: list, muon_named: list, expert_ids: set[int],
                 expert_layout: bool, layouts: Any) -> None:
    """Rank 0's warnings about layouts that work but are likely not what the user meant."""
    if rank != 0:
        return
    left = [n for n, p in adamw_named if p.ndim == 3]
    if experts is not None and left:
        warn_user(f"OverlapMuon: experts= is given but the 3-D params {left[:8]} are not selected; they go to "
                  "AdamW. Widen the pattern if they are grouped expert weights.")
    elif left:  # the most common silent miss of a distributed Muon: MoE weights trained by AdamW
        warn_user(f"OverlapMuon: the 3-D params {left[:8]} go to AdamW; if they are grouped expert weights "
                  f"(E, P, Q), give them Muon with experts={_expert_pattern(left)!r}.")
    if multi and any(getattr(p, "partition_dim", None) is not None and not isinstance(p, DTensor)
                     and not (expert_layout if id(p) in expert_ids else layouts) for _, p in muon_named):
        warn_user(
            "OverlapMuon: some plain Muon params carry a partition_dim but their domain has no TP/ETP group "
            "(no tp_group/device_mesh, or no etp_group/expert_mesh for experts): each rank orthogonalizes its "
            "tensor as a whole matrix. If they are shards of larger matrices, pass the group.")


def _expert_pattern(names: list[str]) -> str | list[str]:
    """An ``experts=`` pattern for ``names``: their parents, layer indices as ``*``, each followed by ``.*``."""
    parents = sorted({".".join("*" if s.isdigit() else s for s in n.split(".")[:-1]) for n in names})
    pats = [f"{p}.*" if p else "*" for p in parents]
    return pats[0] if len(pats) == 1 else pats


def _split_errors(split: Any, muon: list[MuonParam]) -> list[str]:
    if not isinstance(split, dict):
        return []
    unused = [k for k in split if not any(name_matches(m.name, k) for m in muon)]
    return [f"split patterns {unused} match no Muon param (Muon params: {[m.name for m in muon][:8]}"
            f"{' ...' if len(muon) > 8 else ''})"] if unused else []


def _layout_errors(muon_named: list[tuple[str, Tensor]], expert_ids: set[int], expert_layout: bool,
                   n_adamw: int, stages: list[list[int]] | None) -> tuple[list[str], bool]:
    """Collective: an expert layout given with no expert param selected, expert counts that differ by rank of a
    stage (which would otherwise surface as a plan mismatch naming an unrelated param), or AdamW param counts that
    differ by rank of a stage (the step's agreement carries one flag per AdamW param: [Note: lazy state] in
    ``_state.py``). Also returns whether any rank of the job has expert params (every rank makes the expert groups
    then: group creation is collective over the job)."""
    errors = (["expert_mesh/etp_group given but experts= selects no Muon param"]
              if expert_layout and not expert_ids else [])
    held = [(n, int(p.shape[0]) if p.ndim == 3 else 1) for n, p in muon_named if id(p) in expert_ids]
    everyone = differs_across_ranks((held, n_adamw))  # on every rank, whatever it holds
    if everyone is None:  # every rank the same (or one process)
        return errors, bool(expert_ids)
    experts_anywhere = any(h[0] for h in everyone)
    for stage in stages or [list(range(len(everyone)))]:
        per_rank = [everyone[r] for r in stage]
        label = f" of pipeline stage {stages.index(stage)}" if stages and len(stages) > 1 else ""
        if any(h[1] != per_rank[0][1] for h in per_rank):
            errors.append(f"the ranks{label} hold different numbers of AdamW params "
                          f"({[h[1] for h in per_rank]} by rank {stage}); every rank must build the same model"
                          + (" (under pipeline parallelism: every rank of a stage; pass pp_group=, or a device_mesh "
                             "with a 'pp' dim, so that each stage is checked on its own)" if not label else ""))
        if any(h[0] != per_rank[0][0] for h in per_rank):
            errors.append(f"the ranks{label} hold different expert params (name, experts held) -- "
                          f"{'; '.join(f'rank {r}: {h[0]}' for r, h in zip(stage, per_rank))[:600]}; every EP rank "
                          "must hold the same expert params with the same number of experts")
    return errors, experts_anywhere


def _log_split(muon: list[MuonParam], adamw_groups: list[dict[str, Any]], named: dict[str, Tensor]) -> None:
    """Rank 0, at construction: which params went to Muon and which to AdamW (a table, then one summary line)."""
    names: dict[int, str] = {}
    for n, p in named.items():  # a tied param: its first name, then "= alias"
        names[id(p)] = f"{names[id(p)]} = {n}" if id(p) in names else n
    mu = [(m.name, m.full_shape, m.transposed) for m in muon]
    aw = [(names.get(id(p), "?"), tuple(p.shape), gi) for gi, grp in enumerate(adamw_groups) for p in grp["params"]]
    nb = (sum(m.full_shape[0] * m.full_shape[1] * m.param.element_size() for m in muon),
          sum(p.numel() * p.element_size() for grp in adamw_groups for p in grp["params"]))
    table, summary = split_table(mu, aw, nb)
    if logger.isEnabledFor(logging.INFO):
        logger.info("%s", table)
        logger.info("%s", summary)
    elif not _SPLIT_SHOWN:  # logging is not set up: one line, once per process, says where the table is
        _SPLIT_SHOWN.append(True)
        logger.warning("%s (the table of which param went where: logging.getLogger('overlap_muon').setLevel("
                       "logging.INFO) before building the optimizer)", summary)


_SPLIT_SHOWN: list[bool] = []  # the one-line split summary was shown in this process


def make_groups(p: Placement, config: OverlapMuonConfig, rank: int) -> CommContext:
    """Every process group of the runtime (``_comm.build_comm``; collective over the default group)."""
    distributed = p.layouts is not None and dist.get_world_size() > 1
    dp_on = (distributed and config.dp_slots and config.mode == "layer_sharded"
             and any(len(part) > 1 for part in stage_replicas(p.layouts, p.stages)))
    if dp_on and config.surplus != "idle":
        warn_user(f"OverlapMuon: surplus={config.surplus!r} is not combined with DP slots yet; the waves "
                      "run as surplus='idle' (the replicas still share the NS work)")
    return build_comm(p.layouts, p.elayouts, rank, timeout_s=config.pg_timeout_s, dp_slots=dp_on,
                      team=not dp_on and (config.surplus in ("team", "auto") or config.mode == "gram"
                                          or config.mode == "auto" and config.allow_inexact),
                      experts=p.has_experts, stages=p.stages,
                      node_size=node_size(p.layouts if distributed else None, config))


def node_size(layouts: list[list[list[int]]] | None, config: OverlapMuonConfig) -> int | None:
    """The global ranks per node for the dense domain's two-hop exchanges (``config.node_exchange``; [Note:
    node-aware exchange] in ``_domain.py``), or ``None`` for flat ones: ``"off"``, no fused layer-sharded
    exchanges, no node size (``node_size`` or ``LOCAL_WORLD_SIZE``), node sizes that differ across ranks (nodes of
    different sizes: said once), or domains that do not all span nodes the same way with at least 2 ranks on each
    (which ``"on"`` says): every replica must plan the same homes, and with one rank per node the second hop is the
    flat exchange. The simulator finds two hops faster wherever the domain spans nodes (docs/results.md, "Nodes at
    scale"), so ``"auto"`` takes them there too. Collective over the default group (the ranks compare their node
    sizes: each reads its own ``LOCAL_WORLD_SIZE``)."""
    if layouts is None or config.node_exchange == "off" or not config.fused_a2a or config.mode != "layer_sharded":
        return None
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    size = config.node_size or (int(local) if local.isdigit() and int(local) > 0 else None)
    first = dist.get_rank() == 0
    sizes = differs_across_ranks(size)
    if sizes is not None:  # every rank sees the same list, so every rank returns flat
        if first:
            warn_user(f"OverlapMuon: the ranks' node sizes differ ({sorted(set(map(str, sizes)))}: LOCAL_WORLD_SIZE "
                      "or node_size=); nodes of different sizes cannot run the two-hop exchange, so it runs flat")
        return None
    spans = {node_spans([r for row in lay for r in row], size) for lay in layouts} if size else {None}
    ok = len(spans) == 1 and None not in spans and next(iter(spans))[0] > 1
    if config.node_exchange == "on" and not ok and first:
        where = "no node size is known (pass node_size= or set LOCAL_WORLD_SIZE)" if not size else (
            f"with {size} ranks per node the domains do not all lie on several nodes with the same number, at least "
            f"2, of their ranks on each node")
        warn_user(f"OverlapMuon: node_exchange='on', but {where}; the exchanges run flat")
    return size if ok else None


def qk_clipper(spec: Any, model: nn.Module, p: Placement, comm: CommContext, rank: int,
               config: OverlapMuonConfig) -> Any:
    """The :class:`~overlap_muon.qk_clip.QKClipper` of ``spec`` (``None`` without one), its errors raised on every
    rank. Its max runs over this rank's pipeline stage: the step's agreement group, or (plain data parallelism,
    which has none) a gloo group over the stage made here (collective over the default group)."""
    if spec is None:
        return None
    from .qk_clip import QKClip, QKClipper

    group = comm.ctrl
    if group is None and p.stages is not None:
        group = stage_group(p.stages, rank, config.pg_timeout_s)
    try:
        if not isinstance(spec, QKClip):
            raise TypeError(f"qk_clip must be an overlap_muon.QKClip, got {type(spec).__name__}")
        clipper, errors = QKClipper(spec, model, p.muon, comm.dom_to, group), []
    except (ValueError, TypeError) as e:
        clipper, errors = None, [str(e)]
    raise_everywhere(errors)
    return clipper


def ns_costs(muon: list[MuonParam], ns_steps: int, gram: bool = False) -> list[float]:
    """NS FLOPs of each Muon matrix (a split one: the sum of its parts'; Gram NS where ``gram`` picks it), the
    planner's cost."""
    return [float(sum(ns_cost((len(r), m.ns_shape[1]), ns_steps, gram) for r in m.parts) if m.parts
                  else ns_cost(m.ns_shape, ns_steps, gram)) for m in muon]


def plan(order: list[int], muon: list[MuonParam], costs: list[float], config: OverlapMuonConfig,
         sizes: tuple[int, int], dp_size: int, cuda: bool, per_node: int | None = None,
         strategies: Strategies | None = None) -> tuple[list[Wave], list[WavePlan]]:
    """The waves (in launch order) and their frozen plans.

    Args:
        order: Muon indices in gradient-ready order.
        sizes: ``(dense, expert)`` domain sizes.
        dp_size: replicas sharing the dense domain's NS work (1: none).
        cuda: the lanes run on CUDA streams (``cost_model="auto"`` then weighs H200-class figures, else
            ``CPU_GLOO``'s).
        per_node: the dense domain's ranks per node where its exchanges run in two hops: its homes then know
            nodes ([Note: homes that know nodes] in ``scheduler/homes.py``; not with DP slots, whose homes
            interleave replicas).
        strategies: each param's NS strategy (``_ns_strategy.ns_strategies``; ``None``: every param at its home).
    """
    cfg = config

    def one(sub_order: list[int], members: list[int], d: int) -> list[Wave]:
        size = sizes[1] if d else sizes[0] * dp_size
        cs = [costs[i] for i in members]
        nodes = per_node if d == 0 and dp_size == 1 else None
        if cfg.overlap and cfg.wave_slots is None and cfg.wave_plan == "cost":
            return plan_waves_by_cost(sub_order, cs, [muon[i].full_shape for i in members], size, balance=cfg.balance,
                                      node_size=nodes)
        slots = cfg.wave_slots or (size if cfg.overlap else len(members))
        return plan_waves(sub_order, cs, size, wave_slots=slots, balance=cfg.balance, taper=cfg.overlap,
                          node_size=nodes)

    waves = plan_by_domain(order, [m.domain for m in muon], one)
    plans = plan_kinds(waves, [m.full_shape for m in muon], list(sizes), mode=cfg.mode, surplus=cfg.surplus,
                       fused=cfg.fused_a2a, dp_size=dp_size, cost_model=cost_model(cfg.cost_model, cuda),
                       no_team={m.index for m in muon if m.transposed or m.parts is not None},  # NS'd whole instead
                       gram_ok=strategies.gram if strategies else None,
                       duplicated=strategies.duplicated if strategies else frozenset())
    return waves, plans


def cost_model(name: str, cuda: bool) -> SurplusCostModel:
    """The machine figures of ``OverlapMuonConfig.cost_model`` (``auto``: by where the lanes run)."""
    name = {"cuda": "h200", "auto": "h200" if cuda else "cpu_gloo"}.get(name, name)
    return PROFILES[name]

