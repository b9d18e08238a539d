"""All-to-all routing for layer-sharded Muon: shards to each matrix's Newton-Schulz home and back.

Layer sharding gives every Muon matrix one NS *home* in the ``R x T`` weight-shard domain (DESIGN.md section 2).
Before ``zeropower`` the home needs the complete ``(P, Q)`` matrix, so every rank sends it its local block
(``to``); afterwards the home sends every rank its block of the orthogonalized result (``from``). Only data
moves: every result is assembled by copies, so all paths here are bit exact.

Two layers of API:

* The seed API (``params_by_home``, ``route_to_ns_home``, ``route_from_ns_home``) is axis-generic: one exchange
  over one process group along one ``shard_dim`` per param. The caller runs it once over the remat group (dim 0)
  and once over the TP group (along the partition dim).
* The domain API (``local_shard``, ``to_homes``, ``from_homes``, ``all_gather_full``) speaks the domain's
  layouts directly. ``fused=False`` runs the two seed stages; ``fused=True`` does the whole move in one
  ``all_to_all_single`` over the domain's flat group. ``all_gather_full`` is the duplicated-mode baseline.
  ``to_team`` / ``from_team`` re-lay every matrix between the shard layout and the team NS layout (each rank
  one block of the long dim, ``team_block``), one ``all_to_all_single`` each.

Every exchange is split into a *plan* (pure metadata: split sizes, buffer offsets, the region of each piece;
a function of shapes, homes and group coordinates only, cached in a caller-owned ``plan`` dict) and an
*execution* (pack into one flat send buffer, one ``all_to_all_single``, unpack by copies or views).

[Note: transport as bytes] Send and receive buffers are allocated in the data's dtype and handed to the
collective as ``uint8`` views, with split sizes in bytes. The exchange is a pure copy, so this is exact for every
dtype, and no backend ever sees a dtype it lacks. (Viewing bf16/fp16 as int16 is *not* enough: gloo in torch
2.13 rejects int16 in ``all_to_all_single`` with "Invalid scalar type", while it accepts uint8.)

[Note: validation is local] All input checks run before any collective and raise ``ValueError`` naming the
param index, its shape and the expectation. They see only this rank's inputs, so an error that exists on every
rank (a bad home map, mixed dtypes, a wrong ``dim_sizes``, results that do not match the homes) is raised on
every rank; an inconsistency between ranks that no single rank can see (e.g. uneven shards passed without
``dim_sizes``, so ranks disagree on the full length) cannot be caught without an extra collective and surfaces
as a backend error or a process-group timeout.

[Note: results may alias] Where no data moves (a trivial group, ``None`` or size 1; the home's own copy of a
replicated ``shard_dim=None`` param), a result is the input itself, or its ``.contiguous()`` copy when the input is
a non-contiguous view. A result received as one whole piece is a view into the receive buffer. Callers that mutate
results in place must copy first.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from overlap_muon.domain import Domain, block, block_shape, chunk_offsets, chunk_sizes

__all__ = [
    "params_by_home",
    "route_to_ns_home",
    "route_from_ns_home",
    "local_shard",
    "to_homes",
    "from_homes",
    "all_gather_full",
    "team_block",
    "to_team",
    "from_team",
]

# A region of a tensor: ``(dim, start, length)`` narrows applied in order; ``()`` is the whole tensor.
_Region = tuple[tuple[int, int, int], ...]


# ----------------------------------------------------------------------------------------------------------------
# Plan: pure metadata, no tensors, no collectives.
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Piece:
    """One contiguous piece of a flat buffer and where it lives in a tensor of the call."""

    tensor: int  #: index of the tensor the piece is read from (send) or written to (receive)
    offset: int  #: start in the flat buffer, elements
    shape: tuple[int, ...]  #: shape of the piece
    region: _Region  #: where the piece sits in that tensor


@dataclass(frozen=True, slots=True)
class _Out:
    """How to produce one result tensor after the collective."""

    shape: tuple[int, ...]  #: shape of the result
    local: int | None  #: index of an input that is the result as is (no data moves), else None
    pieces: tuple[_Piece, ...]  #: non-empty receive-buffer pieces that tile the result


@dataclass(frozen=True, slots=True)
class _Route:
    """The metadata of one ``all_to_all_single`` exchange (``send``/``recv`` splits indexed by group rank)."""

    signature: tuple  #: ((field, value), ...) the metadata was built from; a reused plan must match it
    send_splits: tuple[int, ...]  #: elements sent to each group rank
    recv_splits: tuple[int, ...]  #: elements received from each group rank
    sends: tuple[_Piece, ...]  #: non-empty send pieces in buffer order
    outs: tuple[_Out, ...]  #: one per result, in result order


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def _replace(shape: tuple[int, ...], dim: int, length: int) -> tuple[int, ...]:
    return shape[:dim] + (length,) + shape[dim + 1 :]


def _narrow(x: Tensor, region: _Region) -> Tensor:
    for dim, start, length in region:
        x = x.narrow(dim, start, length)
    return x


class _Packer:
    """Lays pieces out in a flat buffer, one group rank after another, and counts the splits."""

    def __init__(self, size: int) -> None:
        self.splits = [0] * size
        self.pieces: list[_Piece] = []
        self.offset = 0

    def add(self, rank: int, tensor: int, shape: tuple[int, ...], region: _Region) -> _Piece | None:
        """Append a piece bound for (or coming from) ``rank``; ranks must be added in increasing order."""
        n = _numel(shape)
        if n == 0:
            return None
        piece = _Piece(tensor, self.offset, shape, region)
        self.pieces.append(piece)
        self.splits[rank] += n
        self.offset += n
        return piece


def _cached(plan: dict | None, key: str, signature: tuple, build: Callable[[tuple], _Route]) -> _Route:
    """Return ``plan[key]`` (checking it was built for ``signature``), building and storing it if absent."""
    if plan is None:
        return build(signature)
    route = plan.get(key)
    if route is None:
        route = build(signature)
        plan[key] = route
        return route
    if route.signature != signature:
        raise ValueError(f"reused plan entry {key!r} does not match this call: {_mismatch(route.signature, signature)}")
    return route


def _mismatch(old: tuple, new: tuple) -> str:
    """Name the first field (and param index, for per-param fields) where two signatures differ."""
    for (name, a), (_, b) in zip(old, new):
        if a == b:
            continue
        if isinstance(a, tuple) and isinstance(b, tuple) and name not in ("grid", "group"):
            if len(a) != len(b):
                return f"it was built for {len(a)} params ({name}), this call has {len(b)}"
            i = next(k for k in range(len(a)) if a[k] != b[k])
            return f"param {i}: {name} was {a[i]!r} when the plan was built, this call has {b[i]!r}"
        return f"{name} was {a!r} when the plan was built, this call has {b!r}"
    return "signatures differ"


# ----------------------------------------------------------------------------------------------------------------
# Execution: pack, one all_to_all_single, unpack.
# ----------------------------------------------------------------------------------------------------------------


def _host_staged(group: ProcessGroup | None, device: torch.device) -> bool:
    """True when CUDA tensors must go through host memory: gloo's all_to_all/all_gather take CPU tensors only
    (several ranks sharing one GPU over gloo). NCCL groups exchange device memory directly."""
    return device.type == "cuda" and group is not None and dist.get_backend(group) == "gloo"


def _execute(
    route: _Route,
    inputs: Sequence[Tensor],
    group: ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
) -> list[Tensor]:
    """Run one planned exchange: pack ``inputs`` into a flat buffer, exchange it, build the results."""
    with torch.no_grad():
        send = torch.empty(sum(route.send_splits), dtype=dtype, device=device)
        for p in route.sends:
            send[p.offset : p.offset + _numel(p.shape)].view(p.shape).copy_(_narrow(inputs[p.tensor], p.region))
        recv = torch.empty(sum(route.recv_splits), dtype=dtype, device=device)
        es = send.element_size()
        # [Note: transport as bytes]
        staged = _host_staged(group, device)
        wire_recv = recv.cpu() if staged else recv
        dist.all_to_all_single(
            wire_recv.view(torch.uint8),
            (send.cpu() if staged else send).view(torch.uint8),
            output_split_sizes=[s * es for s in route.recv_splits],
            input_split_sizes=[s * es for s in route.send_splits],
            group=group,
        )
        if staged:
            recv.copy_(wire_recv)
        del send
        results = []
        for out in route.outs:
            if out.local is not None:
                results.append(inputs[out.local].contiguous())
            elif len(out.pieces) == 1 and _numel(out.pieces[0].shape) == _numel(out.shape):
                p = out.pieces[0]
                results.append(recv[p.offset : p.offset + _numel(p.shape)].view(out.shape))
            else:
                full = torch.empty(out.shape, dtype=dtype, device=device)
                for p in out.pieces:
                    _narrow(full, p.region).copy_(recv[p.offset : p.offset + _numel(p.shape)].view(p.shape))
                results.append(full)
        return results


# ----------------------------------------------------------------------------------------------------------------
# Validation helpers (all local; see [Note: validation is local]).
# ----------------------------------------------------------------------------------------------------------------


def _group_coords(group: ProcessGroup | None, what: str) -> tuple[int, int]:
    """``(size, rank)`` of ``group``; ``None`` is the trivial group ``(1, 0)``."""
    if group is None:
        return 1, 0
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError(f"{what}: this process is not a member of the group it was given")
    return size, rank


def _as_int(value, what: str) -> int:
    if isinstance(value, bool):
        raise ValueError(f"{what} must be an int, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{what} must be an int, got {value!r}") from None


def _shape(x) -> tuple[int, ...]:
    return tuple(x.shape) if isinstance(x, Tensor) else tuple(x)


def _homes(home_of, n: int, size: int, shapes: Sequence[tuple[int, ...]] | None) -> tuple[int, ...]:
    """``home_of[i]`` for ``i < n`` as a tuple, checked to lie in ``[0, size)``."""
    out = []
    for i in range(n):
        desc = f"param {i}" if shapes is None else f"param {i} (shape {shapes[i]})"
        if isinstance(home_of, Mapping):
            if i not in home_of:
                raise ValueError(f"{desc} has no NS home in the home map; expected an int in [0, {size})")
            h = home_of[i]
        else:
            if i >= len(home_of):
                raise ValueError(f"{desc} has no NS home (the home list has {len(home_of)} entries)")
            h = home_of[i]
        try:
            h = _as_int(h, f"{desc}: NS home")
        except ValueError:
            raise ValueError(f"{desc} has NS home {h!r}, expected an int in [0, {size})") from None
        if not 0 <= h < size:
            raise ValueError(f"{desc} has NS home {h}, expected an int in [0, {size}) (the group size)")
        out.append(h)
    return tuple(out)


def _common_dtype(tensors: Sequence[Tensor], what: str) -> tuple[torch.dtype, torch.device] | None:
    """The one dtype and device shared by ``tensors`` (``None`` if empty)."""
    if not tensors:
        return None
    for i, x in enumerate(tensors):
        if not isinstance(x, Tensor):
            raise ValueError(f"{what}[{i}] is a {type(x).__name__}, expected a torch.Tensor")
    dtype, device = tensors[0].dtype, tensors[0].device
    for i, x in enumerate(tensors):
        if x.dtype != dtype:
            raise ValueError(
                f"{what}[{i}] (shape {tuple(x.shape)}) has dtype {x.dtype}, expected {dtype} like {what}[0]: "
                "one exchange moves a single dtype"
            )
        if x.device != device:
            raise ValueError(f"{what}[{i}] (shape {tuple(x.shape)}) is on {x.device}, expected {device} like {what}[0]")
    return dtype, device


def _shard_dims(shard_dim, shapes: Sequence[tuple[int, ...]]) -> tuple[int | None, ...]:
    """Per-param shard dim (non-negative) or ``None`` (replicated)."""
    n = len(shapes)
    if shard_dim is None or isinstance(shard_dim, int):
        dims = [shard_dim] * n
    elif isinstance(shard_dim, Sequence):
        if len(shard_dim) != n:
            raise ValueError(f"shard_dim has {len(shard_dim)} entries, expected one per param ({n})")
        dims = list(shard_dim)
    else:
        raise ValueError(f"shard_dim must be an int, None or a sequence of those, got {shard_dim!r}")
    out = []
    for i, (d, shape) in enumerate(zip(dims, shapes)):
        if d is None:
            out.append(None)
            continue
        d = _as_int(d, f"param {i} (shape {shape}): shard_dim")
        if not -len(shape) <= d < len(shape):
            raise ValueError(f"param {i} has shape {shape}; shard_dim {d} is out of range for a {len(shape)}-D tensor")
        out.append(d % len(shape))
    return tuple(out)


def _full_lengths(
    shapes: Sequence[tuple[int, ...]],
    dims: Sequence[int | None],
    dim_sizes,
    size: int,
    rank: int,
) -> tuple[int | None, ...]:
    """Full length along the shard dim of every param, checked against this rank's torch.chunk block."""
    n = len(shapes)
    if dim_sizes is not None and len(dim_sizes) != n:
        raise ValueError(f"dim_sizes has {len(dim_sizes)} entries, expected one per param ({n})")
    out = []
    for i, (shape, d) in enumerate(zip(shapes, dims)):
        if d is None:
            out.append(None)
            continue
        local = shape[d]
        if dim_sizes is None or dim_sizes[i] is None:
            out.append(local * size)  # even shards
            continue
        full = _as_int(dim_sizes[i], f"dim_sizes[{i}]")
        blocks = chunk_sizes(full, size) if full >= 0 else None
        if blocks is None or blocks[rank] != local:
            raise ValueError(
                f"param {i} has local shape {shape}: its length {local} along shard_dim {d} disagrees with "
                f"dim_sizes[{i}]={full}, whose torch.chunk blocks over {size} ranks are {blocks} "
                f"(rank {rank} expects {None if blocks is None else blocks[rank]})"
            )
        out.append(full)
    return tuple(out)


