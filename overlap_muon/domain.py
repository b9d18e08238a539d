"""The weight-shard domain ``GTP = GTP_remat x TP`` and the runtime's own process groups over it.

A rank of the domain has coordinates ``(g, t)`` (``g`` in ``[0, R)``, ``t`` in ``[0, T)``) and flat index
``g*T + t`` (TP innermost). The runtime never communicates on the model's process groups: it builds its own
(``remat_group``: the R ranks sharing ``t``; ``tp_group``: the T ranks sharing ``g``; ``flat_group``: all R*T
ranks), so its exchanges cannot interleave with FSDP/DDP/TP collectives (DESIGN.md section 3).

Group ranks follow global-rank order (``torch.distributed.new_group`` sorts), so the builders require the
standard layout in which global ranks increase with ``g*T + t`` inside a domain; then the group rank is ``g`` in
``remat_group``, ``t`` in ``tp_group`` and ``g*T + t`` in ``flat_group``.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch.distributed as dist
from torch.distributed import ProcessGroup

__all__ = ["Domain", "chunk_sizes", "chunk_offsets"]


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


def chunk_offsets(n: int, parts: int) -> list[int]:
    """Start offsets of the blocks of :func:`chunk_sizes` (``parts + 1`` entries, the last is ``n``)."""
    offs = [0]
    for s in chunk_sizes(n, parts):
        offs.append(offs[-1] + s)
    return offs


@dataclass(frozen=True)
class Domain:
    """This rank's place in the ``R x T`` weight-shard domain and the runtime's own groups over it.

    ``remat_group`` / ``tp_group`` / ``flat_group`` are ``None`` when the corresponding size is 1 (no
    communication: STYLE.md "one code path for world size 1").
    """

    remat_size: int  #: R, the GTP_remat size
    tp_size: int  #: T, the tensor-parallel size
    remat_rank: int  #: g in [0, R)
    tp_rank: int  #: t in [0, T)
    remat_group: ProcessGroup | None = None  #: own group of the R ranks sharing t; group rank == g
    tp_group: ProcessGroup | None = None  #: own group of the T ranks sharing g; group rank == t
    flat_group: ProcessGroup | None = None  #: own group of all R*T ranks; group rank == g*T + t

    @property
    def size(self) -> int:
        """R * T, the number of NS homes."""
        return self.remat_size * self.tp_size

    @property
    def flat_rank(self) -> int:
        """g*T + t."""
        return self.remat_rank * self.tp_size + self.tp_rank

    def coords(self, flat: int) -> tuple[int, int]:
        """``(g, t)`` of flat index ``flat``."""
        return divmod(flat, self.tp_size)

    @staticmethod
    def single() -> "Domain":
        """The 1 x 1 domain of a single process (no groups)."""
        return Domain(remat_size=1, tp_size=1, remat_rank=0, tp_rank=0)

    @staticmethod
    def from_global_ranks(
        layout: list[list[int]],
        *,
        timeout: datetime.timedelta | None = None,
    ) -> "Domain":
        """Build a domain from ``layout[g][t] = global rank`` of this rank's domain.

        Creates the runtime's own groups with ``dist.new_group``. Every rank of the default group must call
        this with the layouts of all domains in the same order, which :meth:`from_all_layouts` guarantees.
        """
        return Domain.from_all_layouts([layout], timeout=timeout)

    @staticmethod
    def from_all_layouts(
        layouts: list[list[list[int]]],
        *,
        timeout: datetime.timedelta | None = None,
    ) -> "Domain":
        """Build this rank's domain given every domain's ``layout[g][t] = global rank`` (identical on all ranks).

        ``new_group`` is collective over the default group, so all ranks create all groups in one order.

        Raises:
            ValueError: a layout is not rectangular, ranks repeat, this rank is in no layout, or global ranks
                do not increase with ``g*T + t`` (group ranks would not match the coordinates).
        """
        me = dist.get_rank() if dist.is_initialized() else 0
        mine = None
        seen: set[int] = set()
        for layout in layouts:
            R = len(layout)
            T = len(layout[0]) if R else 0
            if R == 0 or T == 0 or any(len(row) != T for row in layout):
                raise ValueError(f"domain layout {layout} is not a rectangular R x T grid of global ranks")
            flat = [r for row in layout for r in row]
            if flat != sorted(flat) or len(set(flat)) != len(flat):
                raise ValueError(
                    f"domain layout {layout}: global ranks must be distinct and increase with g*T + t "
                    "(TP innermost), the layout of init_device_mesh(..., ('remat', 'tp'))"
                )
            if seen & set(flat):
                raise ValueError(f"domain layouts overlap on ranks {sorted(seen & set(flat))}")
            seen |= set(flat)
            for g, row in enumerate(layout):
                for t, r in enumerate(row):
                    if r == me:
                        mine = (layout, g, t)
        if mine is None:
            raise ValueError(f"rank {me} is in none of the domain layouts {layouts}")
        kw = {} if timeout is None else {"timeout": timeout}
        groups: dict[tuple[str, tuple[int, ...]], ProcessGroup] = {}

        def make(kind: str, ranks: list[int]) -> None:
            if len(ranks) > 1:
                groups[(kind, tuple(ranks))] = dist.new_group(ranks=ranks, **kw)

        for layout in layouts:
            R, T = len(layout), len(layout[0])
            for t in range(T):
                make("remat", [layout[g][t] for g in range(R)])
            for g in range(R):
                make("tp", list(layout[g]))
            make("flat", [r for row in layout for r in row])
        layout, g, t = mine
        R, T = len(layout), len(layout[0])
        return Domain(
            remat_size=R,
            tp_size=T,
            remat_rank=g,
            tp_rank=t,
            remat_group=groups.get(("remat", tuple(layout[gg][t] for gg in range(R)))),
            tp_group=groups.get(("tp", tuple(layout[g]))),
            flat_group=groups.get(("flat", tuple(r for row in layout for r in row))),
        )
