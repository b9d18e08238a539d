"""Input checks of the routing, seed-level and domain-level: all run before any collective.

[Note: validation is local] All input checks run before any collective and raise ``ValueError`` naming the
param index, its shape and the expectation. They see only this rank's inputs, so an error that exists on every
rank (a bad home map, mixed dtypes, a wrong ``dim_sizes``, results that do not match the homes) is raised on
every rank; an inconsistency between ranks that no single rank can see (e.g. uneven shards passed without
``dim_sizes``, so ranks disagree on the full length) cannot be caught without an extra collective and surfaces
as a backend error or a process-group timeout.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from overlap_muon._layout import block, chunk_sizes


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
