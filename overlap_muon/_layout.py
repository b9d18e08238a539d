"""The shard-index rule: ``torch.chunk`` splits (:func:`chunk_sizes`), and which block of a full ``(P, Q)`` matrix
each rank of an ``R x T`` domain holds (:func:`block`). Every shard layout and team split of the project follows it.

Pure Python (no torch): the planner (``overlap_muon._scheduler``) imports it as well as the layout and math modules,
which in turn never import the planner (``tests/test_structure.py``)."""

from __future__ import annotations

__all__ = ["chunk_sizes", "chunk_offsets", "block", "block_shape", "team_row_counts", "GRAM_MIN_ASPECT",
           "gram_wins"]

#: Gram NS runs on a matrix whose long side is at least this many times its short side (``gram_ns=True``):
#: FLOPs per NS, plain ``(20k + 10) n^3`` vs Gram ``(8k + 28) n^3`` for an ``n x kn`` matrix and 5 steps, equal at
#: ``k = 1.5`` and 1.5x at ``k = 4``. Measured on an AMX bf16 Xeon, 1 thread: 4096^2 0.83x, 1024x4096 1.46x,
#: 2048x8192 1.45x. Below ``k = 4`` the gain is small and the error larger (384x768: 1.22-1.33 times plain NS's
#: error against float64, 512x2048: 1.17-1.21), so those shapes keep the plain iteration
#: ([Note: Gram Newton-Schulz] in ``overlap_muon/_ns.py``).
GRAM_MIN_ASPECT = 4.0


def gram_wins(shape) -> bool:
    """Whether Gram NS runs for a matrix of ``shape`` (``(..., P, Q)``): long side at least
    :data:`GRAM_MIN_ASPECT` times the short side."""
    p, q = int(shape[-2]), int(shape[-1])
    return min(p, q) > 0 and max(p, q) >= GRAM_MIN_ASPECT * min(p, q)


def chunk_sizes(n: int, parts: int) -> list[int]:
    """Sizes of ``torch.chunk(x, parts)`` along a dim of length ``n``, padded with zeros to ``parts`` entries.

    This is the split rule of DTensor ``Shard`` placements and FSDP2 ``fully_shard``: blocks of
    ``ceil(n / parts)``, the last ones partial or empty. E.g. ``chunk_sizes(5, 4) == [2, 2, 1, 0]``.
    """
    if parts <= 0:
        raise ValueError(f"parts must be positive, got {parts}")
    c = -(-n // parts) if n > 0 else 0
    out = []
    left = n
    for _ in range(parts):
        s = min(c, left)
        out.append(s)
        left -= s
    return out


def team_row_counts(m: int, k: int) -> list[int]:
    """Rows of each of ``k`` team members for an ``(m, n)`` (oriented, ``m <= n``) matrix: ``torch.chunk`` sizes.

    ``torch.chunk`` gives ``ceil(m / k)`` rows to each leading member and the rest to the last ones, some possibly
    empty (the shard layouts use the same rule). E.g. ``m=10, k=4``: ``[3, 3, 3, 1]``; ``m=2, k=3``: ``[1, 1, 0]``.

    Raises:
        ValueError: ``m < 0`` or ``k < 1``.
    """
    if isinstance(m, bool) or not isinstance(m, int) or m < 0:
        raise ValueError(f"rows must be an int >= 0, got {m!r}")
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise ValueError(f"team size must be an int >= 1, got {k!r}")
    return chunk_sizes(m, k)


def chunk_offsets(n: int, parts: int) -> list[int]:
    """Start offsets of the blocks of :func:`chunk_sizes` (``parts + 1`` entries, the last is ``n``)."""
    offs = [0]
    for s in chunk_sizes(n, parts):
        offs.append(offs[-1] + s)
    return offs


def _chunk(n: int, parts: int, i: int) -> tuple[int, int]:
    """``(offset, size)`` of block ``i`` of :func:`chunk_sizes` in O(1) (a domain of thousands of ranks asks for
    one block of every matrix)."""
    c = -(-n // parts) if n > 0 else 0
    off = min(i * c, n)
    return off, min(c, n - off)


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
        tp_off, tp_rows = _chunk(P, T, t)
        r0, rows = _chunk(tp_rows, R, g)
        return tp_off + r0, rows, 0, Q
    r0, rows = _chunk(P, R, g)
    if partition_dim == 1:
        return (r0, rows, *_chunk(Q, T, t))
    return r0, rows, 0, Q


def block_shape(
    full_shape: tuple[int, int], partition_dim: int | None, R: int, T: int, g: int, t: int
) -> tuple[int, int]:
    """``(rows, cols)`` of rank ``(g, t)``'s block (:func:`block`)."""
    _, rows, _, cols = block(full_shape, partition_dim, R, T, g, t)
    return rows, cols