def _full_shape(shape: tuple[int, ...], dim: int | None, full: int | None) -> tuple[int, ...]:
    return shape if dim is None else _replace(shape, dim, full)


def _signature(op, size, rank, shapes, homes, dims, fulls) -> tuple:
    """Everything the metadata of a seed-level exchange depends on (dtype is not: splits count elements)."""
    return (
        ("op", op),
        ("group", (size, rank)),
        ("shapes", shapes),
        ("homes", homes),
        ("shard_dims", dims),
        ("dim_sizes", fulls),
    )


# ----------------------------------------------------------------------------------------------------------------
# Seed API: one exchange over one group.
# ----------------------------------------------------------------------------------------------------------------


def params_by_home(num_params: int, home_of: dict, size: int) -> list[list[int]]:
    """Group param indices by their NS home rank in the group.

    Args:
        num_params: number of params ``n``; indices ``0 .. n-1``.
        home_of: ``{param index: home rank}`` (a sequence indexed by param also works). Must cover every index;
            extra keys are ignored.
        size: group size ``S``.

    Returns:
        ``result[r]``: the params homed on rank ``r`` in increasing index order, the order every exchange uses.
        Ranks with no params get empty lists.

    Raises:
        ValueError: an index has no home, or a home is not an int in ``[0, size)``.
    """
    size = _as_int(size, "size")
    if size < 1:
        raise ValueError(f"size must be positive, got {size}")
    result: list[list[int]] = [[] for _ in range(size)]
    for i, h in enumerate(_homes(home_of, _as_int(num_params, "num_params"), size, None)):
        result[h].append(i)
    return result


