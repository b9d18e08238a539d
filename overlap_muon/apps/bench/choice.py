"""Bench case ``choice``: the runtime's own choices, each against what a user would have to know to pick by hand.

The ``overlap`` case's TP stack (``_tp_stack``: residual blocks of ``(d, d)``, ``(d, d)``, ``(4d, d)``, ``(d, 4d)``
plain TP shards) at world 1 and 2, in interleaved rounds of a few iterations per variant (each round ends with
``synchronize()``):

* ``auto_over_best_world{1,2}``: ``auto_overlap=True`` ([Note: overlap where it pays] in
  ``overlap_muon/_overlap_choice.py``), timed after its trial, over the faster of ``overlap=True`` and
  ``overlap=False``: 1.0 when it kept the faster one, more when its trial misjudged (the mode it kept is reported).
* ``acc4_learned_over_each_backward_world{1,2}``: an iteration of 4 micro-batches (forward, backward each) and one
  ``step()``, no ``no_sync()``: the default, which launches the waves from the backward it learned to be the last
  ([Note: learned accumulation] in ``scheduler/dispatch.py``), over ``learn_accumulation=False``, where every
  backward launches them and each later one makes them stale (NS 4 times per matrix per step; the NS calls per
  step of both are reported).
* ``acc4_reentrant_over_learned_world{1,2}``: the same 4 micro-batches with every block under a reentrant
  activation checkpoint (``checkpoint(block, x, use_reentrant=True)``, whose gradients come from nested graph
  tasks), over ``acc4_learned``: the accumulation is learned there too (NS once per matrix per step, reported).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from overlap_muon.optimizer import OverlapMuon
from overlap_muon._overlap_choice import TRIAL

from .common import (_HP, _CaseResult, _max_over_ranks, _median, _ms, _muon_2d, _Options, _ratio, _run_ranks,
                     _tp_stack)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = tuple(f"{k}_world{w}" for w in (1, 2)
                                    for k in ("auto_over_best", "acc4_learned_over_each_backward",
                                              "acc4_reentrant_over_learned"))

_VARIANTS = {"on": dict(overlap=True), "off": dict(overlap=False), "auto": dict(auto_overlap=True),
             "acc4_learned": dict(), "acc4_each": dict(learn_accumulation=False), "acc4_reentrant": dict()}


def _forward(net: torch.nn.Sequential, x: torch.Tensor, reentrant: bool) -> torch.Tensor:
    if not reentrant:
        return net(x)
    x = x.detach().requires_grad_()
    for block in net:
        x = checkpoint(block, x, use_reentrant=True)
    return x


def _choice_rank(rank: int, world: int, d: int, blocks: int, tokens: int, rounds: int, chunk: int) -> dict[str, Any]:
    group = dist.new_group(list(range(world))) if world > 1 else None
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(5))
    variants = {}
    for name, kw in _VARIANTS.items():
        net = _tp_stack(d, blocks, world, rank, group)
        variants[name] = (net, OverlapMuon(net, tp_group=group, muon_filter=_muon_2d, **kw, **_HP))

    def run_chunk(name: str, n: int) -> float:
        net, opt = variants[name]
        micro = 4 if name.startswith("acc4") else 1
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            for _ in range(micro):
                _forward(net, x, name == "acc4_reentrant").pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        return (time.perf_counter() - t0) / n

    for name in variants:  # warm-up; auto_overlap's trial (its first 2 * TRIAL + 2 steps) ends inside it
        run_chunk(name, 2 * TRIAL + 3 if name == "auto" else 1)
    ns0 = {n: (o.stats["ns_matrices"], o.stats["steps"]) for n, (_, o) in variants.items()}
    times: dict[str, list[float]] = {n: [] for n in variants}
    names = list(variants)
    for r in range(rounds):
        for n in names[r % len(names):] + names[:r % len(names)]:
            times[n].append(run_chunk(n, chunk))
    ns = {n: (o.stats["ns_matrices"] - ns0[n][0]) / max(1, o.stats["steps"] - ns0[n][1])
          for n, (_, o) in variants.items()}
    auto = variants["auto"][1].stats
    out = {"times": times, "ns_matrices_per_step": ns, "auto_chose_on": auto["overlap_auto_chose_on"],
           "auto_trial_ms": (auto["overlap_auto_on_us"] / 1e3, auto["overlap_auto_off_us"] / 1e3)}
    for _, opt in variants.values():
        opt.close()
    return out


def run(o: _Options) -> _CaseResult:
    d = o.side(256)
    blocks, tokens = (2, 128 if o.small else 512) if o.quick else (6, 1024)
    rounds, chunk = o.reps(3, 5), (1 if o.small else 2) if o.quick else 3
    ratios: dict[str, float | None] = {}
    lines, det = [], {"d_model": d, "blocks": blocks, "tokens": tokens, "rounds": rounds, "iters_per_chunk": chunk}
    for world in (1, 2):
        res = _run_ranks(_choice_rank, world, d, blocks, tokens, rounds, chunk, timeout_s=o.timeout_s)
        med = {n: _median(_max_over_ranks([r["times"][n] for r in res])) for n in _VARIANTS}
        best = min(med["on"], med["off"])
        ratios[f"auto_over_best_world{world}"] = _ratio(med["auto"], best)
        ratios[f"acc4_learned_over_each_backward_world{world}"] = _ratio(med["acc4_learned"], med["acc4_each"])
        ratios[f"acc4_reentrant_over_learned_world{world}"] = _ratio(med["acc4_reentrant"], med["acc4_learned"])
        ns = res[0]["ns_matrices_per_step"]
        det[f"world{world}"] = {"median_s": med, "ns_matrices_per_step_rank0": ns,
                                "auto_chose_on": res[0]["auto_chose_on"], "auto_trial_ms": res[0]["auto_trial_ms"]}
        on, off = res[0]["auto_trial_ms"]
        lines.append(f"world {world}: on {_ms(med['on'])}  off {_ms(med['off'])}  auto {_ms(med['auto'])} (kept "
                     f"{'on' if res[0]['auto_chose_on'] else 'off'}; its trial: on {on:.1f} ms, off {off:.1f} ms) "
                     f"-> auto / best {ratios[f'auto_over_best_world{world}']:.3f}")
        lines.append(f"         4 micro-batches per step: learned {_ms(med['acc4_learned'])} "
                     f"({ns['acc4_learned']:g} NS per step on rank 0), every backward {_ms(med['acc4_each'])} "
                     f"({ns['acc4_each']:g}) -> {ratios[f'acc4_learned_over_each_backward_world{world}']:.3f}")
        lines.append(f"         ... under reentrant checkpointing: {_ms(med['acc4_reentrant'])} "
                     f"({ns['acc4_reentrant']:g} NS per step) -> "
                     f"{ratios[f'acc4_reentrant_over_learned_world{world}']:.3f} of learned")
    return _CaseResult(f"the runtime's choices: auto_overlap, learned accumulation ({blocks} blocks d {d}, "
                       f"{tokens} tokens)", ratios, lines, det)
