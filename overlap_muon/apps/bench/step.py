"""Bench case ``step``: the optimizer step, layer-sharded vs duplicated vs Gram, on 1x2 and 1x4 TP domains.

Optimizer step (``overlap=False``) on the Muon matrices of a 12-layer transformer (d_model 256, MLP 4x: per layer
q, k, v, o ``(256, 256)``, up ``(1024, 256)``, down ``(256, 1024)``), world 2 as a 1x2 TP domain and world 4 as 1x4
(plain local shards with ``partition_dim``: q, k, v, up colwise 0; o, down rowwise 1;
explicit groups), gradients set directly. ``duplicated_over_layer_sharded``: step time of ``mode="duplicated"``
(all-gather, NS of every matrix on every rank) over ``mode="layer_sharded"`` (NS once, on the matrix's home); > 1
means layer sharding is faster. ``gram_once_over_layer_sharded`` and ``gram_k1_over_layer_sharded``:
``mode="gram"`` ([Note: sharded Gram NS] in ``overlap_muon/_gram_mode.py``: every matrix here is split along its
long side or is square, so none is gathered) with one all-reduce of each Gram (``gram_restart_every=5``) and with
one per NS step (``1``); ``..._world4``: the same at world 4. Beside the times, each variant's error against
``torch.optim.Muon``'s arithmetic in float64 after the run (``||p - p64|| / ||p64 - p0||``: relative to what the
steps moved the params). A step ends when its slowest rank ends (max over ranks per repeat).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from overlap_muon._ns import DEFAULT_NS_COEFFICIENTS, adjusted_lr
from overlap_muon.optimizer import OverlapMuon

from .common import (_HP, _CaseResult, _max_over_ranks, _median, _ms, _muon_2d, _Options, _ratio, _run_ranks,
                     _shard_net, _timed_steps, _transformer_layer)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = tuple(f"{m}_over_layer_sharded{w}" for w in ("", "_world4")
                                    for m in ("duplicated", "gram_once", "gram_k1"))

#: The variants' options.
_MODES: dict[str, dict[str, Any]] = {"layer_sharded": dict(mode="layer_sharded"), "duplicated": dict(mode="duplicated"),
                                     "gram_once": dict(mode="gram", gram_restart_every=5),
                                     "gram_k1": dict(mode="gram", gram_restart_every=1)}


def ns_float64(x: Tensor, steps: int = 5) -> Tensor:
    """torch.optim.Muon's NS of a ``(P, Q)`` matrix in float64 (its default coefficients; a tall one transposed):
    the reference the errors are measured against (also ``tests/test_gram_mode.py``'s)."""
    a, b, c = DEFAULT_NS_COEFFICIENTS
    x = x.double()
    tall = x.size(0) > x.size(1)
    x = (x.T if tall else x) / x.norm().clamp(min=1e-7)
    for _ in range(steps):
        A = x @ x.T
        x = a * x + (b * A + c * A @ A) @ x
    return x.T if tall else x


def _full(t: Tensor, pd: int, group: Any, world: int) -> Tensor:
    """The full matrix of a rank's block (the ranks' blocks in order along ``pd``)."""
    if world == 1:
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.detach().contiguous(), group=group)
    return torch.cat(parts, dim=pd)


def _errors(nets: dict[str, nn.Module], start: list[tuple[Tensor, Tensor]], pds: list[int], steps: int, group: Any,
            world: int, rank: int) -> dict[str, float] | None:
    """Rank 0: each variant's params after ``steps`` steps against ``torch.optim.Muon``'s arithmetic in float64
    from the same start, ``||p - p64|| / ||p64 - p0||`` over every matrix (the error relative to what the steps
    moved); other ranks ``None``."""
    finals = {m: [_full(p, pd, group, world) for p, pd in zip(net.parameters(), pds)] for m, net in nets.items()}
    if rank:
        return None
    hp = _HP
    num = {m: 0.0 for m in nets}
    den = 0.0
    for j, (p0, g) in enumerate(start):
        p, buf = p0.double(), torch.zeros_like(g, dtype=torch.float64)
        for _ in range(steps):
            buf.lerp_(g.double(), 1 - hp["momentum"])
            u = g.double().lerp(buf, hp["momentum"]) if hp["nesterov"] else buf
            p = p * (1 - hp["lr"] * hp["weight_decay"]) - adjusted_lr(hp["lr"], None, p.shape) * ns_float64(u)
        den += float((p - p0.double()).norm() ** 2)
        for m in nets:
            num[m] += float((finals[m][j].double() - p).norm() ** 2)
    return {m: (num[m] / den) ** 0.5 for m in nets}


def _step_rank(rank: int, world: int, layers: int, d: int, warmup: int, repeats: int) -> dict[str, Any]:
    T = world
    tp = dist.new_group(list(range(world))) if world > 1 else None
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    optimizers, nets = {}, {}
    for name, kw in _MODES.items():
        nets[name] = _shard_net(specs, 1, T, 0, rank, seed=100 + rank)
        optimizers[name] = OverlapMuon(nets[name], tp_group=tp, overlap=False, muon_filter=_muon_2d, **kw, **_HP)
    pds = [pd for _, pd in specs]
    start = [(_full(p, pd, tp, world), _full(p.grad, pd, tp, world))
             for p, pd in zip(nets["layer_sharded"].parameters(), pds)]
    times = _timed_steps(optimizers, warmup, repeats, barrier=True)
    ns = {m: o.stats["ns_matrices"] / max(1, o.stats["steps"]) for m, o in optimizers.items()}
    errors = _errors(nets, start, pds, warmup + repeats, tp, world, rank)
    for o in optimizers.values():
        o.close()
    return {"times": times, "ns_matrices_per_step": ns, "errors": errors}


def run(o: _Options) -> _CaseResult:
    layers = 2 if o.quick else 12
    d = o.side(256)
    warmup, repeats = (1, o.reps(5, 15))
    ratios: dict[str, float | None] = {}
    lines, det = [], {"layers": layers, "d_model": d, "matrices": 6 * layers, "repeats": repeats}
    for world in (2, 4):
        res = _run_ranks(_step_rank, world, layers, d, warmup, repeats, timeout_s=o.timeout_s)
        med = {m: _median(_max_over_ranks([r["times"][m] for r in res])) for m in _MODES}
        err = res[0]["errors"]
        suffix = "" if world == 2 else "_world4"
        ratios.update({f"{m}_over_layer_sharded{suffix}": _ratio(med[m], med["layer_sharded"])
                       for m in _MODES if m != "layer_sharded"})
        lines.append(f"world {world} (1x{world} TP):")
        for m in _MODES:
            per_rank = [r["ns_matrices_per_step"][m] for r in res]
            lines.append(f"  {m:<14}{_ms(med[m])}   x{med[m] / med['layer_sharded']:.3f}   error against float64 "
                         f"{err[m]:.2e}   (median of {repeats}; NS on {per_rank} matrices per rank per step)")
        det[f"world{world}"] = {"median_s": med, "errors_vs_float64": err,
                                "ns_matrices_per_rank_per_step": {m: [r["ns_matrices_per_step"][m] for r in res]
                                                                  for m in _MODES},
                                "samples_s": {m: _max_over_ranks([r["times"][m] for r in res]) for m in _MODES}}
    title = (f"optimizer step (overlap off), {layers}-layer transformer d_model {d} MLP 4x ({6 * layers} matrices), "
             "world 2 and 4 (1xN TP, plain shards + explicit groups); error: ||p - p64|| / ||p64 - p0|| after the "
             "run")
    return _CaseResult(title, ratios, lines, det)
