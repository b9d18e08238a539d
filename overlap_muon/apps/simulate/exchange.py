"""The exchange model: what a wave's all_to_all costs over the links of the domain, fused or node-aware."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from .config import SimConfig
from .results import ExchangeStats
from .shapes import _WIRE_BYTES



# ----------------------------------------------------------------------------------------------------------
# Exchange model


def _intra_fraction(group_size: int, stride: int, gpus_per_node: int) -> float:
    """Share of a rank's all_to_all peers on its own node, for a group whose members are ``stride`` apart."""
    if group_size <= 1:
        return 1.0
    per_node = min(group_size, max(1, gpus_per_node // stride))
    return (per_node - 1) / (group_size - 1)


def _a2a_s(cfg: SimConfig, busiest_bytes: float, group_size: int, stride: int) -> float:
    """Time of one all_to_all whose busiest rank sends or receives ``busiest_bytes``; 0 for a trivial group."""
    if group_size <= 1:
        return 0.0
    f = _intra_fraction(group_size, stride, cfg.gpus_per_node)
    t = max(busiest_bytes * f / cfg.intra_node_bytes_per_s, busiest_bytes * (1 - f) / cfg.inter_node_bytes_per_s)
    return cfg.collective_latency_s + t


def _exchange_s(cfg: SimConfig, shard_bytes: list[float], homes: list[int]) -> float:
    """One direction of a wave's exchange; ``shard_bytes[j]`` is matrix j's bf16 bytes on one rank."""
    S, R, T = cfg.domain_size, cfg.remat_size, cfg.tp_size
    total = sum(shard_bytes)
    own = [0.0] * S  # shard bytes of the matrices homed on each rank
    for b, h in zip(shard_bytes, homes):
        own[h] += b
    if cfg.fused_a2a:
        busiest = max(max(total - o for o in own), max((S - 1) * o for o in own))
        return _a2a_s(cfg, busiest, S, 1)
    # Two stages. Stage 1 over the remat group (members T apart): shards go to the home's remat coordinate g.
    own_g = [sum(own[g * T + t] for t in range(T)) for g in range(R)]
    busiest1 = max(max(total - x for x in own_g), max((R - 1) * x for x in own_g))
    # Stage 2 over the TP group: rank (g, t) now holds R shards of every matrix homed at remat coordinate g.
    send2 = max(R * (own_g[g] - own[g * T + t]) for g in range(R) for t in range(T))
    recv2 = max((T - 1) * R * o for o in own)
    return _a2a_s(cfg, busiest1, R, T) + _a2a_s(cfg, max(send2, recv2), T, 1)


def _node_aware(cfg: SimConfig) -> bool:
    """Whether the exchanges run in two hops: ``node_exchange="node_aware"`` on a domain spanning nodes."""
    return cfg.node_exchange == "node_aware" and cfg.domain_size > cfg.ranks_per_node


def _collectives_per_wave(cfg: SimConfig) -> int:
    if cfg.domain_size == 1:
        return 0
    check = int(cfg.grad_presence_check)
    if _node_aware(cfg):
        return 2 * (int(cfg.ranks_per_node > 1) + 1) + check
    if cfg.fused_a2a:
        return 2 + check
    return 2 * (int(cfg.remat_size > 1) + int(cfg.tp_size > 1)) + check


def _node_sums(own: Sequence[float], L: int) -> tuple[list[float], list[float]]:
    """``(O, C)``: ``own`` summed per node (ranks ``[n*L, (n+1)*L)``, the last may be short) and per local index."""
    O, C = [0.0] * -(-len(own) // L), [0.0] * L
    for r, o in enumerate(own):
        O[r // L] += o
        C[r % L] += o
    return O, C


@dataclass(frozen=True, slots=True)
class _Hops:
    """Busiest-rank bytes (max over ranks of sends and receives) of each hop of a node-aware wave, and the most
    bytes a rank holds between the hops (what the reorder copies)."""

    to1: float
    to2: float
    back1: float
    back2: float
    held_to: float
    held_back: float


def _node_aware_hops(own: Sequence[float], L: int) -> _Hops:
    """The table of [Note: node-aware exchange in the model], maximized over ranks; ``own[r]``: rank r's bytes."""
    N, B = len(own) // L, sum(own)
    O, C = _node_sums(own, L)
    return _Hops(
        to1=max(max(B - c, (L - 1) * c) for c in C),
        to2=max(max(L * (C[r % L] - o), (N - 1) * L * o) for r, o in enumerate(own)),
        back1=max(max((L - 1) * N * o, N * (O[r // L] - o)) for r, o in enumerate(own)),
        back2=max(max((N - 1) * x, B - x) for x in O),
        held_to=L * max(C),
        held_back=N * max(O),
    )


def _node_aware_s(cfg: SimConfig, own: Sequence[float]) -> tuple[float, float]:
    """``(to_home_s, from_home_s)`` of a node-aware wave: hop 1 (intra) + reorder + hop 2 (inter) per direction."""
    L, lat, h = cfg.ranks_per_node, cfg.collective_latency_s, _node_aware_hops(own, cfg.ranks_per_node)

    def direction(hop1: float, hop2: float, held: float) -> float:
        t = lat + hop2 / cfg.inter_node_bytes_per_s
        if L > 1:
            t += lat + hop1 / cfg.intra_node_bytes_per_s
            if cfg.elementwise_bytes_per_s is not None:
                t += 2 * held / cfg.elementwise_bytes_per_s
        return t

    return direction(h.to1, h.to2, h.held_to), direction(h.back1, h.back2, h.held_back)


def _exchange_pair_s(cfg: SimConfig, shard_bytes: list[float], homes: list[int]) -> tuple[float, float]:
    """``(to_home_s, from_home_s)`` of one replica's wave, by the config's exchange kind."""
    if not _node_aware(cfg):
        ex = _exchange_s(cfg, shard_bytes, homes)
        return ex, ex
    own = [0.0] * cfg.domain_size
    for b, h in zip(shard_bytes, homes):
        own[h] += b
    return _node_aware_s(cfg, own)


@dataclass(slots=True)
class _Traffic:
    """One wave of one replica, both directions: bytes each rank sends across and within nodes, and the sum over
    the wave's inter-node all_to_alls of the busiest rank's cross-node bytes."""

    cross: list[float]
    intra: list[float]
    busiest_inter: float


def _fused_traffic(own: Sequence[float], L: int) -> _Traffic:
    S, B = len(own), sum(own)
    O, _ = _node_sums(own, L)
    size = [min(L, S - n * L) for n in range(len(O))]  # ranks of each node (the last may be short)
    out_of_node = [B - O[r // L] for r in range(S)]  # to-home sent, from-home received, across nodes
    home_far = [(S - size[r // L]) * o for r, o in enumerate(own)]  # to-home received, from-home sent, across
    return _Traffic(
        cross=[a + b for a, b in zip(out_of_node, home_far)],
        intra=[(O[r // L] - o) + (size[r // L] - 1) * o for r, o in enumerate(own)],
        busiest_inter=2 * max(max(a, b) for a, b in zip(out_of_node, home_far)),
    )


def _node_aware_traffic(own: Sequence[float], L: int) -> _Traffic:
    N, B = len(own) // L, sum(own)
    O, C = _node_sums(own, L)
    h = _node_aware_hops(own, L)
    return _Traffic(
        cross=[L * (C[r % L] - o) + (N - 1) * O[r // L] for r, o in enumerate(own)],
        intra=[(B - C[r % L]) + (L - 1) * N * o for r, o in enumerate(own)],
        busiest_inter=h.to2 + h.back2,
    )


def _peers(homes: set[int], S: int, L: int, node_aware: bool) -> tuple[int, float]:
    """``(max, mean)`` over a replica's ranks of the peers of the step's exchanges, ``homes``: every wave's."""
    if not homes or S == 1:
        return 0, 0.0
    if not node_aware:
        k = len(homes)
        return S - 1, (k * (S - 1) + (S - k) * k) / S
    N = S // L
    locals_, nodes = {h % L for h in homes}, {h // L for h in homes}
    intra = [L - 1 if l in locals_ else len(locals_) for l in range(L)]
    inter = [N - 1 if n in nodes else len(nodes) for n in range(N)]
    return max(intra) + max(inter), sum(intra) / L + sum(inter) / N


def _exchange_stats(cfg: SimConfig, waves: Sequence[Any], shapes: Sequence[tuple[int, int]]) -> ExchangeStats:
    """:class:`ExchangeStats` of the planned waves: per-wave aggregates, ``O(S)`` per wave and replica."""
    S, D, L = cfg.domain_size, cfg.dp_slots, cfg.ranks_per_node
    node_aware = _node_aware(cfg)
    traffic = _node_aware_traffic if node_aware else _fused_traffic
    cross, intra = [0.0] * (S * D), [0.0] * (S * D)
    homes: list[set[int]] = [set() for _ in range(D)]
    busiest = 0.0
    for w in waves:
        own = [[0.0] * S for _ in range(D)]
        for i in w.params:
            d, h = divmod(w.homes[i], S)
            own[d][h] += shapes[i][0] * shapes[i][1] * _WIRE_BYTES / S
            homes[d].add(h)
        wave_busiest = 0.0
        for d in {w.homes[i] // S for i in w.params}:
            t = traffic(own[d], L)
            for r in range(S):
                cross[d * S + r] += t.cross[r]
                intra[d * S + r] += t.intra[r]
            wave_busiest = max(wave_busiest, t.busiest_inter)
        busiest += wave_busiest
    peers = [_peers(h, S, L, node_aware) for h in homes]
    return ExchangeStats(
        kind=cfg.node_exchange,
        node_homes=cfg.uses_node_homes,
        ranks_per_node=L,
        nodes=-(-S // L),
        peers_max=max(p[0] for p in peers),
        peers_mean=sum(p[1] for p in peers) / D,
        cross_node_bytes_max=max(cross),
        cross_node_bytes_total=sum(cross) / D,
        intra_node_bytes_max=max(intra),
        busiest_inter_bytes=busiest,
        collectives_per_step=len(waves) * _collectives_per_wave(cfg),
    )
