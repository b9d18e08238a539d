"""The ``torch.chunk`` split rule, the one every shard layout and team split of the project follows."""

from __future__ import annotations

__all__ = ["chunk_sizes"]


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
