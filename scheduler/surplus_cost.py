"""The surplus cost model: what a matrix's exchanges and NS cost when it has one home, duplicates or a team.

[Note: surplus cost model] Per matrix of full shape ``(P, Q)``, ``m = min(P, Q)``, ``n = max(P, Q)``, wire bytes
``M = P*Q*dtype_bytes``, even shards ``s = M / S`` (``S = num_ranks``):

- NS: ``scheduler.cost.ns_flops(shape, ns_steps) / ns_flops_per_s``; a team of ``k``: ``ns_steps * (4*m*m*n / k
  + 2*m**3) / (ns_flops_per_s * team_efficiency)`` plus the all-reduces: ``ns_steps`` of the Gram
  (``m*m*dtype_bytes``), each member sending and receiving ``2 * (k-1)/k`` of it (a ring), plus ``ns_steps + 1``
  latencies (the last for the norm's scalars); or, where it is faster (:func:`team_splits_poly`), ``b*A + c*A@A``
  split by rows too (``2*m**3 / k``) at the price of one all-gather of ``B`` (``(k-1)/k`` of ``m*m``) per step.
- To the homes: a home receives ``(S-1) * s`` (a team member ``(S-1) * s / k``, its column block of every shard).
- Back: a single home sends ``(S-1) * s``; a team member ``(S-1) * s / k``; a duplicate home sends ``s`` to each
  rank it serves (ranks on a node with a duplicate are served there, the rest round robin over the homes).
- A transfer of ``b_intra`` bytes to or from peers on the rank's node and ``b_inter`` to others takes
  ``latency_s + max(b_intra / intra_node_bytes_per_s, b_inter / inter_node_bytes_per_s)`` (the two links run
  concurrently; the model of ``overlap_muon.apps.simulate`` [Note: what the model assumes], item 4). Ranks are numbered
  as in the domain, ``ranks_per_node`` consecutive ranks per node.
- A matrix's estimate is ``to + NS + back`` on its busiest member; a rank's load is the sum of the estimates of
  the matrices it holds; the wave's time is the largest load. Exchanges are really one collective per wave, so
  this per-matrix sum is an estimate for choosing, not a prediction (``overlap_muon.apps.simulate`` models the wave).

The planner that uses these estimates is ``scheduler/surplus.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from .cost import _check_shape, ns_flops

__all__ = ["SurplusCostModel", "CPU_GLOO", "PROFILES", "team_splits_poly"]


@dataclass(frozen=True, kw_only=True, slots=True)
class SurplusCostModel:
    """Machine figures of the surplus cost model; see [Note: surplus cost model]. Defaults: an H200-class node.

    Raises:
        ValueError: a rate, size or latency is out of range (the message names the field).
    """

    ns_flops_per_s: float = 700e12
    """NS matmul rate of one rank, FLOP/s."""
    ns_steps: int = 5
    """Newton-Schulz iterations (``torch.optim.Muon`` default)."""
    intra_node_bytes_per_s: float = 400e9
    """Bandwidth to peers on the same node, per rank per direction, B/s (NVLink)."""
    inter_node_bytes_per_s: float = 50e9
    """Bandwidth to other nodes, per rank per direction, B/s (one 400 Gb/s NIC per GPU)."""
    ranks_per_node: int = 8
    """Consecutive domain ranks sharing a node."""
    latency_s: float = 20e-6
    """Fixed cost of one collective, seconds."""
    team_efficiency: float = 1.0
    """Fraction of the ideal ``k``-fold NS compute speed-up a team of ``k`` reaches, in (0, 1]."""
    max_team: int | None = None
    """Largest team / number of duplicate homes of one matrix; ``None``: no cap."""
    dtype_bytes: int = 2
    """Bytes per element on the wire and in the gathers (bf16)."""
    fp32_flops_per_s: float = 50e12
    """fp32 matmul rate of one rank, FLOP/s (Gram NS runs in fp32: [Note: NS strategy per weight] in
    ``strategy.py``)."""
    home_memory_bytes: float | None = None
    """Bytes one rank may spend on one whole matrix's NS (input, result, ``m x m`` products); ``None``: no cap."""

    def __post_init__(self) -> None:
        for name in ("ns_flops_per_s", "intra_node_bytes_per_s", "inter_node_bytes_per_s", "fp32_flops_per_s"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"SurplusCostModel.{name} must be a finite number > 0, got {v!r}")
        v = self.latency_s
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
            raise ValueError(f"SurplusCostModel.latency_s must be a finite number >= 0, got {v!r}")
        v = self.team_efficiency
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"SurplusCostModel.team_efficiency must be in (0, 1], got {v!r}")
        for name in ("ns_steps",):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"SurplusCostModel.{name} must be an int >= 0, got {v!r}")
        for name in ("ranks_per_node", "dtype_bytes"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"SurplusCostModel.{name} must be an int >= 1, got {v!r}")
        v = self.home_memory_bytes
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not v > 0):
            raise ValueError(f"SurplusCostModel.home_memory_bytes must be a number > 0 or None, got {v!r}")
        if self.max_team is not None and (
            isinstance(self.max_team, bool) or not isinstance(self.max_team, int) or self.max_team < 1
        ):
            raise ValueError(f"SurplusCostModel.max_team must be an int >= 1 or None, got {self.max_team!r}")


