"""Each Muon param's place: which domain routes it, where its shard lies in the full matrix (read once from its
DTensor placements, or from a plain shard's attributes), how its rows are split into separately orthogonalized parts
(``overlap_muon.split``), and the constructor's per-param checks, run on every rank. :func:`place_params` builds each
:class:`MuonParam` once, here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import Tensor

from ._discovery import mesh_dims
from ._layout import block, block_shape
from .split import SplitArg, apply_runs, resolve_split, strided_parts

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
except Exception:  # pragma: no cover
    DTensor = Replicate = Shard = _StridedShard = ()  # type: ignore[assignment,misc]

__all__ = ["MuonParam", "local_tensor", "place_params", "describe_param", "describe_expert_param",
           "expert_placements"]


def local_tensor(t: Tensor) -> Tensor:
    """The local shard of a DTensor (sharing storage), or the tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


@dataclass(frozen=True, eq=False)
class MuonParam:
    """One Muon matrix as the runtime sees it; built once, by :func:`place_params`."""

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
    (:attr:`ns_shape`), the ``(out, in)`` linear it is ([Note: transposed weights] in ``_exchanges.py``)."""
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


class Placed(NamedTuple):
    """Where one matrix of a Muon param lies in its domain (:func:`describe_param`, :func:`describe_expert_param`):
    the fields of its :class:`MuonParam` that the placement decides."""

    name: str
    param: Tensor
    full_shape: tuple[int, int]
    partition_dim: int | None
    replicated: bool = False
    expert: int | None = None
    domain: int = 0
    split_factor: int = 1


def _placements(p: Any, *unnamed: str | None) -> tuple[dict[Any, Any], dict[Any, int]]:
    """A DTensor's placement on each named dim of its mesh, and each dim's size: the one reader of DTensor
    placements. ``unnamed``: the name an unnamed 1-D mesh's dim takes (``None`` is a name here)."""
    mesh = p.device_mesh
    names = tuple(mesh.mesh_dim_names or ())
    if not names and unnamed and mesh.ndim == 1:
        names = unnamed
    return dict(zip(names, p.placements)), {d: mesh.size(i) for i, d in enumerate(names)}


def place_params(
    muon_named: Sequence[tuple[str, Tensor]],
    expert_ids: set[int],
    conv1d: set[int],
    split: SplitArg,
    dense: tuple[Any, Any, int, int, int, int],
    experts: tuple[Any, str, str, int, int],
) -> tuple[list[MuonParam], list[str]]:
    """The :class:`MuonParam` s of ``muon_named``, indexed ``0 .. n-1`` (a grouped expert weight gives one per
    matrix), with their transposition (HF ``Conv1D``: ``id`` in ``conv1d``), split parts (a strided expert shard's
    rows put in place, ``overlap_muon.split.strided_parts``) and apply runs.

    Args:
        dense: ``(device_mesh, (remat_dim, tp_dim), R, T, g, t)`` of the dense domain.
        experts: ``(expert_mesh, ep_dim, etp_dim, ETP, et)`` of the expert domain.

    Returns:
        ``(params, errors)``: every message names the param, its shape and the expectation.
    """
    mesh, dims, R, T, g, t = dense
    emesh, ep_dim, etp_dim, ET, et = experts
    placed: list[Placed] = []
    errors: list[str] = []
    for n, p in muon_named:
        if id(p) in expert_ids:
            mps, err = describe_expert_param(n, p, emesh, ET, et, ep_dim, etp_dim)
        else:
            mp, err = describe_param(n, p, mesh, R, T, g, t, dims=dims)
            mps = [mp] if mp is not None else []
        placed += mps
        errors += [err] if err else []
    muon: list[MuonParam] = []
    for i, w in enumerate(placed):
        transposed = id(w.param) in conv1d
        P, Q = w.full_shape
        ns_shape = (Q, P) if transposed else (P, Q)
        parts, err = resolve_split(split, w.name, w.param, ns_shape)
        if w.split_factor > 1:  # rows of a strided expert shard, in place ([Note: strided expert rows])
            parts = strided_parts(parts, w.full_shape, w.split_factor, ET)
        if parts is not None and transposed:
            err = f"split of Muon param {w.name!r}: a transposed (Conv1D) weight cannot be split yet"
        shard = (0, P, 0, Q) if w.replicated else block(
            w.full_shape, w.partition_dim, *((1, ET, 0, et) if w.domain else (R, T, g, t)))
        runs = apply_runs(parts, ns_shape, (shard[2], shard[3], shard[0], shard[1]) if transposed else shard)
        muon.append(MuonParam(i, **w._asdict(), parts=parts, runs=runs, transposed=transposed))
        errors += [err] if err else []
    return muon, errors