def route_to_ns_home(
    momentum_list: list[Tensor],
    param_to_home_rank: dict,
    group: ProcessGroup | None,
    shard_dim: int | None | Sequence[int | None] = 0,
    plan: dict | None = None,
    *,
    dim_sizes: Sequence[int | None] | None = None,
) -> tuple[list[Tensor], list[int]]:
    """Forward all_to_all for layer sharding: redistribute momentum shards so each home has complete tensors.

    Every rank of ``group`` holds its shard of every param; after the call each rank holds the complete tensors
    of the params homed on it. One ``dist.all_to_all_single`` (uint8 transport, see module notes) when the group
    has more than one rank and there is at least one param; none otherwise.

    Args:
        momentum_list: ``n`` tensors, one per param, all of one dtype and device; ``momentum_list[i]`` is this
            rank's shard, e.g. ``(P_i / S, Q_i)`` for ``shard_dim=0``. Non-contiguous views are fine.
        param_to_home_rank: ``{i: home group rank}`` covering every ``i < n``.
        group: the process group of the exchange; ``None`` or size 1 means no communication.
        shard_dim: the dim the shards split: an int (negative allowed), ``None`` (replicated: every rank holds
            the whole tensor, the home uses its own copy and nobody sends), or a per-param sequence of those.
        plan: optional mutable dict caching the routing metadata under key ``"to"`` (the same dict may also be
            passed to :func:`route_from_ns_home`, which uses key ``"from"``). Filled on the first call, reused
            later; a reused plan that does not match the call raises ``ValueError``.
        dim_sizes: per-param full length along ``shard_dim`` within the group, for uneven shards following
            ``torch.chunk`` rules (``chunk_sizes``); ``None`` (or a ``None`` entry) means even shards
            (local length x S). Ignored for replicated params.

    Returns:
        ``(complete, my_param_indices)``: ``complete[k]`` is the contiguous full tensor of param
        ``my_param_indices[k]`` (pieces from every group rank concatenated along ``shard_dim`` in source-rank
        order, dtype of the inputs); indices ascend. See [Note: results may alias].

    Raises:
        ValueError (before any collective): a param has no home or a home outside ``[0, S)``; mixed dtypes or
            devices; a bad ``shard_dim``; a shard whose length disagrees with ``dim_sizes``' chunk rule; a reused
            plan that does not match.
    """
    shapes = tuple(_shape(x) for x in momentum_list)
    size, rank = _group_coords(group, "route_to_ns_home")
    dims = _shard_dims(shard_dim, shapes)
    homes = _homes(param_to_home_rank, len(shapes), size, shapes)
    meta = _common_dtype(momentum_list, "momentum_list")
    fulls = _full_lengths(shapes, dims, dim_sizes, size, rank)
    return _route_to(momentum_list, shapes, homes, dims, fulls, group, size, rank, meta, plan)


def _route_to(tensors, shapes, homes, dims, fulls, group, size, rank, meta, plan):
    """route_to_ns_home on validated inputs (also the stages of the domain API)."""
    mine = [i for i, h in enumerate(homes) if h == rank]
    if size == 1 or not tensors:
        return [tensors[i].contiguous() for i in mine], mine
    sig = _signature("to", size, rank, shapes, homes, dims, fulls)

    def build(sig: tuple) -> _Route:
        by_home = params_by_home(len(shapes), homes, size)
        send = _Packer(size)
        for h in range(size):
            for i in by_home[h]:
                if dims[i] is not None:  # replicated: the home already has it
                    send.add(h, i, shapes[i], ())
        recv = _Packer(size)
        pieces: dict[int, list[_Piece]] = {i: [] for i in mine}
        for s in range(size):
            for i in mine:
                d = dims[i]
                if d is None:
                    continue
                length, start = chunk_sizes(fulls[i], size)[s], chunk_offsets(fulls[i], size)[s]
                p = recv.add(s, i, _replace(shapes[i], d, length), ((d, start, length),))
                if p is not None:
                    pieces[i].append(p)
        outs = tuple(
            _Out(shapes[i], i, ())  # replicated: the home's own copy
            if dims[i] is None
            else _Out(_full_shape(shapes[i], dims[i], fulls[i]), None, tuple(pieces[i]))
            for i in mine
        )
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)

    route = _cached(plan, "to", sig, build)
    return _execute(route, tensors, group, *meta), mine