#: A CPU rank on gloo over loopback, one "node": this project's test machine (2 cores of an AMD EPYC with
#: avx512_bf16), measured by ``python -m overlap_muon.apps.strategies --measure`` (one thread's NS of 512 x 2048 and
#: fp32 matmul, gloo's 1-element all-reduce and 8 MiB all-to-all between two ranks; rounded). The runtime plans CPU
#: jobs with it, CUDA jobs with the H200-class defaults.
CPU_GLOO = SurplusCostModel(ns_flops_per_s=2.0e11, intra_node_bytes_per_s=1.4e9, inter_node_bytes_per_s=1.4e9,
                            ranks_per_node=1 << 20, latency_s=2.5e-4, fp32_flops_per_s=9.5e10)

#: Machine profiles by name (``OverlapMuonConfig.cost_model``; the strategy table of ``overlap_muon.apps.strategies``).
#: GPU figures are one rank's sustained rates, read off the vendors' spec sheets and derated by hand (about 60-70%
#: of dense bf16 peak for NS; fp32 without TF32; NVLink per direction; one NIC per GPU): order-of-magnitude planning
#: figures, not measurements. ``gb200`` / ``gb300``: an NVL72 rack is one NVLink node of 72 GPUs.
PROFILES: dict[str, SurplusCostModel] = {
    "cpu_gloo": CPU_GLOO,
    "h100": SurplusCostModel(ns_flops_per_s=600e12, fp32_flops_per_s=45e12, intra_node_bytes_per_s=370e9),
    "h200": SurplusCostModel(),
    "gb200": SurplusCostModel(ns_flops_per_s=1.4e15, fp32_flops_per_s=60e12, intra_node_bytes_per_s=800e9,
                              ranks_per_node=72),
    "gb300": SurplusCostModel(ns_flops_per_s=1.6e15, fp32_flops_per_s=60e12, intra_node_bytes_per_s=800e9,
                              inter_node_bytes_per_s=100e9, ranks_per_node=72),
}


def _link_s(intra: float, inter: float, cm: SurplusCostModel) -> float:
    if intra <= 0 and inter <= 0:
        return 0.0
    return cm.latency_s + max(intra / cm.intra_node_bytes_per_s, inter / cm.inter_node_bytes_per_s)


class _Nodes:
    """Node arithmetic of a domain of ``S`` consecutive ranks, ``rpn`` per node."""

    def __init__(self, S: int, rpn: int) -> None:
        self.S, self.rpn = S, rpn

    def node(self, r: int) -> int:
        return r // self.rpn

    def same_node_peers(self, r: int) -> int:
        """Other domain ranks on ``r``'s node."""
        lo = self.node(r) * self.rpn
        return min(self.S, lo + self.rpn) - lo - 1