def _is_strided_or_shard0(p: Any) -> bool:
    if isinstance(p, _StridedShard):
        return p.dim == 0
    return isinstance(p, Shard) and p.dim == 0


def describe_param(
    name: str, p: Tensor, mesh: Any, R: int, T: int, g: int, t: int,
    dims: tuple[str | None, str | None] | None = None,
) -> tuple[Placed | None, str | None]:
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
        ``(Placed, None)``, or ``(None, message)`` naming the param, its shape and the expectation.
    """
    if isinstance(p, DTensor):
        full = (int(p.shape[0]), int(p.shape[1]))
        pd, replicated, err = _dtensor_layout(name, p, mesh, R, T, dims)
    else:
        full, pd, replicated, err = _plain_layout(name, p, R, T)
    if err is not None:
        return None, err
    expected = full if replicated else block_shape(full, pd, R, T, g, t)
    loc = tuple(local_tensor(p).shape)
    if loc != expected:
        return None, (
            f"Muon param {name!r} has local shape {loc}, expected {expected} for full shape {full}, "
            f"partition_dim={pd} on a {R}x{T} domain at (g={g}, t={t})"
        )
    return Placed(name, p, full, pd, replicated=replicated), None


def _dtensor_layout(name: str, p: Any, mesh: Any, R: int, T: int, dims: tuple[str | None, str | None] | None
                    ) -> tuple[int | None, bool, str | None]:
    """A dense DTensor param's ``(partition_dim, replicated, error)`` from its placements (:func:`describe_param`)."""
    if mesh is None:
        return None, False, f"Muon param {name!r} is a DTensor but no device_mesh was given"
    mesh_names = tuple(mesh.mesh_dim_names or ())
    remat_name, tp_name = dims if dims is not None else mesh_dims(mesh)[0]
    one_unnamed = not mesh_names and mesh.ndim == 1  # fully_shard's default mesh: its one dim is remat (mesh_dims)
    by_name, _ = _placements(p, *((remat_name,) if one_unnamed else ()))
    names = tuple(by_name)
    if one_unnamed and not p.device_mesh.mesh_dim_names:
        mesh_names = names
    if not set(names) <= set(mesh_names):
        return None, False, (f"Muon param {name!r} lives on mesh dims {names}, not on (a sub-mesh of) the "
                             f"device_mesh {mesh_names} passed")
    extra = {d: x for d, x in by_name.items() if d not in (remat_name, tp_name) and not isinstance(x, Replicate)}
    if extra:
        return None, False, (f"Muon param {name!r} (shape {tuple(p.shape)}) has placements {extra} on mesh dims "
                             f"outside the domain (remat {remat_name!r}, TP {tp_name!r}); expected Replicate there")
    remat_pl = by_name.get(remat_name, Replicate())
    tp_pl = by_name.get(tp_name, Replicate()) if tp_name is not None else Replicate()
    err = _unsupported(name, p, names, (remat_name, tp_name), remat_pl, tp_pl, R, T)
    if err is not None:
        return None, False, err
    replicated = R > 1 and isinstance(remat_pl, Replicate)  # [Note: replicated params]
    if T == 1 or isinstance(tp_pl, Replicate):
        return None, replicated, None
    if isinstance(tp_pl, Shard) and tp_pl.dim in (0, 1):
        return tp_pl.dim, replicated, None
    return None, False, f"Muon param {name!r} has TP placement {tp_pl}; expected Shard(0), Shard(1) or Replicate"