def route_from_ns_home(
    ns_results: list[Tensor],
    my_param_indices: list[int],
    momentum_list: list[Tensor],
    param_to_home_rank: dict,
    group: ProcessGroup | None,
    shard_dim: int | None | Sequence[int | None] = 0,
    plan: dict | None = None,
    *,
    dim_sizes: Sequence[int | None] | None = None,
    dtype: torch.dtype | None = None,
) -> list[Tensor | None]:
    """Backward all_to_all for layer sharding: distribute the homes' NS results back as shards.

    The inverse of :func:`route_to_ns_home`: each home holds complete results for its params; after the call every
    rank holds its shard of every param (for a replicated param, the whole tensor: the home sends a full copy to
    every other rank). Same collective count as :func:`route_to_ns_home`.

    Args:
        ns_results: complete results of the params homed on this rank, ordered like ``my_param_indices``; each
            has the full shape of its param (the local shape with ``shard_dim`` set to the full length).
        my_param_indices: the indices :func:`route_to_ns_home` returned here (params homed on this rank,
            ascending).
        momentum_list: this rank's shard of every param (``n`` entries); only shapes (and, if ``dtype`` is not
            given, the dtype) are read.
        param_to_home_rank, group, shard_dim, plan, dim_sizes: as in :func:`route_to_ns_home` (``plan`` key
            ``"from"``).
        dtype: dtype of the results and of the transport. Every rank must agree on it, including ranks that
            own no param, so it defaults to the (common) dtype of ``momentum_list``; pass it when the NS results
            have another dtype (e.g. bf16 results for fp32 momentum).

    Returns:
        ``n`` tensors: entry ``i`` is this rank's shard of param ``i`` (shape ``momentum_list[i].shape``, dtype
        ``dtype``). No entry is ``None`` here (the annotation is the seed's). See [Note: results may alias].

    Raises:
        ValueError (before any collective): as :func:`route_to_ns_home`, and ``ns_results`` not matching
            ``my_param_indices`` (count, indices, a shape or a dtype).
    """
    shapes = tuple(_shape(x) for x in momentum_list)
    size, rank = _group_coords(group, "route_from_ns_home")
    dims = _shard_dims(shard_dim, shapes)
    homes = _homes(param_to_home_rank, len(shapes), size, shapes)
    meta = _common_dtype(momentum_list, "momentum_list")
    if dtype is None and meta is not None:
        dtype = meta[0]
    device = meta[1] if meta is not None else None
    fulls = _full_lengths(shapes, dims, dim_sizes, size, rank)
    return _route_from(
        ns_results, my_param_indices, shapes, homes, dims, fulls, group, size, rank, dtype, device, plan
    )


def _check_results(ns_results, my_param_indices, mine, expected_shapes, dtype, names: str) -> None:
    """ns_results must be the complete tensors of exactly the params homed here, in ascending order."""
    if len(ns_results) != len(my_param_indices) or list(my_param_indices) != mine:
        raise ValueError(
            f"got {len(ns_results)} ns_results for my_param_indices {list(my_param_indices)}, expected one result "
            f"per param homed on this rank, i.e. indices {mine} in this order"
        )
    for k, i in enumerate(mine):
        x = ns_results[k]
        if not isinstance(x, Tensor):
            raise ValueError(f"ns_results[{k}] (param {i}) is a {type(x).__name__}, expected a torch.Tensor")
        if tuple(x.shape) != expected_shapes[i]:
            raise ValueError(
                f"ns_results[{k}] (param {i}) has shape {tuple(x.shape)}, expected the full shape "
                f"{expected_shapes[i]} ({names})"
            )
        if x.dtype != dtype:
            raise ValueError(
                f"ns_results[{k}] (param {i}, shape {tuple(x.shape)}) has dtype {x.dtype}, expected {dtype}: every "
                "rank must agree on the transport dtype (pass dtype= when results differ from the shards' dtype)"
            )


def _route_from(ns_results, my_param_indices, shapes, homes, dims, fulls, group, size, rank, dtype, device, plan):
    """route_from_ns_home on validated inputs (also the stages of the domain API)."""
    mine = [i for i, h in enumerate(homes) if h == rank]
    full_shapes = [_full_shape(s, d, f) for s, d, f in zip(shapes, dims, fulls)]
    _check_results(ns_results, my_param_indices, mine, full_shapes, dtype, "local shape with shard_dim at full length")
    if ns_results and ns_results[0].device != device:
        raise ValueError(f"ns_results[0] is on {ns_results[0].device}, expected {device} like the shards")
    if size == 1 or not shapes:
        return list(ns_results)
    sig = _signature("from", size, rank, shapes, homes, dims, fulls)

    def build(sig: tuple) -> _Route:
        by_home = params_by_home(len(shapes), homes, size)
        send = _Packer(size)
        for dst in range(size):
            for k, i in enumerate(mine):
                d = dims[i]
                if d is None:
                    if dst != rank:  # replicated: a full copy to every other rank
                        send.add(dst, k, full_shapes[i], ())
                    continue
                length, start = chunk_sizes(fulls[i], size)[dst], chunk_offsets(fulls[i], size)[dst]
                send.add(dst, k, _replace(full_shapes[i], d, length), ((d, start, length),))
        recv = _Packer(size)
        outs: list[_Out | None] = [None] * len(shapes)
        for src in range(size):
            for k, i in enumerate(by_home[src]):
                if dims[i] is None and src == rank:
                    outs[i] = _Out(shapes[i], k, ())  # the home keeps its own result
                    continue
                p = recv.add(src, i, shapes[i], ())
                outs[i] = _Out(shapes[i], None, () if p is None else (p,))
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), tuple(outs))

    route = _cached(plan, "from", sig, build)
    return _execute(route, ns_results, group, dtype, device)


# ----------------------------------------------------------------------------------------------------------------
# Domain API.
# ----------------------------------------------------------------------------------------------------------------


