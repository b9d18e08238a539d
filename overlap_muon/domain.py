"""The weight-shard domain ``GTP = GTP_remat x TP`` and the runtime's own process groups over it.

A rank of the domain has coordinates ``(g, t)`` (``g`` in ``[0, R)``, ``t`` in ``[0, T)``) and flat index
``g*T + t`` (TP innermost). The runtime never communicates on the model's process groups: it builds its own
(``remat_group``: the R ranks sharing ``t``; ``tp_group``: the T ranks sharing ``g``; ``flat_group``: all R*T
ranks), so its exchanges cannot interleave with FSDP/DDP/TP collectives (docs/design.md §3).

Group ranks follow global-rank order (``torch.distributed.new_group`` sorts), so the builders require the
standard layout in which global ranks increase with ``g*T + t`` inside a domain; then the group rank is ``g`` in
``remat_group``, ``t`` in ``tp_group`` and ``g*T + t`` in ``flat_group``.

Discovery, a ``DeviceMesh`` or explicit groups -> the layouts of every domain (:func:`discover_layouts`,
:func:`discover_expert_layouts`, :func:`mesh_dims`, :func:`my_coords`), is in ``overlap_muon/discovery.py`` and
re-exported here; this module keeps the layout rule (:func:`block`), :class:`Domain`, and the placement of each
param in its domain (:func:`describe_param`, :func:`describe_expert_param`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor
from torch.distributed import ProcessGroup

from .discovery import discover_expert_layouts, discover_layouts, expert_placements, mesh_dims, my_coords
from .layout import chunk_sizes

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

__all__ = [
    "Domain", "MuonParam", "chunk_sizes", "chunk_offsets", "block", "block_shape", "local_tensor", "discover_layouts",
    "describe_param", "mesh_dims", "discover_expert_layouts", "describe_expert_param", "my_coords",
]


def chunk_offsets(n: int, parts: int) -> list[int]:
    """Start offsets of the blocks of :func:`chunk_sizes` (``parts + 1`` entries, the last is ``n``)."""
    offs = [0]
    for s in chunk_sizes(n, parts):
        offs.append(offs[-1] + s)
    return offs


def block(
    full_shape: tuple[int, int], partition_dim: int | None, R: int, T: int, g: int, t: int
) -> tuple[int, int, int, int]:
    """``(row0, rows, col0, cols)`` of rank ``(g, t)``'s block of a full ``(P, Q)`` matrix: THE layout rule.

    docs/design.md §2 (``torch.chunk`` splits, blocks may be uneven or empty), which is what FSDP2
    ``fully_shard`` over the remat dim plus DTensor TP produce:

    * ``partition_dim=0``: TP splits the rows into T blocks, remat splits TP block ``t``'s rows into R; rank
      ``(g, t)`` holds row block ``t*R + g`` (FSDP2's ``_StridedShard(0)`` order), all columns;
    * ``partition_dim=1``: remat splits the rows into R, TP the columns into T; rank ``(g, t)`` holds block
      ``(g, t)``;
    * ``partition_dim=None``: remat splits the rows into R; TP peers hold copies of row block ``g``.

    Every module that needs a block (the optimizer's param checks, the routing, the benchmarks) calls this.
    """
    P, Q = full_shape
    if partition_dim == 0:
        tp_rows, tp_off = chunk_sizes(P, T)[t], chunk_offsets(P, T)[t]
        return tp_off + chunk_offsets(tp_rows, R)[g], chunk_sizes(tp_rows, R)[g], 0, Q
    if partition_dim == 1:
        return chunk_offsets(P, R)[g], chunk_sizes(P, R)[g], chunk_offsets(Q, T)[t], chunk_sizes(Q, T)[t]
    return chunk_offsets(P, R)[g], chunk_sizes(P, R)[g], 0, Q


def block_shape(
    full_shape: tuple[int, int], partition_dim: int | None, R: int, T: int, g: int, t: int
) -> tuple[int, int]:
    """``(rows, cols)`` of rank ``(g, t)``'s block (:func:`block`)."""
    _, rows, _, cols = block(full_shape, partition_dim, R, T, g, t)
    return rows, cols


@dataclass(frozen=True)
class Domain:
    """This rank's place in the ``R x T`` weight-shard domain and the runtime's own groups over it.

    ``remat_group`` / ``tp_group`` / ``flat_group`` are ``None`` when the corresponding size is 1 (no
    communication: one code path for world size 1). Built by ``overlap_muon.comm``.
    """

    remat_size: int  #: R, the GTP_remat size
    tp_size: int  #: T, the tensor-parallel size
    remat_rank: int  #: g in [0, R)
    tp_rank: int  #: t in [0, T)
    remat_group: ProcessGroup | None = None  #: own group of the R ranks sharing t; group rank == g
    tp_group: ProcessGroup | None = None  #: own group of the T ranks sharing g; group rank == t
    flat_group: ProcessGroup | None = None  #: own group of all R*T ranks; group rank == g*T + t
    ctrl_group: ProcessGroup | None = None  #: gloo group of all R*T ranks, for host-side flags (never the device)

    @property
    def size(self) -> int:
        """R * T, the number of NS homes."""
        return self.remat_size * self.tp_size

    @property
    def flat_rank(self) -> int:
        """g*T + t."""
        return self.remat_rank * self.tp_size + self.tp_rank


    @staticmethod
    def single() -> "Domain":
        """The 1 x 1 domain of a single process (no groups)."""
        return Domain(remat_size=1, tp_size=1, remat_rank=0, tp_rank=0)


# ----------------------------------------------------------------------------------------------------------------
# Placement: a param -> its place in the domain (the layouts of the domains: ``overlap_muon/discovery.py``).
# ----------------------------------------------------------------------------------------------------------------


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (sharing storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass
class MuonParam:
    """One Muon matrix as the runtime sees it."""

    index: int  #: position among the Muon params (the index waves use)
    name: str  #: the model's name for it
    param: Tensor  #: nn.Parameter, DTensor or plain; its local shard is ``local_tensor(param)``
    full_shape: tuple[int, int]  #: (P, Q), the full shape as stored: the layout and the routing use it
    partition_dim: int | None  #: TP split: 0, 1 or None (docs/design.md §2)
    replicated: bool = False
    """The whole ``(P, Q)`` matrix on every rank of the domain (a plain param with no ``partition_dim``, or a
    DTensor replicated over both mesh dims): its NS runs locally on every rank, no exchange ([Note: replicated
    params])."""
    parts: list[list[int]] | None = None  #: row sets orthogonalized as separate matrices (``overlap_muon.split``)
    runs: tuple = ()  #: ``(start, stop, matrix shape, region)`` runs of local rows (``overlap_muon.split.apply_runs``)
    transposed: bool = False
    """The weight is stored ``(in, out)`` (Hugging Face ``Conv1D``): NS and the lr ratio see its transpose
    (:attr:`ns_shape`), the ``(out, in)`` linear it is ([Note: transposed weights] in ``overlap_muon.pipeline``)."""
    expert: int | None = None
    """For a grouped expert weight (a 3-D ``(E, P, Q)`` param): which of this rank's ``E_local`` matrices this is;
    its shard is ``local_tensor(param)[expert]`` (:meth:`local`). ``None`` for a 2-D param."""
    domain: int = 0
    """Which domain routes it: 0 the dense ``remat x TP`` domain, 1 the expert domain ([Note: two domains])."""
    split_factor: int = 1
    """An expert weight sharded ``_StridedShard(1, split_factor)`` over ETP (Hugging Face's fused ``[gate; up]``):
    its local rows are pieces of the matrix, put in place by ``overlap_muon.split.strided_parts``."""

    def local(self, t: Tensor) -> Tensor:
        """This matrix's block of ``t`` (the param, its gradient or its momentum buffer): the local shard, and of a
        grouped expert weight the ``expert``-th matrix of it (a view)."""
        loc = local_tensor(t)
        return loc if self.expert is None else loc[self.expert]

    @property
    def ns_shape(self) -> tuple[int, int]:
        """The ``(out, in)`` shape NS and the lr ratio see: :attr:`full_shape`, reversed when :attr:`transposed`."""
        P, Q = self.full_shape
        return (Q, P) if self.transposed else (P, Q)


def _is_strided_or_shard0(p: Any) -> bool:
    if isinstance(p, _StridedShard):
        return p.dim == 0
    return isinstance(p, Shard) and p.dim == 0


def describe_param(
    index: int, name: str, p: Tensor, mesh: Any, R: int, T: int, g: int, t: int,
    dims: tuple[str | None, str | None] | None = None,
) -> tuple[MuonParam | None, str | None]:
    """Place one Muon param in the ``R x T`` domain: its full shape and TP ``partition_dim``, checked.

    A DTensor's placements give both (FSDP2 ``Shard(0)``/``_StridedShard(0)`` on the remat dim;
    ``Shard(0)``/``Shard(1)``/``Replicate`` on ``tp``); a plain tensor carries ``partition_dim`` (and optionally
    ``full_shape``; even splits otherwise). The local shape must be exactly this rank's :func:`block`.
    ``dims``: the mesh's ``(remat, tp)`` dim names (:func:`mesh_dims`; default: those of ``("remat", "tp")``);
    on any other dim of the mesh the param must be ``Replicate``.

    [Note: replicated params] A param that holds the whole matrix on every rank of the domain -- a plain tensor
    without a ``partition_dim`` attribute on a mesh or with groups (a linear a TP plan leaves out and FSDP2 does
    not wrap, as torchtitan and Megatron models have), or a DTensor ``Replicate`` on every mesh dim -- is
    ``replicated``: every rank already has the full matrix and (like any replicated param's optimizer) the full
    gradient, so its NS runs **locally on every rank**, with no exchange. The home-based alternative would save the
    ``S - 1`` duplicated NS computations at the price of sending the full bf16 result from the home to the ``S - 1``
    others (a broadcast of ``P*Q`` elements); local NS is the simplest exact choice and the cheaper one where a
    matrix's NS costs less than that broadcast, as for the small matrices TP plans leave out (the broadcast
    variant is not implemented). Its local shape must be its full shape (a ``full_shape`` attribute, if any, must
    agree). Gradients must agree across the ranks, as for
    the AdamW params: the updates are computed independently. Not supported, with an error naming the fix: a
    DTensor sharded over TP but replicated over remat (FSDP2 not applied to a TP-sharded module), and
    ``Shard(0)`` on both dims of a 2-D mesh (rows in remat-major order; the runtime's layout is FSDP2's
    ``_StridedShard`` order, rank ``(g, t)`` holding row block ``t*R + g``).

    Returns:
        ``(MuonParam, None)``, or ``(None, message)`` naming the param, its shape and the expectation.
    """
    replicated = False
    if isinstance(p, DTensor):
        pl = p.placements
        names = tuple(p.device_mesh.mesh_dim_names or ())
        full = (int(p.shape[0]), int(p.shape[1]))
        if mesh is None:
            return None, f"Muon param {name!r} is a DTensor but no device_mesh was given"
        mesh_names = tuple(mesh.mesh_dim_names or ())
        remat_name, tp_name = dims if dims is not None else mesh_dims(mesh)[0]
        if not names and not mesh_names and p.device_mesh.ndim == mesh.ndim == 1:
            names = mesh_names = (remat_name,)  # fully_shard's default mesh, unnamed: its one dim is remat (mesh_dims)
        by_name = dict(zip(names, pl))
        if not set(names) <= set(mesh_names):
            return None, (
                f"Muon param {name!r} lives on mesh dims {names}, not on (a sub-mesh of) the device_mesh "
                f"{mesh_names} passed"
            )
        remat_pl = by_name.get(remat_name, Replicate())
        tp_pl = by_name.get(tp_name, Replicate()) if tp_name is not None else Replicate()
        extra = {d: x for d, x in by_name.items() if d not in (remat_name, tp_name) and not isinstance(x, Replicate)}
        if extra:
            return None, (
                f"Muon param {name!r} (shape {full}) has placements {extra} on mesh dims outside the domain "
                f"(remat {remat_name!r}, TP {tp_name!r}); expected Replicate there"
            )
        tp_sharded = T > 1 and not isinstance(tp_pl, Replicate)
        if R > 1 and isinstance(remat_pl, Replicate) and not tp_sharded:
            replicated = True  # [Note: replicated params]
        elif R > 1 and isinstance(remat_pl, Replicate):
            return None, (
                f"Muon param {name!r} (shape {full}) has placements {tuple(pl)} on mesh dims {names}: sharded over "
                f"{tp_name!r} ({tp_pl}) but replicated over {remat_name!r}; apply fully_shard over that dim to its module "
                "(placements (_StridedShard(0) or Shard(0), Shard(0 or 1))), or leave it out of the TP plan"
            )
        elif R > 1 and not _is_strided_or_shard0(remat_pl):
            return None, (
                f"Muon param {name!r} (shape {full}) has placement {remat_pl} on the remat dim {remat_name!r}; "
                "expected Shard(0) (FSDP2 fully_shard)"
                + (f". If {remat_name!r} is your tensor-parallel dim, name it: OverlapMuon(..., tp_dim={remat_name!r})"
                   if T == 1 else "")
            )
        elif (R > 1 and T > 1 and isinstance(tp_pl, Shard) and tp_pl.dim == 0
              and not isinstance(remat_pl, _StridedShard)):
            return None, (
                f"Muon param {name!r} (shape {full}) has placements {tuple(pl)} on mesh dims {names}: Shard(0) on "
                f"both dims puts row block g*T + t on rank (g, t), but the runtime needs FSDP2's row order (block "
                f"t*R + g): placements (_StridedShard(dim=0, split_factor={T}), Shard(dim=0)), which "
                "ColwiseParallel over 'tp' then fully_shard over 'remat' produce"
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
        a, b = int(p.shape[0]), int(p.shape[1])
        fs = getattr(p, "full_shape", None)
        if R * T > 1 and not hasattr(p, "partition_dim") and (fs is None or tuple(int(v) for v in fs) == (a, b)):
            return MuonParam(index, name, p, (a, b), None, replicated=True), None  # [Note: replicated params]
        pd = getattr(p, "partition_dim", None) if T > 1 else None
        if pd not in (0, 1, None):
            return None, f"Muon param {name!r} has partition_dim={pd!r}; expected 0, 1 or None"
        if T > 1 and not hasattr(p, "partition_dim"):
            return None, (
                f"Muon param {name!r} has local shape {(a, b)} and full_shape {tuple(fs)} but no partition_dim "
                f"attribute; on a {R}x{T} domain a plain shard needs partition_dim in {{0, 1, None}} (a plain param "
                "without one must hold the whole matrix: it is then replicated over the domain)"
            )
        if fs is not None:
            full = (int(fs[0]), int(fs[1]))
        elif pd == 0:
            full = (a * R * T, b)
        elif pd == 1:
            full = (a * R, b * T)
        else:
            full = (a * R, b)
    expected = full if replicated else block_shape(full, pd, R, T, g, t)
    loc = tuple(local_tensor(p).shape)
    if loc != expected:
        return None, (
            f"Muon param {name!r} has local shape {loc}, expected {expected} for full shape {full}, "
            f"partition_dim={pd} on a {R}x{T} domain at (g={g}, t={t})"
        )
    return MuonParam(index, name, p, full, pd, replicated=replicated), None


# ----------------------------------------------------------------------------------------------------------------
# The expert domain ([Note: two domains], with ``discover_expert_layouts`` in ``overlap_muon/discovery.py``)
# ----------------------------------------------------------------------------------------------------------------


def describe_expert_param(
    index: int, name: str, p: Tensor, mesh: Any, T: int, t: int, ep_dim: str = "ep", etp_dim: str = "etp",
) -> tuple[list[MuonParam], str | None]:
    """Place one expert param in its ``1 x T`` expert domain ([Note: two domains]): one :class:`MuonParam` per matrix.

    A 2-D param (one expert's linear) is placed as :func:`describe_param` places a dense one (ETP as the TP dim). A
    3-D param ``(E, P, Q)`` (grouped GEMM weights) is ``E_local`` matrices ``(P, Q)``, batched in NS: as a DTensor
    on ``mesh``, ``Shard(0)`` (or ``Replicate``) on ``ep_dim`` and ``Shard(1)`` (rows of each matrix, the
    ``partition_dim`` 0), ``_StridedShard(1)`` (Hugging Face's fused ``[gate; up]``: rows, ``split_factor`` kept),
    ``Shard(2)`` (columns, 1) or ``Replicate`` on ``etp_dim``, any placement on a size-1 dim
    (:func:`expert_placements`); as a plain tensor its local ``(E_local, p, q)`` block, carrying ``partition_dim``
    (0 or 1, of the matrix) when ETP splits it and optionally ``full_shape`` ``(P, Q)``. The names are ``"{name}[e]"`` with ``e`` the local expert index (equal on every EP
    rank, so the plans of all EP ranks agree).

    Returns:
        ``(params, None)`` (indices ``index, index + 1, ...``), or ``([], message)`` naming the param, its shape and
        the expectation.
    """
    if p.ndim == 2:
        dims = (None, etp_dim)
        mp, err = describe_param(index, name, p, mesh, 1, T, 0, t, dims=dims)
        if mp is not None:
            mp.domain = 1
        return ([mp] if mp is not None else []), err
    if p.ndim != 3:
        return [], f"expert param {name!r} has shape {tuple(p.shape)}; expected a 2-D linear or a 3-D (E, P, Q) weight"
    loc = tuple(local_tensor(p).shape)
    if isinstance(p, DTensor):
        if mesh is None:
            return [], f"expert param {name!r} is a DTensor but no expert_mesh was given"
        pd, split_factor, ep_size, err = expert_placements(name, p, ep_dim, etp_dim, T)
        if err is not None:
            return [], err
        if p.shape[0] % ep_size:
            return [], (f"expert param {name!r} (shape {tuple(p.shape)}) has {p.shape[0]} experts over EP size "
                        f"{ep_size}; every EP rank must hold the same number of experts (the ranks plan and "
                        "exchange in lockstep)")
        full = (int(p.shape[1]), int(p.shape[2]))
        replicated = False
    else:
        split_factor = 1
        fs = getattr(p, "full_shape", None)
        full = (int(fs[0]), int(fs[1])) if fs is not None else None
        replicated = T > 1 and not hasattr(p, "partition_dim")  # [Note: replicated params]
        pd = getattr(p, "partition_dim", None) if T > 1 and not replicated else None
        if pd not in (0, 1, None):
            return [], f"expert param {name!r} has partition_dim={pd!r}; expected 0 or 1 (of each (P, Q) matrix)"
        if full is None:
            full = (loc[1] * (T if pd == 0 else 1), loc[2] * (T if pd == 1 else 1))
    expected = (loc[0],) + (full if replicated else block_shape(full, pd, 1, T, 0, t))
    if loc != expected:
        return [], (f"expert param {name!r} has local shape {loc}, expected {expected} for matrices {full}, "
                    f"partition_dim={pd} on a 1x{T} expert domain at t={t}")
    return [MuonParam(index + e, f"{name}[{e}]", p, full, pd, replicated=replicated, expert=e, domain=1,
                      split_factor=split_factor) for e in range(loc[0])], None
