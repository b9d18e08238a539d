"""``all_gather_full``: the duplicated-mode baseline, every rank gets every full matrix."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from overlap_muon._domain import Domain

from overlap_muon._layout import block

from ._checks import _check_domain_inputs
from ._route import _block_region, _host_staged, _narrow


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
