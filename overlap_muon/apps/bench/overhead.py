"""Bench case ``overhead``: the host cost of OverlapMuon's step vs ``torch.optim.Muon``'s, world 1.

3000 small matrices of 8 shapes, world 1: ``OverlapMuon.step`` (``overlap=False``, ``batch_ns`` on) vs
``torch.optim.Muon.step`` on the same tensors. ``torch_muon_over_overlap_muon``: time ratio (> 1: our host
path of planning, dispatch and shape batching is cheaper than the reference's per-matrix loop);
``torch_muon_over_overlap_muon_unbatched``: the same with ``batch_ns`` off (the dispatch cost alone).
``--py-spy`` records a flame graph of our step into ``traces/overhead_flame.svg``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from overlap_muon.optimizer import OverlapMuon

from .common import _HP, _CaseResult, _median, _ms, _muon_2d, _Options, _ratio, _shard_net, _threads, _timed_steps

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("torch_muon_over_overlap_muon", "torch_muon_over_overlap_muon_unbatched")


#: The 8 small shapes of the overhead case (wide, tall, square; several sizes).
_SMALL_SHAPES = ((16, 16), (16, 32), (32, 16), (32, 32), (8, 48), (48, 8), (24, 24), (12, 36))


def run(o: _Options) -> _CaseResult:
    n = 3000
    warmup, repeats = 1, o.reps(3, 9)
    specs = [(_SMALL_SHAPES[i % len(_SMALL_SHAPES)], None) for i in range(n)]
    with _threads(1):
        # One model per optimizer (same values and gradients): one live OverlapMuon drives a model at a time.
        def net() -> nn.Module:
            return _shard_net(specs, 1, 1, 0, 0, seed=7)

        optimizers: dict[str, Any] = {
            "overlap_muon": OverlapMuon(net(), overlap=False, batch_ns=True, muon_filter=_muon_2d, **_HP),
        }
        if o.baseline:
            optimizers["overlap_muon_unbatched"] = OverlapMuon(
                net(), overlap=False, batch_ns=False, muon_filter=_muon_2d, **_HP
            )
            optimizers["torch_muon"] = torch.optim.Muon(net().parameters(), **_HP)
        times = _timed_steps(optimizers, warmup, repeats, barrier=False)
        ns_calls = optimizers["overlap_muon"].stats["ns_calls"] / max(1, optimizers["overlap_muon"].stats["steps"])
        for k, opt in optimizers.items():
            if isinstance(opt, OverlapMuon):
                opt.close()
    med = {k: _median(v) for k, v in times.items()}
    r1 = _ratio(med.get("torch_muon"), med["overlap_muon"])
    r2 = _ratio(med.get("torch_muon"), med.get("overlap_muon_unbatched"))
    lines = [f"{k:<24}{_ms(v)}   (median of {repeats})" for k, v in med.items()]
    lines.append(f"OverlapMuon zeropower calls per step: {ns_calls:g} (shape batching), torch.optim.Muon: {n}")
    if r1 is not None:
        lines.append(f"torch_muon / overlap_muon = {r1:.3f};  torch_muon / overlap_muon_unbatched = {r2:.3f}")
    else:
        lines.append("baseline not measured (--no-baseline)")
    return _CaseResult(
        f"host overhead: {n} small matrices of {len(_SMALL_SHAPES)} shapes, world 1, overlap off",
        {"torch_muon_over_overlap_muon": r1, "torch_muon_over_overlap_muon_unbatched": r2},
        lines,
        {"matrices": n, "shapes": [list(s) for s in _SMALL_SHAPES], "repeats": repeats, "median_s": med,
         "zeropower_calls_per_step": ns_calls, "samples_s": times},
    )