def _dup_served(ranks: Sequence[int], nodes: _Nodes) -> list[list[int]]:
    """Per duplicate home, the other ranks it sends results to (same node first, the rest round robin)."""
    home_on = {}
    for j, h in enumerate(ranks):
        home_on.setdefault(nodes.node(h), j)
    served: list[list[int]] = [[] for _ in ranks]
    rr = 0
    members = set(ranks)
    for r in range(nodes.S):
        if r in members:
            continue
        j = home_on.get(nodes.node(r))
        if j is None:
            j = rr % len(ranks)
            rr += 1
        served[j].append(r)
    return served


def _estimate_parts(shape: tuple[int, int], kind: str, ranks: Sequence[int], nodes: _Nodes,
                    cm: SurplusCostModel) -> list[tuple[float, float, float]]:
    """Per member of ``ranks``: ``(to-home, NS lane, back)`` seconds; see [Note: surplus cost model]."""
    p, q = shape
    S, k = nodes.S, len(ranks)
    M = p * q * cm.dtype_bytes
    s = M / S
    ns = ns_flops((p, q), cm.ns_steps) / cm.ns_flops_per_s
    served = _dup_served(ranks, nodes) if kind == "duplicate" else None
    out = []
    for j, h in enumerate(ranks):
        share = 1.0 / k if kind == "team" else 1.0
        intra_peers = nodes.same_node_peers(h)
        inter_peers = S - 1 - intra_peers
        to = _link_s(intra_peers * s * share, inter_peers * s * share, cm)
        if served is not None:
            same = sum(1 for r in served[j] if nodes.node(r) == nodes.node(h))
            back = _link_s(same * s, (len(served[j]) - same) * s, cm)
        else:
            back = _link_s(intra_peers * s * share, inter_peers * s * share, cm)
        work = ns
        if kind == "team" and k > 1:
            peers_same = sum(1 for g in ranks if g != h and nodes.node(g) == nodes.node(h))
            work = _team_ns_s((p, q), k, peers_same / (k - 1), cm)[0]
        out.append((to, work, back))
    return out


def _team_ns_s(shape: tuple[int, int], k: int, frac_same: float, cm: SurplusCostModel) -> tuple[float, bool]:
    """Seconds of a ``k``-member team's NS of one matrix (compute + all-reduces, [Note: surplus cost model]) and
    whether splitting ``b*A + c*A@A`` by rows (plus one all-gather of ``B`` per step) is the faster way."""
    m, n = min(shape), max(shape)
    rate = cm.ns_flops_per_s * cm.team_efficiency

    def link(nbytes: float) -> float:
        return max(nbytes * frac_same / cm.intra_node_bytes_per_s, nbytes * (1 - frac_same) / cm.inter_node_bytes_per_s)

    gram = m * m * cm.dtype_bytes
    base = cm.ns_steps * (4 * m * m * n / k / rate + cm.latency_s + link(2 * gram * (k - 1) / k)) + cm.latency_s
    whole = base + cm.ns_steps * 2 * m ** 3 / rate
    split = base + cm.ns_steps * (2 * m ** 3 / k / rate + cm.latency_s + link(gram * (k - 1) / k))
    return (split, True) if split < whole else (whole, False)


def team_splits_poly(shape: tuple[int, int], k: int, cost_model: SurplusCostModel | None = None) -> bool:
    """Whether a team of ``k`` (on one node) should split ``B = b*A + c*A@A`` by rows and all-gather it, rather
    than have every member compute all of it (``overlap_muon._team_ns`` [Note: team NS by columns]): the
    ``2*m**3 * (k-1)/k`` FLOPs saved per step against one all-gather of ``(k-1)/k`` of the ``m x m`` ``B``."""
    _check_shape(shape)
    return k > 1 and _team_ns_s(tuple(shape), k, 1.0, cost_model or SurplusCostModel())[1]


def _estimate(shape: tuple[int, int], kind: str, ranks: Sequence[int], nodes: _Nodes, cm: SurplusCostModel) -> float:
    return max(a + b + c for a, b, c in _estimate_parts(shape, kind, ranks, nodes, cm))
