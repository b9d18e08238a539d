"""Content fingerprints: what a wave read, checked by its bytes at commit, whoever wrote it since.

[Note: content fingerprints] The records of a wave's reads (identities, version counters, wrapped collectives:
[Note: a wave's reads] in ``wave_state.py``) cannot see every writer: ``Tensor.data`` edits, memory shared through
``numpy()`` or DLPack, ``set_``, collectives reached from C++ (DDP's reducer, ``torch.ops.c10d``, a
``ProcessGroup`` method). So the pack also takes a fingerprint of the bytes it is about to read, and the commit
takes it again and re-runs the wave when the two differ.

The fingerprint of a tensor is one ``int64``: its bytes are read as 64-bit words ``x_i`` (the bytes before the first
8-byte-aligned word and a tail shorter than a word as single bytes), in blocks of ``BLOCK`` words; each block's sum
``s_b = sum_i w_i x_i`` and then ``sum_b v_b s_b`` are taken modulo ``2**64`` (two's-complement wrap-around), with
fixed pseudo-random *odd* weights ``w`` and ``v``. One pass over the data, no copy of it, on the tensor's device.

Collision odds: a write changes the words by ``d_i = x'_i - x_i``. A write that changes a single word is always
caught (``w_i`` odd, so ``w_i d_i != 0 mod 2**64``, and the same for the block sum times ``v_b``). Otherwise it
goes unseen only when ``sum_i w_i d_i = 0 mod 2**64`` in every block it touched; for weights drawn at random this
happens with probability ``2**-(63 - k)``, ``2**k`` being the largest power of two dividing every ``d_i`` of the
block: about ``2**-63`` for a write that changes values (averaging, scaling, pruning), and at worst ``2**-33`` for
a write whose every change is one high bit (a sign flip of float32 values, ``k = 31``), or ``2**-41`` for a
float32 halving (only exponents change, ``k = 23``). The comparison runs only where the records saw nothing, i.e.
for writes no record could see; at one such write per wave and step, a million steps of a thousand waves meet a
collision with odds below ``10**9 * 2**-41 < 5e-4`` in the worst structured case and ``1e-10`` for ordinary ones.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["fingerprint", "BLOCK"]

BLOCK = 4096
"""Words (8 bytes) per block: the weight vector ``w`` is this long (32 KiB per device)."""

_WEIGHTS: dict[tuple[str, int | None], tuple[Tensor, Tensor]] = {}


def _odd(n: int, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=gen) * 2 + 1
    return w.to(device)


def _weights(device: torch.device, blocks: int) -> tuple[Tensor, Tensor]:
    """``(w, v)`` on ``device``: ``BLOCK`` word weights and at least ``blocks`` block weights (grown by doubling)."""
    key = (device.type, device.index)
    have = _WEIGHTS.get(key)
    if have is None or have[1].numel() < blocks:
        n = max(blocks, 2 * have[1].numel() if have is not None else 64)
        have = _WEIGHTS[key] = (have[0] if have is not None else _odd(BLOCK, 20261204, device),
                                _odd(n, 20261205, device))
    return have


def _one(t: Tensor) -> Tensor:
    """The fingerprint of one tensor's bytes (a 0-d ``int64`` on its device)."""
    b = t.detach().contiguous().reshape(-1).view(torch.uint8)
    head = min(-b.storage_offset() % 8, b.numel())  # bytes before the first 8-aligned word (bucket views)
    n = (b.numel() - head) // 8
    words = b[head: head + n * 8].view(torch.int64)
    edges = torch.cat([b[:head], b[head + n * 8:]]).to(torch.int64)  # at most 14 single bytes
    full = n // BLOCK
    w, v = _weights(t.device, full + 2)
    sums = [(words[: full * BLOCK].view(full, BLOCK) * w).sum(1)] if full else []
    rest = words[full * BLOCK:]
    sums.append((rest * w[: rest.numel()]).sum().reshape(1))
    sums.append((edges * w[: edges.numel()]).sum().reshape(1))
    s = torch.cat(sums)
    return (s * v[: s.numel()]).sum()


def fingerprint(tensors: Sequence[Tensor | None]) -> Tensor:
    """One ``int64`` per tensor of ``tensors`` (``None``: 0), stacked: shape ``(len(tensors),)``, on the device of
    the first tensor (CPU when there is none). Every tensor must be on that device ([Note: content fingerprints])."""
    present = [t for t in tensors if t is not None]
    device = present[0].device if present else torch.device("cpu")
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack([zero if t is None else _one(t) for t in tensors]) if tensors else zero.reshape(0)