def _unsupported(name: str, p: Any, names: tuple[str, ...], dims: tuple[str | None, str | None], remat_pl: Any,
                 tp_pl: Any, R: int, T: int) -> str | None:
    """The remat x TP placements the runtime does not take, each with the fix (or ``None``)."""
    (remat_name, tp_name), full, pl = dims, tuple(p.shape), tuple(p.placements)
    if R > 1 and isinstance(remat_pl, Replicate):
        if T > 1 and not isinstance(tp_pl, Replicate):
            return (f"Muon param {name!r} (shape {full}) has placements {pl} on mesh dims {names}: sharded over "
                    f"{tp_name!r} ({tp_pl}) but replicated over {remat_name!r}; apply fully_shard over that dim to its "
                    "module (placements (_StridedShard(0) or Shard(0), Shard(0 or 1))), or leave it out of the TP plan")
        return None
    if R > 1 and not _is_strided_or_shard0(remat_pl):
        return (f"Muon param {name!r} (shape {full}) has placement {remat_pl} on the remat dim {remat_name!r}; "
                "expected Shard(0) (FSDP2 fully_shard)"
                + (f". If {remat_name!r} is your tensor-parallel dim, name it: OverlapMuon(..., tp_dim={remat_name!r})"
                   if T == 1 else ""))
    if R > 1 and T > 1 and isinstance(tp_pl, Shard) and tp_pl.dim == 0 and not isinstance(remat_pl, _StridedShard):
        return (f"Muon param {name!r} (shape {full}) has placements {pl} on mesh dims {names}: Shard(0) on both "
                f"dims puts row block g*T + t on rank (g, t), but the runtime needs FSDP2's row order (block t*R + g): "
                f"placements (_StridedShard(dim=0, split_factor={T}), Shard(dim=0)), which ColwiseParallel over 'tp' "
                "then fully_shard over 'remat' produce")
    return None


def _plain_layout(name: str, p: Tensor, R: int, T: int
                  ) -> tuple[tuple[int, int], int | None, bool, str | None]:
    """A plain param's ``(full_shape, partition_dim, replicated, error)`` from its attributes (:func:`describe_param`)."""
    a, b = int(p.shape[0]), int(p.shape[1])
    fs = getattr(p, "full_shape", None)
    if R * T > 1 and not hasattr(p, "partition_dim") and (fs is None or tuple(int(v) for v in fs) == (a, b)):
        return (a, b), None, True, None  # [Note: replicated params]
    pd = getattr(p, "partition_dim", None) if T > 1 else None
    if pd not in (0, 1, None):
        return (a, b), None, False, f"Muon param {name!r} has partition_dim={pd!r}; expected 0, 1 or None"
    if T > 1 and not hasattr(p, "partition_dim"):
        return (a, b), None, False, (
            f"Muon param {name!r} has local shape {(a, b)} and full_shape {tuple(fs)} but no partition_dim "
            f"attribute; on a {R}x{T} domain a plain shard needs partition_dim in {{0, 1, None}} (a plain param "
            "without one must hold the whole matrix: it is then replicated over the domain)")
    if fs is not None:
        return (int(fs[0]), int(fs[1])), pd, False, None
    return (a * R * (T if pd == 0 else 1), b * (T if pd == 1 else 1)), pd, False, None



def describe_expert_param(
    name: str, p: Tensor, mesh: Any, T: int, t: int, ep_dim: str = "ep", etp_dim: str = "etp",
) -> tuple[list[Placed], str | None]:
    """Place one expert param in its ``1 x T`` expert domain ([Note: two domains]): one :class:`Placed` per matrix.

    A 2-D param (one expert's linear) is placed as :func:`describe_param` places a dense one (ETP as the TP dim). A
    3-D param ``(E, P, Q)`` (grouped GEMM weights) is ``E_local`` matrices ``(P, Q)``, batched in NS: as a DTensor
    on ``mesh``, ``Shard(0)`` (or ``Replicate``) on ``ep_dim`` and ``Shard(1)`` (rows of each matrix, the
    ``partition_dim`` 0), ``_StridedShard(1)`` (Hugging Face's fused ``[gate; up]``: rows, ``split_factor`` kept),
    ``Shard(2)`` (columns, 1) or ``Replicate`` on ``etp_dim``, any placement on a size-1 dim
    (:func:`expert_placements`); as a plain tensor its local ``(E_local, p, q)`` block, carrying ``partition_dim``
    (0 or 1, of the matrix) when ETP splits it and optionally ``full_shape`` ``(P, Q)``. The names are ``"{name}[e]"`` with ``e`` the local expert index (equal on every EP
    rank, so the plans of all EP ranks agree).

    Returns:
        ``(matrices, None)``, or ``([], message)`` naming the param, its shape and the expectation.
    """
    if p.ndim == 2:
        dims = (None, etp_dim)
        mp, err = describe_param(name, p, mesh, 1, T, 0, t, dims=dims)
        return ([mp._replace(domain=1)] if mp is not None else []), err
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
    return [Placed(f"{name}[{e}]", p, full, pd, replicated=replicated, expert=e, domain=1,
                      split_factor=split_factor) for e in range(loc[0])], None


