"""Bench case ``step``: the optimizer step, layer-sharded vs duplicated vs Gram, on a 1x2 TP domain.

Optimizer step (``overlap=False``) on the Muon matrices of a 12-layer transformer (d_model 256, MLP 4x:
per layer q, k, v, o ``(256, 256)``, up ``(1024, 256)``, down ``(256, 1024)``), world 2 as a 1x2 TP domain
(plain local shards with ``partition_dim``: q, k, v, up colwise 0; o, down rowwise 1; explicit groups),
gradients set directly. ``duplicated_over_layer_sharded``: step time of ``mode="duplicated"`` (all-gather,
NS of every matrix on every rank) over ``mode="layer_sharded"`` (NS once, on the matrix's home). > 1 means
layer sharding is faster. ``gram_once_over_layer_sharded`` and ``gram_k1_over_layer_sharded``: ``mode="gram"``
([Note: sharded Gram NS] in ``overlap_muon/gram_mode.py``: every matrix here is split along its long side or is
square, so none is gathered) with one all-reduce of each Gram (``gram_restart_every=5``) and with one per NS step
(``1``); beside them the largest difference of their params from layer sharding's (torch's bits) after the run
(their error against a float64 NS is held by ``tests/test_gram_mode.py``). A step ends when its slowest rank ends
(max over ranks per repeat).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from overlap_muon.optimizer import OverlapMuon

from .common import (_HP, _CaseResult, _max_over_ranks, _median, _ms, _muon_2d, _Options, _ratio, _run_ranks,
                     _shard_net, _timed_steps, _transformer_layer)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("duplicated_over_layer_sharded", "gram_once_over_layer_sharded",
                               "gram_k1_over_layer_sharded")

#: The variants' options.
_MODES: dict[str, dict[str, Any]] = {"layer_sharded": dict(mode="layer_sharded"), "duplicated": dict(mode="duplicated"),
                                     "gram_once": dict(mode="gram", gram_restart_every=5),
                                     "gram_k1": dict(mode="gram", gram_restart_every=1)}


def _step_rank(rank: int, world: int, layers: int, d: int, warmup: int, repeats: int) -> dict[str, Any]:
    T = world
    tp = dist.new_group(list(range(world))) if world > 1 else None
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    optimizers, nets = {}, {}
    for name, kw in _MODES.items():
        nets[name] = _shard_net(specs, 1, T, 0, rank, seed=100 + rank)
        optimizers[name] = OverlapMuon(nets[name], tp_group=tp, overlap=False, muon_filter=_muon_2d, **kw, **_HP)
    times = _timed_steps(optimizers, warmup, repeats, barrier=True)
    ns = {m: o.stats["ns_matrices"] / max(1, o.stats["steps"]) for m, o in optimizers.items()}
    ref = list(nets["layer_sharded"].parameters())
    diff = {m: max(float((p - q).abs().max()) for p, q in zip(nets[m].parameters(), ref)) for m in nets}
    for o in optimizers.values():
        o.close()
    return {"times": times, "ns_matrices_per_step": ns, "max_diff": diff}


def run(o: _Options) -> _CaseResult:
    layers = 2 if o.quick else 12
    d, world = o.side(256), 2
    warmup, repeats = (1, o.reps(5, 15))
    res = _run_ranks(_step_rank, world, layers, d, warmup, repeats, timeout_s=o.timeout_s)
    med = {m: _median(_max_over_ranks([r["times"][m] for r in res])) for m in _MODES}
    ratio = _ratio(med["duplicated"], med["layer_sharded"])
    diff = {m: max(r["max_diff"][m] for r in res) for m in _MODES}
    n = 6 * layers
    title = (f"optimizer step (overlap off), {layers}-layer transformer d_model {d} MLP 4x ({n} matrices), "
             f"world {world} (1x{world} TP, plain shards + explicit groups)")
    lines = []
    for m in _MODES:
        per_rank = [r["ns_matrices_per_step"][m] for r in res]
        lines.append(f"{m:<16}{_ms(med[m])}   x{med[m] / med['layer_sharded']:.3f}   (median of {repeats}; NS on "
                     f"{per_rank} matrices per rank per step; params differ from layer_sharded's by at most "
                     f"{diff[m]:.1e})")
    ratios = {f"{m}_over_layer_sharded": _ratio(med[m], med["layer_sharded"]) for m in _MODES if m != "layer_sharded"}
    return _CaseResult(
        title,
        ratios,
        lines,
        {"layers": layers, "d_model": d, "world": world, "matrices": n, "repeats": repeats, "median_s": med,
         "max_param_diff_from_layer_sharded": diff,
         "ns_matrices_per_rank_per_step": {m: [r["ns_matrices_per_step"][m] for r in res] for m in med},
         "samples_s": {m: _max_over_ranks([r["times"][m] for r in res]) for m in med}},
    )