def _block_region(b: tuple[int, int, int, int]) -> _Region:
    return ((0, b[0], b[1]), (1, b[2], b[3]))


def _check_pd(pd, i: int) -> int | None:
    if pd is None or (isinstance(pd, int) and not isinstance(pd, bool) and pd in (0, 1)):
        return pd
    raise ValueError(f"param {i}: partition_dim {pd!r}, expected 0, 1 or None")


def _check_full_shape(shape, i: int) -> tuple[int, int]:
    try:
        P, Q = (_as_int(v, "dim") for v in shape)
    except (TypeError, ValueError):
        raise ValueError(f"param {i}: full shape {shape!r}, expected (P, Q) with non-negative ints") from None
    if P < 0 or Q < 0:
        raise ValueError(f"param {i}: full shape {shape!r}, expected (P, Q) with non-negative ints")
    return P, Q


def local_shard(full: Tensor, partition_dim: int | None, domain: Domain) -> Tensor:
    """This rank's block of a full ``(P, Q)`` tensor (a view), by the domain layouts of DESIGN.md section 2.

    Rank ``(g, t)`` of an ``R x T`` domain holds (``torch.chunk`` rules; blocks may be uneven or empty):
    partition_dim 0: rows ``chunk(chunk(range(P), T)[t], R)[g]``, all columns; 1: rows ``chunk(range(P), R)[g]``,
    columns ``chunk(range(Q), T)[t]``; None: rows ``chunk(range(P), R)[g]``, all columns.

    Raises:
        ValueError: ``full`` is not 2-D, or ``partition_dim`` is not 0, 1 or None.
    """
    if full.dim() != 2:
        raise ValueError(f"local_shard: full tensor has shape {tuple(full.shape)}, expected a (P, Q) matrix")
    pd = _check_pd(partition_dim, 0)
    r0, nr, c0, nc = block(tuple(full.shape), pd, domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank)
    return full.narrow(0, r0, nr).narrow(1, c0, nc)


@dataclass(frozen=True, slots=True)
class _Params:
    """Validated domain-level inputs."""

    homes: tuple[int, ...]
    pds: tuple[int | None, ...]
    full: tuple[tuple[int, int], ...]
    dtype: torch.dtype | None
    device: torch.device | None


def _check_domain_inputs(what, shards, homes, partition_dims, full_shapes, domain, groups: str) -> _Params:
    """Validate domain-level inputs; ``groups`` names the groups the call needs ('flat' and/or 'stages')."""
    R, T, g, t = domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank
    n = len(shards)
    for name, seq in (("partition_dims", partition_dims), ("full_shapes", full_shapes)) + (
        (("homes", homes),) if homes is not None else ()
    ):
        if len(seq) != n:
            raise ValueError(f"{what}: {name} has {len(seq)} entries, expected one per shard ({n})")
    need = []
    if "flat" in groups:
        need.append(("flat_group", domain.flat_group, R * T))
    if "stages" in groups:
        need += [("remat_group", domain.remat_group, R), ("tp_group", domain.tp_group, T)]
    for name, grp, size in need:
        if size > 1 and (grp is None or dist.get_world_size(grp) != size):
            raise ValueError(f"{what}: the {R}x{T} domain needs a {name} of size {size}, got {grp}")
    meta = _common_dtype(shards, "shards")
    pds, fulls = [], []
    for i in range(n):
        pd = _check_pd(partition_dims[i], i)
        P, Q = _check_full_shape(full_shapes[i], i)
        _, nr, _, nc = block((P, Q), pd, R, T, g, t)
        if tuple(shards[i].shape) != (nr, nc):
            raise ValueError(
                f"param {i} has local shape {tuple(shards[i].shape)}, expected {(nr, nc)} for full shape "
                f"{(P, Q)}, partition_dim={pd} on a {R}x{T} domain at (g={g}, t={t})"
            )
        pds.append(pd)
        fulls.append((P, Q))
    hs = () if homes is None else _homes(homes, n, R * T, [tuple(s.shape) for s in shards])
    return _Params(hs, tuple(pds), tuple(fulls), *(meta or (None, None)))


def _domain_plan(plan: dict | None, fused: bool, p: _Params, domain: Domain) -> None:
    """Tie ``plan`` to one (params, homes, layout, grid, fused) combination; raise if reused for another."""
    if plan is None:
        return
    grid = (domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank)
    sig = (
        ("fused", bool(fused)),
        ("grid", grid),
        ("homes", p.homes),
        ("partition_dims", p.pds),
        ("full_shapes", p.full),
    )
    old = plan.setdefault("domain", sig)
    if old != sig:
        raise ValueError(f"reused plan does not match this call: {_mismatch(old, sig)}")