def expert_placements(
    name: str, p: Any, ep_dim: str, etp_dim: str, T: int
) -> tuple[int | None, int, int, str | None]:
    """How a 3-D ``(E, P, Q)`` expert DTensor lies on its mesh: ``(partition_dim, split_factor, ep_size, error)``.

    Accepted placements, by mesh dim:

    * ``ep_dim``: ``Shard(0)`` (``ep_size`` the dim's size) or ``Replicate`` (``ep_size`` 1);
    * ``etp_dim``: ``Shard(1)`` / ``Shard(2)`` (``partition_dim`` 0 / 1 of each matrix), ``Replicate``
      (``None``), or ``_StridedShard(1, split_factor=s)``: Hugging Face's ``packed_colwise`` on a fused
      ``[gate; up]`` weight, where the rows are ``s`` pieces and ETP rank ``t`` holds row block ``t`` of every
      piece (``partition_dim`` 0, ``split_factor`` ``s``; ``P`` must be a multiple of ``s*T``, which torch also
      requires, so every rank holds ``P/T`` rows; ``overlap_muon.split.strided_parts`` puts the rows in place);
    * any other dim (torchtitan's expert FSDP dim ``efsdp``): ``Replicate``; ``Shard(0)`` / ``_StridedShard(0)``,
      which shards the experts further (torchtitan's ``(_StridedShard(0), Shard(0))`` on ``("efsdp", "ep")``:
      each rank holds whole matrices of its own experts, so ``ep_size`` counts that dim too); any placement when
      the dim has size 1 (a shard over one rank is the whole tensor). A shard of each matrix's rows or columns over
      such a dim is an error (not supported yet).

    ``split_factor`` is 1 unless the ETP placement is strided over ``T > 1`` ranks; a placement on a size-1 ETP dim
    is the whole matrix (``partition_dim`` ``None``).

    Returns:
        ``error`` names the param, its shape, its placements and the expectation (or is ``None``).
    """
    by_name, size = _placements(p)
    shape = tuple(p.shape)
    expected = (f"expected Shard(0) or Replicate on {ep_dim!r}, Shard(1), Shard(2), _StridedShard(1) or Replicate on "
                f"{etp_dim!r}, Shard(0), _StridedShard(0) or Replicate elsewhere (or any placement on a dim of size 1)")
    fsdp = {d: x for d, x in by_name.items()
            if d not in (ep_dim, etp_dim) and not isinstance(x, Replicate) and size[d] > 1}
    rows = [d for d, x in fsdp.items() if not (isinstance(x, (Shard, _StridedShard)) and x.dim == 0)]
    if rows:
        d = rows[0]
        return None, 1, 1, (f"expert param {name!r} (shape {shape}) has placements {by_name}: each expert matrix is "
                            f"split over {d!r} (size {size[d]}), an expert FSDP layout that is not supported yet "
                            f"(shard the experts, dim 0, over it instead); {expected}")
    ep_pl, etp_pl = by_name.get(ep_dim, Replicate()), by_name.get(etp_dim, Replicate())
    if not (isinstance(ep_pl, Replicate) or (isinstance(ep_pl, Shard) and ep_pl.dim == 0)):
        return None, 1, 1, f"expert param {name!r} (shape {shape}) has placements {by_name}; {expected}"
    ep_size = (size[ep_dim] if isinstance(ep_pl, Shard) else 1) * math.prod(size[d] for d in fsdp)
    if isinstance(etp_pl, _StridedShard) and etp_pl.dim == 1:
        sf = int(etp_pl.split_factor)
        if T > 1 and shape[1] % (sf * T):
            return None, 1, ep_size, (
                f"expert param {name!r} (shape {shape}) has ETP placement {etp_pl} over {T} ranks: its {shape[1]} "
                f"rows are not a multiple of split_factor * ETP = {sf * T}; expected an even strided shard")
        return (0, sf, ep_size, None) if T > 1 else (None, 1, ep_size, None)
    if isinstance(etp_pl, Shard) and etp_pl.dim in (1, 2):
        return (etp_pl.dim - 1 if T > 1 else None), 1, ep_size, None  # a shard over a size-1 dim is the whole matrix
    if isinstance(etp_pl, Replicate):
        return None, 1, ep_size, None
    return None, 1, ep_size, (f"expert param {name!r} (shape {shape}) has ETP placement {etp_pl}; expected Shard(1), "
                              "Shard(2), _StridedShard(1) or Replicate")
