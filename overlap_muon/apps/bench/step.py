"""Bench case ``step``: the optimizer step, layer-sharded vs duplicated, on a 1x2 TP domain.

Optimizer step (``overlap=False``) on the Muon matrices of a 12-layer transformer (d_model 256, MLP 4x:
per layer q, k, v, o ``(256, 256)``, up ``(1024, 256)``, down ``(256, 1024)``), world 2 as a 1x2 TP domain
(plain local shards with ``partition_dim``: q, k, v, up colwise 0; o, down rowwise 1; explicit groups),
gradients set directly. ``duplicated_over_layer_sharded``: step time of ``mode="duplicated"`` (all-gather,
NS of every matrix on every rank) over ``mode="layer_sharded"`` (NS once, on the matrix's home). > 1 means
layer sharding is faster. A step ends when its slowest rank ends (max over ranks per repeat).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from overlap_muon.optimizer import OverlapMuon

from .common import (_HP, _CaseResult, _max_over_ranks, _median, _ms, _muon_2d, _Options, _ratio, _run_ranks,
                     _shard_net, _timed_steps, _transformer_layer)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("duplicated_over_layer_sharded",)


def _step_rank(rank: int, world: int, layers: int, d: int, warmup: int, repeats: int) -> dict[str, Any]:
    T = world
    tp = dist.new_group(list(range(world))) if world > 1 else None
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    optimizers = {}
    for mode in ("layer_sharded", "duplicated"):
        net = _shard_net(specs, 1, T, 0, rank, seed=100 + rank)
        optimizers[mode] = OverlapMuon(net, tp_group=tp, mode=mode, overlap=False, muon_filter=_muon_2d, **_HP)
    times = _timed_steps(optimizers, warmup, repeats, barrier=True)
    ns = {m: o.stats["ns_matrices"] / max(1, o.stats["steps"]) for m, o in optimizers.items()}
    for o in optimizers.values():
        o.close()
    return {"times": times, "ns_matrices_per_step": ns}


def run(o: _Options) -> _CaseResult:
    layers = 2 if o.quick else 12
    d, world = o.side(256), 2
    warmup, repeats = (1, o.reps(5, 15))
    res = _run_ranks(_step_rank, world, layers, d, warmup, repeats, timeout_s=o.timeout_s)
    med = {m: _median(_max_over_ranks([r["times"][m] for r in res])) for m in ("layer_sharded", "duplicated")}
    ratio = _ratio(med["duplicated"], med["layer_sharded"])
    n = 6 * layers
    title = (f"optimizer step (overlap off), {layers}-layer transformer d_model {d} MLP 4x ({n} matrices), "
             f"world {world} (1x{world} TP, plain shards + explicit groups)")
    lines = []
    for m in ("layer_sharded", "duplicated"):
        per_rank = [r["ns_matrices_per_step"][m] for r in res]
        lines.append(f"{m:<16}{_ms(med[m])}   (median of {repeats}; NS on {per_rank} matrices per rank per step)")
    lines.append(f"duplicated / layer_sharded = {ratio:.3f}" if ratio else "ratio unavailable")
    return _CaseResult(
        title,
        {"duplicated_over_layer_sharded": ratio},
        lines,
        {"layers": layers, "d_model": d, "world": world, "matrices": n, "repeats": repeats, "median_s": med,
         "ns_matrices_per_rank_per_step": {m: [r["ns_matrices_per_step"][m] for r in res] for m in med},
         "samples_s": {m: _max_over_ranks([r["times"][m] for r in res]) for m in med}},
    )