def to_homes(
    shards: Sequence[Tensor],
    homes: Sequence[int],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    *,
    fused: bool,
    plan: dict | None = None,
) -> tuple[list[Tensor], list[int]]:
    """Assemble every Muon matrix on its NS home from the domain's shards.

    Args:
        shards: this rank's block of each param (``local_shard`` layout; may be non-contiguous), one dtype.
        homes: flat home index ``g*T + t`` of each param.
        partition_dims: TP partition dim of each param: 0, 1 or None.
        full_shapes: full ``(P, Q)`` of each param.
        domain: this rank's :class:`~overlap_muon.domain.Domain`.
        fused: True: one ``all_to_all_single`` over ``domain.flat_group``; the home assembles each matrix from
            its R*T blocks (for partition_dim None from the R ranks with its ``t``). False: two seed stages,
            stage 1 over ``remat_group`` along dim 0 to the home's ``g`` (None-partition params only in the remat
            group with the home's ``t``), stage 2 over ``tp_group`` along the partition dim to the home's ``t``
            (only params homed on this rank's ``g``, none of partition None). A stage with no participating
            param or a trivial group issues no collective, so at most 2 collectives.
        plan: optional dict caching the metadata, one per (set of params, fused); also valid for
            :func:`from_homes` with the same params. Reuse with a different call raises ``ValueError``.

    Returns:
        ``(matrices, indices)``: the contiguous full ``(P, Q)`` tensors (shards' dtype) of the params homed on this
        rank and their indices, ascending. Both modes give bit-identical matrices.

    Raises:
        ValueError (before any collective): length mismatches, a home outside ``[0, R*T)``, a partition dim not in
        {0, 1, None}, a shard shape that is not this rank's block, mixed dtypes, a missing group, a plan mismatch.
    """
    needs = "flat" if fused else "stages"
    p = _check_domain_inputs("to_homes", shards, homes, partition_dims, full_shapes, domain, needs)
    _domain_plan(plan, fused, p, domain)
    R, T, g, t = domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank
    me = domain.flat_rank
    shapes = tuple(tuple(x.shape) for x in shards)
    if fused:
        mine = [i for i, h in enumerate(p.homes) if h == me]
        if R * T == 1 or not shards:
            return [shards[i].contiguous() for i in mine], mine
        route = _cached(plan, "fused_to", (("op", "fused_to"),), lambda sig: _fused_to(sig, p, domain))
        return _execute(route, shards, domain.flat_group, p.dtype, p.device), mine
    meta = (p.dtype, p.device)
    coords = [divmod(h, T) for h in p.homes]
    # Stage 1, over the remat group: rows to the home's g. A None-partition param moves only in the remat group
    # of its home's t (its TP peers hold copies).
    a1 = [i for i in range(len(shards)) if p.pds[i] is not None or coords[i][1] == t]
    res1, got = _route_to(
        [shards[i] for i in a1],
        tuple(shapes[i] for i in a1),
        tuple(coords[i][0] for i in a1),
        (0,) * len(a1),
        tuple(_remat_length(p.full[i], p.pds[i], T, t) for i in a1),
        domain.remat_group,
        R,
        g,
        meta,
        _sub_plan(plan, "remat"),
    )
    got1 = [a1[j] for j in got]  # params homed on this g, each now a full TP block (or, None, the full matrix)
    # Stage 2, over the TP group: TP blocks of the params homed on this g to the home's t.
    a2 = [k for k, i in enumerate(got1) if p.pds[i] is not None]
    ids2 = [got1[k] for k in a2]
    res2, got2 = _route_to(
        [res1[k] for k in a2],
        tuple(tuple(res1[k].shape) for k in a2),
        tuple(coords[i][1] for i in ids2),
        tuple(p.pds[i] for i in ids2),
        tuple(p.full[i][p.pds[i]] for i in ids2),
        domain.tp_group,
        T,
        t,
        meta,
        _sub_plan(plan, "tp"),
    )
    done = {ids2[j]: x for j, x in zip(got2, res2)}
    done.update((i, res1[k]) for k, i in enumerate(got1) if p.pds[i] is None)
    mine = sorted(done)
    return [done[i] for i in mine], mine


def _remat_length(full: tuple[int, int], pd: int | None, T: int, t: int) -> int:
    """Rows a remat group of TP rank ``t`` splits: TP block ``t``'s rows for partition 0, else all ``P``."""
    return block_shape(full, 0, 1, T, 0, t)[0] if pd == 0 else full[0]


def _sub_plan(plan: dict | None, key: str) -> dict | None:
    return None if plan is None else plan.setdefault(key, {})


def _fused_to(sig: tuple, p: _Params, domain: Domain) -> _Route:
    R, T, t, W, me = domain.remat_size, domain.tp_size, domain.tp_rank, domain.size, domain.flat_rank
    by_home = params_by_home(len(p.homes), p.homes, W)
    send = _Packer(W)
    for h in range(W):
        for i in by_home[h]:
            if p.pds[i] is None and h % T != t:  # None: only the home's TP column sends (peers hold copies)
                continue
            b = block(p.full[i], p.pds[i], R, T, domain.remat_rank, t)
            send.add(h, i, (b[1], b[3]), ())
    recv = _Packer(W)
    pieces: dict[int, list[_Piece]] = {i: [] for i in by_home[me]}
    for s in range(W):
        gs, ts = divmod(s, T)
        for i in by_home[me]:
            if p.pds[i] is None and ts != t:
                continue
            b = block(p.full[i], p.pds[i], R, T, gs, ts)
            piece = recv.add(s, i, (b[1], b[3]), _block_region(b))
            if piece is not None:
                pieces[i].append(piece)
    outs = tuple(_Out(p.full[i], None, tuple(pieces[i])) for i in by_home[me])
    return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)


def from_homes(
    ns_results: Sequence[Tensor],
    my_indices: Sequence[int],
    shards: Sequence[Tensor],
    homes: Sequence[int],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    *,
    fused: bool,
    plan: dict | None = None,
    dtype: torch.dtype | None = None,
    serve: Sequence[frozenset[int]] | None = None,
) -> list[Tensor]:
    """Scatter the homes' full results back: every rank gets its block of every param (inverse of :func:`to_homes`).

    Args:
        ns_results: full ``(P, Q)`` results of the params homed on this rank, ordered like ``my_indices``.
        my_indices: the indices :func:`to_homes` returned on this rank.
        shards, homes, partition_dims, full_shapes, domain, plan: as in :func:`to_homes`; only the shapes (and,
            without ``dtype``, the dtype) of ``shards`` are read.
        fused: True: one ``all_to_all_single`` over ``flat_group``. False: stage 2 reversed over ``tp_group``
            (the home's TP blocks to its TP peers; for partition None a full copy to every peer), then stage 1
            reversed over ``remat_group`` along dim 0. At most 2 collectives.
        dtype: dtype of the results and the transport; every rank must agree, so it defaults to the shards'
            dtype. Pass it when the NS results have another dtype.
        serve: fused only: per param, the flat ranks its home sends a block to (``None``: all). A rank outside a
            param's set gets an empty tensor for it. With a param listed once per duplicate home
            (``surplus="duplicate"``), each copy serves its own ranks and every rank is served once.

    Returns:
        One tensor per param: this rank's block (shape ``shards[i].shape``, dtype ``dtype``); for partition None
        every TP peer gets its row block. See [Note: results may alias].

    Raises:
        ValueError (before any collective): as :func:`to_homes`, and ``ns_results`` not matching ``my_indices``
        (count, indices, a shape that is not the full shape, a dtype).
    """
    needs = "flat" if fused else "stages"
    p = _check_domain_inputs("from_homes", shards, homes, partition_dims, full_shapes, domain, needs)
    if serve is not None and (not fused or len(serve) != len(shards)):
        raise ValueError(f"from_homes: serve needs fused=True and one rank set per param ({len(shards)}), got "
                         f"fused={fused} and {len(serve)}")
    dtype = dtype if dtype is not None else p.dtype
    R, T, g, t, me = domain.remat_size, domain.tp_size, domain.remat_rank, domain.tp_rank, domain.flat_rank
    mine = [i for i, h in enumerate(p.homes) if h == me]
    _check_results(ns_results, my_indices, mine, p.full, dtype, "the param's full_shapes entry")
    _domain_plan(plan, fused, p, domain)
    shapes = tuple(tuple(x.shape) for x in shards)
    if fused:
        if R * T == 1 or not shards:
            return list(ns_results)
        sig = (("op", "fused_from"), ("serve", None if serve is None else tuple(tuple(sorted(x)) for x in serve)))
        route = _cached(plan, "fused_from", sig, lambda sig: _fused_from(sig, p, domain, serve))
        return _execute(route, ns_results, domain.flat_group, dtype, p.device)
    coords = [divmod(h, T) for h in p.homes]
    # Stage 2 reversed, over the TP group: the home sends each TP peer its TP block (None: a full copy, since
    # every peer then scatters rows in its own remat group).
    b2 = [i for i in range(len(shards)) if coords[i][0] == g]
    shapes2 = []
    for i in b2:
        P, Q = p.full[i]
        # the TP block (the whole matrix for partition None): the layout rule with R = 1
        shapes2.append(block_shape((P, Q), p.pds[i], 1, T, 0, t) if p.pds[i] is not None else (P, Q))
    out2 = _route_from(
        list(ns_results),
        [j for j, i in enumerate(b2) if coords[i][1] == t],
        tuple(shapes2),
        tuple(coords[i][1] for i in b2),
        tuple(p.pds[i] for i in b2),
        tuple(None if p.pds[i] is None else p.full[i][p.pds[i]] for i in b2),
        domain.tp_group,
        T,
        t,
        dtype,
        p.device,
        _sub_plan(plan, "tp"),
    )
    # Stage 1 reversed, over the remat group: rows from the home's g to every g.
    return _route_from(
        out2,
        b2,
        shapes,
        tuple(c[0] for c in coords),
        (0,) * len(shapes),
        tuple(_remat_length(f, pd, T, t) for f, pd in zip(p.full, p.pds)),
        domain.remat_group,
        R,
        g,
        dtype,
        p.device,
        _sub_plan(plan, "remat"),
    )


