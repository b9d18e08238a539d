"""Team Newton-Schulz: ``k`` ranks of a process group split one matrix's NS by rows.

[Note: team NS] ``torch.optim.Muon``'s iteration on the oriented ``X`` (``(m, n)``, ``m <= n``: tall matrices are
transposed first) is ``A = X Xᵀ; B = b*A + c*A@A; X = a*X + B@X``. Split ``X`` by rows over the team, member
``j`` holding ``X_j`` (``(m_j, n)``, ``torch.chunk`` sizes, :func:`scheduler.surplus.team_row_counts`). Row block
``j`` of each product needs only ``X_j`` or ``A_j`` on the left and a full operand on the right::

    A_j = X_j @ Xᵀ                            # (m_j, m): needs the full X
    B_j = addmm(A_j, A_j, A, beta=b, alpha=c)  # (m_j, m): needs the full A  -> all-gather A_j
    X_j = addmm(X_j, B_j, X, beta=a)           # (m_j, n): needs the full X  -> all-gather X_j (next step)

so each member does ``m_j / m`` of the FLOPs, and per step the team all-gathers ``A`` (``m*m`` elements) and, but
after the last step, ``X`` (``m*n``). The input is gathered once first, so every member normalizes the whole
matrix exactly as ``zeropower`` does (same tensor layout, so the same Frobenius norm bits).

Exactness: the norm, the division and the ``a``/``b``/``c`` epilogues are the reference's. The matmuls are row
blocks of the reference's, and a GEMM library chooses its kernel -- and the order of its fp32 accumulation -- from
the operand shapes, so a ``(m_j, n) @ (n, m)`` product may round differently from rows of the ``(m, n) @ (n, m)``
one (the same effect as ``overlap_muon.ns`` [Note: symmetric Gram]). The result is therefore NOT guaranteed bitwise
equal to :func:`overlap_muon.ns.zeropower`; ``tests/test_team_ns.py`` measures the difference and the bench's
``surplus`` case reports it with the latency.

Communication: one ``all_gather`` per gather, padded to the largest row block (gloo needs equal sizes), so
``2 * ns_steps`` all-gathers per call (``2 * ns_steps + 1`` with ``gather_result``). A ``None`` or size-1 group
does no communication (one code path for world size 1).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from scheduler.surplus import team_row_counts

from .ns import DEFAULT_NS_COEFFICIENTS, Coefficients, _schedule

__all__ = ["team_zeropower", "team_zeropower_full", "team_row_counts"]


def _team(group: dist.ProcessGroup | None) -> tuple[int, int]:
    if group is None:
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_rows(block: Tensor, counts: Sequence[int], group: dist.ProcessGroup | None) -> Tensor:
    """All-gather row blocks of uneven height into the full ``(sum(counts), cols)`` tensor (member order)."""
    k = len(counts)
    if k == 1:
        return block
    cap = max(counts)
    buf = block.new_zeros((cap, block.size(1)))
    buf[: block.size(0)] = block
    parts = [torch.empty_like(buf) for _ in range(k)]
    dist.all_gather(parts, buf, group=group)
    return torch.cat([p[:c] for p, c in zip(parts, counts)], dim=0)


def team_zeropower(
    x_rows: Tensor,
    group: dist.ProcessGroup | None,
    row_counts: Sequence[int],
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
    tall: bool = False,
    gather_result: bool = False,
) -> Tensor:
    """This member's share of NS on one matrix split by rows over ``group``; see [Note: team NS].

    Collective over ``group``: every member calls it with the same ``row_counts``, coefficients and steps.

    Args:
        x_rows: ``(row_counts[j], n)`` row block ``j`` (``j`` = this rank's index in ``group``) of the ORIENTED
            matrix ``X`` (``(m, n)``, ``m = sum(row_counts)``; for a tall ``(P, Q)`` update, ``X`` is its
            transpose), any float dtype; cast to bf16 as the reference does.
        group: the team; ``None`` or size 1 runs alone.
        row_counts: rows per member in group-rank order, e.g. :func:`team_row_counts` ``(m, k)``; zeros allowed.
        ns_coefficients, ns_steps, eps: as :func:`overlap_muon.ns.zeropower`.
        tall: the update was tall (``P > Q``) and ``X`` is its transpose: the norm is then taken on the
            ``(P, Q)`` layout, as ``zeropower`` takes it.
        gather_result: return the whole ``(m, n)`` result (one more all-gather) instead of this member's rows.

    Returns:
        bf16 ``(row_counts[j], n)`` (or ``(m, n)`` with ``gather_result``), oriented like ``X``.

    Raises:
        ValueError: ``x_rows`` is not 2-D, ``row_counts`` does not have one entry per member, has a negative
            entry, or does not match ``x_rows``'s rows; malformed coefficients or steps.
    """
    k, j = _team(group)
    counts = [int(c) for c in row_counts]
    if x_rows.ndim != 2:
        raise ValueError(f"team_zeropower expects this member's (rows, n) block, got shape {tuple(x_rows.shape)}")
    if len(counts) != k or any(c < 0 for c in counts):
        raise ValueError(f"row_counts {counts} must hold one count >= 0 per member of the team of {k}")
    if counts[j] != x_rows.size(0):
        raise ValueError(
            f"member {j} of the team holds {x_rows.size(0)} rows but row_counts[{j}] = {counts[j]} (row_counts {counts})"
        )
    steps = _schedule(ns_coefficients, ns_steps)
    full = _gather_rows(x_rows.bfloat16(), counts, group)  # (m, n)
    # The norm on zeropower's layout: it normalizes the (P, Q) tensor's transposed view when tall.
    src = full.mT.contiguous().mT if tall else full
    x = full / src.norm().clamp(min=eps)
    lo = sum(counts[:j])
    xr = x[lo : lo + counts[j]]
    for t, (a, b, c) in enumerate(steps):
        ar = xr @ x.mT  # (m_j, m)
        gram = _gather_rows(ar, counts, group)  # (m, m)
        br = torch.addmm(ar, ar, gram, beta=b, alpha=c)
        xr = torch.addmm(xr, br, x, beta=a)  # (m_j, n)
        if t + 1 < len(steps):
            x = _gather_rows(xr, counts, group)
    if gather_result:
        return _gather_rows(xr, counts, group) if steps else x
    return xr if steps else xr.clone()


def team_zeropower_full(
    X: Tensor,
    group: dist.ProcessGroup | None,
    *,
    ns_coefficients: Coefficients = DEFAULT_NS_COEFFICIENTS,
    ns_steps: int = 5,
    eps: float = 1e-7,
) -> Tensor:
    """NS of a full ``(P, Q)`` matrix that every member of ``group`` holds, split by rows over the team.

    Orients ``X`` like ``torch.optim.Muon`` (transpose when ``P > Q``), takes this member's rows
    (:func:`team_row_counts`), runs :func:`team_zeropower` with ``gather_result=True`` and turns the result back.
    Collective over ``group``.

    Args:
        X: ``(P, Q)`` float tensor, the same on every member.
        group: the team; ``None`` or size 1 runs alone.
        ns_coefficients, ns_steps, eps: as :func:`overlap_muon.ns.zeropower`.

    Returns:
        bf16 ``(P, Q)``, the same on every member.

    Raises:
        ValueError: ``X`` is not 2-D; malformed coefficients or steps.
    """
    if X.ndim != 2:
        raise ValueError(f"team_zeropower_full expects a (P, Q) matrix, got shape {tuple(X.shape)}")
    k, j = _team(group)
    tall = X.size(0) > X.size(1)
    x = X.mT if tall else X
    counts = team_row_counts(x.size(0), k)
    lo = sum(counts[:j])
    out = team_zeropower(x[lo : lo + counts[j]], group, counts, ns_coefficients=ns_coefficients,
                         ns_steps=ns_steps, eps=eps, tall=tall, gather_result=True)
    return out.mT if tall else out
