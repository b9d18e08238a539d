"""Discovery: a ``DeviceMesh`` or explicit groups -> the layouts ``layout[g][t] = global rank`` of every domain.

The dense ``remat x TP`` domains (:func:`mesh_dims`, :func:`discover_layouts`), the expert domains
(:func:`discover_expert_layouts`, with [Note: two domains]), the pipeline stages (:func:`discover_stages`) and this
rank's coordinates in its domain (:func:`my_coords`). How each param lies in its domain is ``_placement.py``'s.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["mesh_dims", "discover_layouts", "my_coords", "discover_expert_layouts", "REMAT_NAMES"]

#: What frameworks name the dim FSDP shards the params over: torchtitan (``fsdp``, ``dp_shard`` by version), Lightning
#: (``data_parallel``).
REMAT_NAMES = ("fsdp", "dp_shard", "data_parallel")


def mesh_dims(mesh: Any, remat_dim: str | None = "remat", tp_dim: str | None = "tp") -> tuple[
    tuple[str | None, str | None], str | None
]:
    """Which dims of ``mesh`` are the domain's remat and TP dims: ``((remat_name, tp_name), error)``.

    A name is ``None`` when the domain has no such dim (size 1). Every other dim of the mesh is a *replicate* dim
    (e.g. ``dp_replicate`` of an HSDP mesh): it is not part of the domain, each of its indices holds its own domain
    (:func:`discover_layouts`), and the Muon params must be ``Replicate`` on it.

    * 1-D mesh: its dim is TP when named ``tp_dim`` (left at ``"tp"``: also when named ``"tensor_parallel"``), remat
      otherwise (also when unnamed).
    * n-D mesh: ``remat_dim`` and ``tp_dim`` must be dim names of the mesh (``None`` leaves that dim out), e.g.
      torchtitan's ``("dp_shard", "tp")`` with ``remat_dim="dp_shard"``. Left at their defaults (``"remat"``,
      ``"tp"``) on a mesh without those names, they take the names the frameworks give these dims: remat the first
      of :data:`REMAT_NAMES` the mesh has, TP ``"tensor_parallel"`` (Lightning's). A wrong guess cannot pass
      unnoticed: every Muon param's placements are then checked against the dims taken.

    Returns:
        ``error`` is a message naming the mesh's dims and the expectation (or ``None``).
    """
    names = tuple(mesh.mesh_dim_names or ())
    if tp_dim == "tp" and "tp" not in names and "tensor_parallel" in names:
        tp_dim = "tensor_parallel"
    if mesh.ndim == 1:
        return ((None, names[0]) if names and names[0] == tp_dim else (names[0] if names else None, None)), None
    if not names:
        return (None, None), (f"a {mesh.ndim}-D device_mesh needs dim names (init_device_mesh(..., mesh_dim_names=...)) "
                              "to tell its remat and TP dims apart")
    if remat_dim == "remat" and "remat" not in names:
        remat_dim = next((d for d in REMAT_NAMES if d in names), remat_dim)
    if remat_dim is not None and remat_dim == tp_dim:
        return (None, None), f"remat_dim and tp_dim are both {remat_dim!r}; they must be different dims"
    missing = [(arg, v) for arg, v in (("remat_dim", remat_dim), ("tp_dim", tp_dim)) if v is not None and v not in names]
    if missing:
        said = ", ".join(f"{arg}={v!r}" for arg, v in missing)
        return (None, None), (
            f"device_mesh has dims {names}, which do not include {said}: pass OverlapMuon(..., remat_dim=<the dim "
            "FSDP shards the params over>, tp_dim=<the tensor-parallel dim>) naming dims of this mesh (e.g. "
            "remat_dim='dp_shard' for torchtitan), or None for a dim the domain does not have"
        )
    return (remat_dim, tp_dim), None


def discover_layouts(
    mesh: Any, tp_group: ProcessGroup | None, remat_group: ProcessGroup | None,
    remat_dim: str | None = "remat", tp_dim: str | None = "tp",
) -> tuple[list[list[list[int]]] | None, str | None]:
    """The layouts ``layout[g][t] = global rank`` of every domain of the job, identical on every rank.

    From a ``DeviceMesh`` (the remat and TP dims named by ``remat_dim`` / ``tp_dim``, see :func:`mesh_dims`; the
    other dims are replicate dims, each index of them a domain of its own) or from explicit groups
    (``remat_group`` x ``tp_group``). Collective over the default group (``all_gather_object``) when distributed.

    Returns:
        ``(layouts, error)``: ``layouts`` is ``None`` for one process without groups; ``error`` is a message
        (the caller raises it on every rank) or ``None``.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if mesh is not None:
        if tp_group is not None or remat_group is not None:
            return None, "pass either device_mesh or tp_group/remat_group, not both"
        (rname, tname), err = mesh_dims(mesh, remat_dim, tp_dim)
        if err is not None:
            return None, err
        grid = mesh.mesh
        if mesh.ndim == 1:
            layout = [grid.tolist()] if tname is not None else [[r] for r in grid.tolist()]
            return _gather_layouts(layout), None
        names = tuple(mesh.mesh_dim_names)
        coord = mesh.get_coordinate()
        if coord is None:
            return None, f"this rank ({dist.get_rank()}) is not in the device_mesh {grid.tolist()}"
        # Fix every replicate dim at this rank's index, then order the remaining dims (remat, tp).
        index = [slice(None) if n in (rname, tname) else c for n, c in zip(names, coord)]
        sub = grid[tuple(index)]
        kept = [n for n in names if n in (rname, tname)]
        if rname is None:
            sub, kept = sub.unsqueeze(0), [None] + kept
        if tname is None:
            sub, kept = sub.unsqueeze(-1), kept + [None]
        if kept[0] != rname:
            sub = sub.transpose(0, 1)
        return _gather_layouts(sub.tolist()), None
    if not initialized or (tp_group is None and remat_group is None):
        return None, None
    me, world = dist.get_rank(), dist.get_world_size()
    tp_ranks = dist.get_process_group_ranks(tp_group) if tp_group is not None else [me]
    remat_ranks = dist.get_process_group_ranks(remat_group) if remat_group is not None else [me]
    info: list[Any] = [None] * world
    dist.all_gather_object(info, (sorted(remat_ranks), sorted(tp_ranks)))
    layout = [info[r][1] for r in sorted(remat_ranks)]
    return _gather_layouts(layout), None


def discover_stages(mesh: Any, pp_dim: str | None, pp_group: ProcessGroup | None) -> list[list[int]] | None:
    """[Note: pipeline stages] Under pipeline parallelism every rank builds its optimizer on its own stage: the
    ranks of one stage (its domains and their data-parallel replicas) hold the same params, the ranks of another
    stage hold others. A stage is named by this rank's index on the mesh's ``pp_dim`` (a dim outside every domain,
    like ``dp_replicate``; the params live on the sub-mesh without it), or by its rank in ``pp_group`` (explicit
    groups: the ranks that hold the other stages of this rank's pipeline); without either, the job is one stage.
    The construction checks compare the ranks of a stage, and ``step()``'s agreement runs within it. Collective
    over the default group (``all_gather_object``) when distributed.

    Returns:
        Every stage's global ranks (sorted, ordered by stage index, identical on every rank), or ``None`` for one
        process.
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    key = 0
    if mesh is not None and pp_dim is not None and pp_dim in tuple(mesh.mesh_dim_names or ()):
        key = mesh.get_local_rank(pp_dim)
    elif pp_group is not None:
        key = dist.get_group_rank(pp_group, dist.get_rank())
    keys: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(keys, key)
    return [[r for r, k in enumerate(keys) if k == s] for s in sorted(set(keys))]


def _gather_layouts(layout: list[list[int]]) -> list[list[list[int]]]:
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [layout]
    allp: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(allp, layout)
    uniq: dict[str, list[list[int]]] = {}
    for lay in allp:
        uniq.setdefault(repr(lay), lay)
    return sorted(uniq.values(), key=lambda lay: lay[0][0])


def my_coords(layouts: list[list[list[int]]] | None, rank: int) -> tuple[int, int, int, int]:
    """``(R, T, g, t)`` of ``rank`` in its domain (``(1, 1, 0, 0)`` without layouts)."""
    for lay in layouts or ():
        for g, row in enumerate(lay):
            if rank in row:
                return len(lay), len(row), g, row.index(rank)
    return 1, 1, 0, 0


def discover_expert_layouts(
    mesh: Any, etp_group: ProcessGroup | None, ep_dim: str = "ep", etp_dim: str = "etp"
) -> tuple[list[list[list[int]]] | None, str | None]:
    """The layouts of every expert domain (``1 x ETP`` grids of global ranks), identical on every rank.

    [Note: two domains] Expert weights are sharded over expert parallelism (EP: which experts a rank holds) and
    expert tensor parallelism (ETP: how each expert matrix is split), a layout unrelated to the dense
    ``remat x TP`` one. An expert matrix is shared only by the ETP ranks holding it, so its weight-shard domain is
    the ETP group; every EP index holds a domain of its own with its own experts (as a replicate dim holds its own
    copy of the dense domain). Without ETP (no ``etp_dim`` in the mesh, no ``etp_group``) each rank's experts are
    its own: a ``1 x 1`` domain per rank, NS runs where the matrix lives, nothing is exchanged. Both domains' waves
    are cut from one readiness order into one wave list that every rank launches in the same order
    (``_builder.plan``, ``_scheduler.plan_by_domain``), and each lane runs its tasks in that order, so every rank
    posts the collectives of both domains in one global order: the dense groups span the expert ones, and a rank
    can only wait for a peer that is waiting for an earlier collective of the same order, never for a later one (no
    cycle, no hang). A rank whose experts have no gradient in a step still runs the (empty) waves' presence agreement
    within its ETP group and skips their exchanges, as its ETP peers do.

    Args:
        mesh: a ``DeviceMesh`` with an ``ep_dim`` and/or an ``etp_dim`` (other dims are replicate dims).
        etp_group: for plain-tensor expert params, this rank's ETP group (not with ``mesh``).

    Returns:
        ``(layouts, error)``; ``layouts`` is ``None`` for one process.
    """
    initialized = dist.is_available() and dist.is_initialized()
    if mesh is not None:
        if etp_group is not None:
            return None, "pass either expert_mesh or etp_group, not both"
        names = tuple(mesh.mesh_dim_names or ())
        if ep_dim not in names and etp_dim not in names:
            return None, (f"expert_mesh has dims {names}, which include neither ep_dim={ep_dim!r} nor "
                          f"etp_dim={etp_dim!r}; name its expert-parallel and expert-TP dims (OverlapMuon(..., "
                          "ep_dim=..., etp_dim=...))")
        if etp_dim in names:
            return discover_layouts(mesh, None, None, remat_dim=None, tp_dim=etp_dim)
    elif etp_group is not None:
        return discover_layouts(None, etp_group, None)
    if not initialized or dist.get_world_size() == 1:
        return None, None
    return [[[r]] for r in range(dist.get_world_size())], None
