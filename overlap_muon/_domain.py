"""The weight-shard domain ``GTP = GTP_remat x TP`` and the runtime's own process groups over it.

A rank of the domain has coordinates ``(g, t)`` (``g`` in ``[0, R)``, ``t`` in ``[0, T)``) and flat index
``g*T + t`` (TP innermost). The runtime never communicates on the model's process groups: it builds its own
(``remat_group``: the R ranks sharing ``t``; ``tp_group``: the T ranks sharing ``g``; ``flat_group``: all R*T
ranks), so its exchanges cannot interleave with FSDP/DDP/TP collectives (docs/design.md §3).

Group ranks follow global-rank order (``torch.distributed.new_group`` sorts), so the builders require the
standard layout in which global ranks increase with ``g*T + t`` inside a domain; then the group rank is ``g`` in
``remat_group``, ``t`` in ``tp_group`` and ``g*T + t`` in ``flat_group``.

Which block of a matrix a rank holds is ``_layout.block``; the domains' layouts come from ``_discovery.py``; where each
param lies in its domain, ``_placement.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.distributed import ProcessGroup

__all__ = ["Domain", "NodeHops"]


@dataclass(frozen=True)
class NodeHops:
    """[Note: node-aware exchange] The groups of a domain that spans nodes, for exchanges in two hops.

    The domain's ranks lie ``ranks_per_node`` (``L``) to a node on ``nodes`` (``N``) nodes, consecutive in flat
    order: flat rank ``f`` is local index ``f % L`` of node ``f // L``. A fused exchange over the flat group makes
    every rank a peer of up to ``L*N - 1`` others; in two hops (``layer_sharded_a2a/_nodes.py``) a rank sends
    within its node to the node-mate with the destination's local index, which sends across nodes to the
    destination: at most ``(L - 1) + (N - 1)`` peers, and the same bytes arrive in the same order.
    """

    ranks_per_node: int  #: L, the domain's ranks on each node
    nodes: int  #: N >= 2, the nodes the domain spans
    intra_group: ProcessGroup | None  #: this rank's node-mates in the domain (group rank = local index); None if L=1
    inter_group: ProcessGroup  #: the domain's ranks with this rank's local index, one per node (group rank = node)


@dataclass(frozen=True)
class Domain:
    """This rank's place in the ``R x T`` weight-shard domain and the runtime's own groups over it.

    ``remat_group`` / ``tp_group`` / ``flat_group`` are ``None`` when the corresponding size is 1 (no
    communication: one code path for world size 1). Built by ``overlap_muon._comm``.
    """

    remat_size: int  #: R, the GTP_remat size
    tp_size: int  #: T, the tensor-parallel size
    remat_rank: int  #: g in [0, R)
    tp_rank: int  #: t in [0, T)
    remat_group: ProcessGroup | None = None  #: own group of the R ranks sharing t; group rank == g
    tp_group: ProcessGroup | None = None  #: own group of the T ranks sharing g; group rank == t
    flat_group: ProcessGroup | None = None  #: own group of all R*T ranks; group rank == g*T + t
    ctrl_group: ProcessGroup | None = None  #: gloo group of all R*T ranks, for host-side flags (never the device)
    nodes: NodeHops | None = None  #: two-hop groups of fused exchanges over nodes (None: one flat all_to_all)

    size: int = field(init=False)  #: R * T, the number of NS homes
    flat_rank: int = field(init=False)  #: g*T + t

    def __post_init__(self) -> None:  # fields, not properties: read on every exchange
        object.__setattr__(self, "size", self.remat_size * self.tp_size)
        object.__setattr__(self, "flat_rank", self.remat_rank * self.tp_size + self.tp_rank)

    @staticmethod
    def single() -> "Domain":
        """The 1 x 1 domain of a single process (no groups)."""
        return Domain(remat_size=1, tp_size=1, remat_rank=0, tp_rank=0)