def _fused_from(sig: tuple, p: _Params, domain: Domain, serve: Sequence[frozenset[int]] | None = None) -> _Route:
    R, T, W, me = domain.remat_size, domain.tp_size, domain.size, domain.flat_rank
    by_home = params_by_home(len(p.homes), p.homes, W)
    send = _Packer(W)
    for d in range(W):
        gd, td = divmod(d, T)
        for k, i in enumerate(by_home[me]):
            if serve is not None and d not in serve[i]:
                continue
            b = block(p.full[i], p.pds[i], R, T, gd, td)
            send.add(d, k, (b[1], b[3]), _block_region(b))
    recv = _Packer(W)
    outs: list[_Out | None] = [None] * len(p.homes)
    for s in range(W):
        for i in by_home[s]:
            if serve is not None and me not in serve[i]:
                outs[i] = _Out((0, 0), None, ())  # served by another copy of the param
                continue
            b = block(p.full[i], p.pds[i], R, T, domain.remat_rank, domain.tp_rank)
            piece = recv.add(s, i, (b[1], b[3]), ())
            outs[i] = _Out((b[1], b[3]), None, () if piece is None else (piece,))
    return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), tuple(outs))


def all_gather_full(
    shards: Sequence[Tensor],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
) -> list[Tensor]:
    """Duplicated-mode baseline: every rank gets every full ``(P, Q)`` matrix.

    One all-gather over ``domain.flat_group`` per param (uint8 transport). Blocks are padded to the largest block
    of the param (elements) so the all-gather sizes are equal, then unpadded and placed; for partition None the
    copies of TP rank 0 are used.

    Returns:
        Contiguous full ``(P, Q)`` tensors in the shards' dtype, one per param.

    Raises:
        ValueError (before any collective): length mismatches, a bad partition dim or full shape, a shard that is
        not this rank's block, mixed dtypes, a missing flat group.
    """
    p = _check_domain_inputs("all_gather_full", shards, None, partition_dims, full_shapes, domain, "flat")
    R, T, W = domain.remat_size, domain.tp_size, domain.size
    if W == 1:
        return [x.contiguous() for x in shards]
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # renamed in torch 2.13
    out = []
    with torch.no_grad():
        for i, x in enumerate(shards):
            blocks = [block(p.full[i], p.pds[i], R, T, *divmod(f, T)) for f in range(W)]
            m = max(b[1] * b[3] for b in blocks)
            send = torch.empty(m, dtype=p.dtype, device=p.device)
            send[: x.numel()].view(x.shape).copy_(x)
            recv = torch.empty(W * m, dtype=p.dtype, device=p.device)
            if _host_staged(domain.flat_group, p.device):
                wire = recv.cpu()
                gather(wire.view(torch.uint8), send.cpu().view(torch.uint8), group=domain.flat_group)
                recv.copy_(wire)
            else:
                gather(recv.view(torch.uint8), send.view(torch.uint8), group=domain.flat_group)
            full = torch.empty(p.full[i], dtype=p.dtype, device=p.device)
            for f, b in enumerate(blocks):
                if p.pds[i] is None and f % T != 0:
                    continue
                _narrow(full, _block_region(b)).copy_(recv[f * m : f * m + b[1] * b[3]].view(b[1], b[3]))
            out.append(full)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Team layout: the long dim split over the whole domain (overlap_muon.team_ns).
# ----------------------------------------------------------------------------------------------------------------


def team_block(full_shape: tuple[int, int], size: int, member: int) -> tuple[int, int, int, int]:
    """``(row0, rows, col0, cols)`` of team member ``member``'s block of a ``(P, Q)`` matrix split over ``size``.

    NS runs on the oriented matrix (``(P, Q)``, or its transpose when ``P > Q``), whose columns are the long dim; a
    team splits them (``torch.chunk`` sizes), so a member holds all ``P`` rows and a column block of a wide or
    square matrix, or a row block and all ``Q`` columns of a tall one. See [Note: team NS by columns] in
    ``overlap_muon/team_ns.py``.
    """
    P, Q = full_shape
    if P > Q:
        return chunk_offsets(P, size)[member], chunk_sizes(P, size)[member], 0, Q
    return 0, P, chunk_offsets(Q, size)[member], chunk_sizes(Q, size)[member]


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> tuple[int, int, int, int] | None:
    """The intersection of two ``(row0, rows, col0, cols)`` rectangles, ``None`` when empty."""
    r0, c0 = max(a[0], b[0]), max(a[2], b[2])
    r1, c1 = min(a[0] + a[1], b[0] + b[1]), min(a[2] + a[3], b[2] + b[3])
    return (r0, r1 - r0, c0, c1 - c0) if r1 > r0 and c1 > c0 else None


