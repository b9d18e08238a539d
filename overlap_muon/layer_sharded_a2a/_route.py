"""The parts of every exchange: plan records, the packer, the plan cache, execution (one ``all_to_all_single``).

Every exchange is split into a *plan* (pure metadata: split sizes, buffer offsets, the region of each piece;
a function of shapes, homes and group coordinates only, cached in a caller-owned ``plan`` dict) and an
*execution* (pack into one flat send buffer, one ``all_to_all_single``, unpack by copies or views).

[Note: transport as bytes] Send and receive buffers are allocated in the data's dtype and handed to the
collective as ``uint8`` views, with split sizes in bytes. The exchange is a pure copy, so this is exact for every
dtype, and no backend ever sees a dtype it lacks. (Viewing bf16/fp16 as int16 is *not* enough: gloo in torch
2.13 rejects int16 in ``all_to_all_single`` with "Invalid scalar type", while it accepts uint8.)

[Note: results may alias] Where no data moves (a trivial group, ``None`` or size 1; the home's own copy of a
replicated ``shard_dim=None`` param), a result is the input itself, or its ``.contiguous()`` copy when the input is
a non-contiguous view. A result received as one whole piece is a view into the receive buffer. Callers that mutate
results in place must copy first.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


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


def _block_region(b: tuple[int, int, int, int]) -> _Region:
    return ((0, b[0], b[1]), (1, b[2], b[3]))


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


# [Note: reserved exchange buffers] On CPU a flat buffer of a few MB allocated afresh every step comes from the C
# allocator's mmap and is returned to the OS when freed, so every step pays its page faults again: 6-8% of a
# synchronous step in the peers bench (98 vs 105 ms with glibc's mmap threshold raised). The runtime therefore
# keeps each routed exchange's send and receive buffers, assembled matrices and rows-first input copies
# (:func:`_rows_first`) per (direction, wave, params), as torchtitan's DistMuon reserves its buffers. Safe because a
# wave's next use of them comes after its previous results are dead: the next launch of a wave waits for the apply
# of the last one (its momentum writers), and a re-run follows its discarded launch on the same FIFO lanes (the
# discarded one's results are dropped). Results then alias the reserved buffers ([Note: results may alias]); the
# public routing API allocates afresh.


def _buffer(buffers: dict | None, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> Tensor:
    """A flat buffer: fresh, or (``buffers`` given) the one kept there under ``name`` from an earlier call."""
    if buffers is None:
        return torch.empty(numel, dtype=dtype, device=device)
    b = buffers.get(name)
    if b is None or b.numel() != numel or b.dtype != dtype or b.device != device:
        b = buffers[name] = torch.empty(numel, dtype=dtype, device=device)
    return b


def _all_to_all(recv: Tensor, send: Tensor, recv_splits: Sequence[int], send_splits: Sequence[int],
                group: ProcessGroup | None) -> None:
    """One ``all_to_all_single`` of flat buffers, split sizes in elements ([Note: transport as bytes]; through
    host memory where the group cannot take the device's tensors)."""
    es = send.element_size()
    staged = _host_staged(group, send.device)
    wire_recv = recv.cpu() if staged else recv
    dist.all_to_all_single(
        wire_recv.view(torch.uint8),
        (send.cpu() if staged else send).view(torch.uint8),
        output_split_sizes=[s * es for s in recv_splits],
        input_split_sizes=[s * es for s in send_splits],
        group=group,
    )
    if staged:
        recv.copy_(wire_recv)


def _rows_first(x: Tensor, buffers: dict | None, name: str) -> Tensor:
    """``x``, or on CPU, where ``x`` is the transpose of a contiguous matrix (a tall matrix's NS result), a contiguous
    copy of it (kept in ``buffers`` under ``name``): torch copies a whole transpose with its blocked transposing
    kernel, while a block of the transposed view copies element by element, several times slower."""
    if x.device.type != "cpu" or x.dim() != 2 or x.is_contiguous() or x.stride() != (1, x.size(0)):
        return x
    if x.numel() < 1 << 15:  # below 32768 elements its blocks copy about as fast strided
        return x
    return _buffer(buffers, name, x.numel(), x.dtype, x.device).view(x.shape).copy_(x)


def _execute(
    route: _Route,
    inputs: Sequence[Tensor],
    group: ProcessGroup,
    dtype: torch.dtype,
    device: torch.device,
    buffers: dict | None = None,
    hops: Any = None,
) -> list[Tensor]:
    """Run one planned exchange: pack ``inputs`` into a flat buffer, exchange it, build the results.

    ``buffers``: keep the send and receive buffers and the assembled results there and reuse them at the next
    call with this dict ([Note: reserved exchange buffers]): the previous call's results are overwritten then.
    ``hops``: the route's two-hop transport over nodes (``_nodes.TwoHops``, [Note: node-aware exchange] in
    ``overlap_muon/_domain.py``) instead of one ``all_to_all_single`` over ``group``; the results are the same."""
    with torch.no_grad():
        inputs = [_rows_first(x, buffers, f"in{k}") for k, x in enumerate(inputs)]
        send = _buffer(buffers, "send", sum(route.send_splits), dtype, device)
        for p in route.sends if hops is None else hops.sends:
            send[p.offset : p.offset + _numel(p.shape)].view(p.shape).copy_(_narrow(inputs[p.tensor], p.region))
        recv = _buffer(buffers, "recv", sum(route.recv_splits), dtype, device)
        if hops is None:
            _all_to_all(recv, send, route.recv_splits, route.send_splits, group)
        else:
            hops.run(send, recv, buffers)
        del send
        results = []
        for j, out in enumerate(route.outs):
            if out.local is not None:
                results.append(inputs[out.local].contiguous())
            elif len(out.pieces) == 1 and _numel(out.pieces[0].shape) == _numel(out.shape):
                p = out.pieces[0]
                results.append(recv[p.offset : p.offset + _numel(p.shape)].view(out.shape))
            else:
                full = _buffer(buffers, f"out{j}", _numel(out.shape), dtype, device).view(out.shape)
                for p in out.pieces:
                    _narrow(full, p.region).copy_(recv[p.offset : p.offset + _numel(p.shape)].view(p.shape))
                results.append(full)
        return results