def _within(x: tuple[int, int, int, int], outer: tuple[int, int, int, int]) -> _Region:
    """The region of rectangle ``x`` inside the tensor that holds rectangle ``outer``."""
    return ((0, x[0] - outer[0], x[1]), (1, x[2] - outer[2], x[3]))


def _relayout(what: str, inputs: Sequence[Tensor], pds: Sequence[int | None], fulls: Sequence[tuple[int, int]],
              domain: Domain, to_team_layout: bool, dtype: torch.dtype, device: torch.device,
              plan: dict | None) -> list[Tensor]:
    """One ``all_to_all_single`` over the flat group moving every matrix between the shard and team layouts."""
    R, T, W = domain.remat_size, domain.tp_size, domain.size
    me = domain.flat_rank
    sig = (("op", what), ("grid", (R, T, me)), ("partition_dims", tuple(pds)), ("full_shapes", tuple(fulls)))

    def src(i: int, f: int) -> tuple[int, int, int, int] | None:
        """The rectangle of matrix ``i`` that rank ``f`` sends from (``None``: it sends none)."""
        if not to_team_layout:
            return team_block(fulls[i], W, f)
        if pds[i] is None and f % T != 0:  # partition_dim None: TP ranks hold copies; the t = 0 copy is sent
            return None
        return block(fulls[i], pds[i], R, T, *divmod(f, T))

    def dst(i: int, f: int) -> tuple[int, int, int, int]:
        """The rectangle of matrix ``i`` that rank ``f`` receives into."""
        return team_block(fulls[i], W, f) if to_team_layout else block(fulls[i], pds[i], R, T, *divmod(f, T))

    def build(sig: tuple) -> _Route:
        send, recv = _Packer(W), _Packer(W)
        pieces: list[list[_Piece]] = [[] for _ in fulls]
        for f in range(W):  # _Packer wants peers in increasing order
            for i in range(len(fulls)):
                mine = src(i, me)
                x = _overlap(mine, dst(i, f)) if mine is not None else None
                if x is not None:
                    send.add(f, i, (x[1], x[3]), _within(x, mine))
        for f in range(W):
            for i in range(len(fulls)):
                theirs, mine = src(i, f), dst(i, me)
                x = _overlap(theirs, mine) if theirs is not None else None
                p = recv.add(f, i, (x[1], x[3]), _within(x, mine)) if x is not None else None
                if p is not None:
                    pieces[i].append(p)
        outs = tuple(_Out((dst(i, me)[1], dst(i, me)[3]), None, tuple(pieces[i])) for i in range(len(fulls)))
        return _Route(sig, tuple(send.splits), tuple(recv.splits), tuple(send.pieces), outs)

    route = _cached(plan, what, sig, build)
    return _execute(route, inputs, domain.flat_group, dtype, device)


def to_team(
    shards: Sequence[Tensor],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    plan: dict | None = None,
) -> list[Tensor]:
    """Every rank's :func:`team_block` of every matrix, from the ranks' shards: one ``all_to_all_single``.

    Each rank sends each peer the part of its block (:func:`local_shard` layout) that falls in the peer's team
    block; for ``partition_dim`` None only the TP-rank-0 copies are sent. A pure copy: exact for every dtype.

    Args:
        shards: this rank's block of each ``(P, Q)`` matrix, one dtype.
        partition_dims, full_shapes: per matrix, as :func:`to_homes`.
        domain: the ``R x T`` domain; the flat group carries the exchange.
        plan: a caller-owned cache of the exchange's metadata (key ``"to_team"``); reusing it for another layout
            is a ``ValueError``.

    Returns:
        Per matrix, this rank's team block (``(rows, cols)`` of :func:`team_block` with the flat rank as member),
        contiguous, the shards' dtype.

    Raises:
        ValueError (before any collective): as :func:`all_gather_full`.
    """
    p = _check_domain_inputs("to_team", shards, None, partition_dims, full_shapes, domain, "flat")
    if domain.size == 1 or not shards:
        return [x.contiguous() for x in shards]
    return _relayout("to_team", shards, p.pds, p.full, domain, True, p.dtype, p.device, plan)


def from_team(
    blocks: Sequence[Tensor],
    partition_dims: Sequence[int | None],
    full_shapes: Sequence[tuple[int, int]],
    domain: Domain,
    plan: dict | None = None,
) -> list[Tensor]:
    """The inverse of :func:`to_team`: every rank's shard (:func:`local_shard` layout) of every matrix, from the
    ranks' team blocks; for ``partition_dim`` None every TP rank gets its copy. One ``all_to_all_single``.

    Args:
        blocks: this rank's :func:`team_block` of each matrix (the flat rank as member), one dtype.
        partition_dims, full_shapes, domain, plan: as :func:`to_team` (plan key ``"from_team"``).

    Returns:
        Per matrix, this rank's block, contiguous, the blocks' dtype.

    Raises:
        ValueError (before any collective): length mismatches, a bad partition dim or full shape, a block that is
            not this rank's team block, mixed dtypes, a missing flat group.
    """
    n = len(blocks)
    if len(partition_dims) != n or len(full_shapes) != n:
        raise ValueError(f"from_team: {n} blocks, {len(partition_dims)} partition_dims, {len(full_shapes)} "
                         "full_shapes; expected one of each per matrix")
    W = domain.size
    if W > 1 and (domain.flat_group is None or dist.get_world_size(domain.flat_group) != W):
        raise ValueError(f"from_team: the {domain.remat_size}x{domain.tp_size} domain needs a flat_group of size {W}")
    meta = _common_dtype(blocks, "blocks")
    pds, fulls = [], []
    for i, x in enumerate(blocks):
        pds.append(_check_pd(partition_dims[i], i))
        fulls.append(_check_full_shape(full_shapes[i], i))
        _, nr, _, nc = team_block(fulls[i], W, domain.flat_rank)
        if tuple(x.shape) != (nr, nc):
            raise ValueError(f"from_team: block {i} has shape {tuple(x.shape)}, expected {(nr, nc)}: member "
                             f"{domain.flat_rank}'s team block of {fulls[i]} over {W} ranks")
    if W == 1 or not blocks:
        return [x.contiguous() for x in blocks]
    return _relayout("from_team", blocks, pds, fulls, domain, False, *meta, plan)
