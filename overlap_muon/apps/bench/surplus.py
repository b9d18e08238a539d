"""Bench case ``surplus``: the team NS kernel, the optimizer's surplus policies, and the simulator at 70B.

The team NS kernel alone (``overlap_muon._team_ns.team_zeropower_full``, not the optimizer): a 2048x8192 matrix
(``--quick``: 512x2048) at world 2 (gloo, 1 thread per rank), split by columns ([Note: team NS by columns]),
against ``zeropower`` of the whole matrix on rank 0 while rank 1 waits,
interleaved, each timed between barriers. ``single_over_team_world2``: single-rank latency over the column
team's (> 1: the team is faster). ``idle_over_duplicate_last_wave_world2``: the optimizer itself, one such
matrix row-sharded over TP 2 (one wave, one surplus home), ``step()`` to its last apply with
``surplus="idle"`` over ``"duplicate"`` (> 1: duplicating is faster; the details say whether both gave the
same params); ``idle_over_team_last_wave_world2`` the same with ``"team"`` (the issue's goal: >= 1.6). The
details also time the column team's matmuls alone on both ranks at once (no collectives): the compute part,
which on a shared 2-core machine shows how much the two ranks slow each other; and the exactness of the
team against ``zeropower`` (bitwise or not, max abs and relative Frobenius difference).
``sim_70b_{idle,best}_exposed_fraction``: :mod:`overlap_muon.apps.simulate` on the 70B preset (TP 8, remat 8, DP 16),
exposed optimizer fraction with idle surplus and with the best of ``duplicate`` / ``team`` / ``auto`` at
``dp_slots`` 1 and 4 (the issue's goal: <= 0.02).
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from overlap_muon._ns import zeropower
from overlap_muon._scheduler.surplus import CPU_GLOO, team_row_counts, team_splits_poly
from overlap_muon._team_ns import team_zeropower_full

from .common import _CaseResult, _max_over_ranks, _median, _ms, _Options, _ratio, _run_ranks

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("single_over_team_world2", "idle_over_duplicate_last_wave_world2",
                               "idle_over_team_last_wave_world2", "sim_70b_idle_exposed_fraction",
                               "sim_70b_best_exposed_fraction")


def _surplus_rank(rank: int, world: int, shape: tuple[int, int], steps: int, warmup: int,
                  repeats: int) -> dict[str, Any]:
    group = dist.group.WORLD
    X = torch.randn(shape, generator=torch.Generator().manual_seed(17))  # the same matrix on every rank
    x = X.mT if shape[0] > shape[1] else X
    counts = team_row_counts(x.size(1), world)
    lo = sum(counts[:rank])
    times: dict[str, list[float]] = {"single_s": [], "team_s": [], "team_compute_s": []}
    single = team = None
    split_poly = team_splits_poly(tuple(X.shape), world, CPU_GLOO)  # as the runtime decides on a CPU job
    xb = (x.bfloat16() / x.bfloat16().norm()).contiguous()
    xc = xb[:, lo : lo + counts[rank]].contiguous()
    gram = xc @ xc.mT
    for r in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            single = zeropower(X, ns_steps=steps)
        dist.barrier()  # the other ranks wait: the single-rank latency is rank 0's
        t1 = time.perf_counter()
        team = team_zeropower_full(X, group, ns_steps=steps, split_poly=split_poly)
        dist.barrier()
        t2 = time.perf_counter()
        # The column team's matmuls alone, every rank at once, no collectives: its compute under this machine's
        # contention.
        y, brows = xc, slice(sum(team_row_counts(x.size(0), world)[:rank]),
                             sum(team_row_counts(x.size(0), world)[: rank + 1]))
        for _ in range(steps):
            g = y @ y.mT
            if split_poly:  # this member's rows of b*A + c*A@A only (the all-gather is left out)
                torch.addmm(g[brows], g[brows], g, beta=-4.775, alpha=2.0315)
                y = torch.addmm(y, gram, y, beta=3.4445)
            else:
                y = torch.addmm(y, torch.addmm(gram, g, g, beta=-4.775, alpha=2.0315), y, beta=3.4445)
        dist.barrier()
        t3 = time.perf_counter()
        if r >= warmup:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2)):
                times[k].append(v)
    out: dict[str, Any] = dict(times, split_poly=split_poly)
    out.update(_last_wave_latency(rank, world, X, warmup, repeats))
    if rank == 0:
        diff = (team.float() - single.float()).abs()
        out.update({"bitwise": bool(torch.equal(team, single)), "max_abs_diff": float(diff.max()),
                    "rel_fro_diff": float(diff.norm() / single.float().norm())})
    return out


def _last_wave_latency(rank: int, world: int, X: Tensor, warmup: int, repeats: int) -> dict[str, Any]:
    """OverlapMuon on one matrix ``X`` row-sharded over a TP group of all ranks, ``overlap=False`` (one wave of one
    matrix: ``world - 1`` surplus homes), ``surplus="idle"`` vs ``"duplicate"`` vs ``"team"``, interleaved: seconds
    from ``step()`` to its last apply, per repeat; whether duplicate gives idle's params (``torch.equal``), and
    team's largest difference from them."""
    from overlap_muon import OverlapMuon
    group = dist.new_group(list(range(world)))
    nets, opts = {}, {}
    for policy in _POLICIES:
        net = torch.nn.Module()
        net.w = torch.nn.Parameter(block_of(X, rank, world).clone())
        net.w.partition_dim, net.w.full_shape = 0, tuple(X.shape)
        nets[policy] = net
        opts[policy] = OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=group, overlap=False, surplus=policy)
    times: dict[str, list[float]] = {p: [] for p in _POLICIES}
    for r in range(warmup + repeats):
        grad = block_of(torch.randn(X.shape, generator=torch.Generator().manual_seed(100 + r)), rank, world)
        for policy in _POLICIES:
            nets[policy].w.grad = grad.clone()
            dist.barrier()
            t0 = time.perf_counter()
            opts[policy].step()  # overlap=False: returns once applied
            dist.barrier()
            if r >= warmup:
                times[policy].append(time.perf_counter() - t0)
    same = torch.equal(nets["idle"].w.detach(), nets["duplicate"].w.detach())
    team_diff = float((nets["idle"].w.detach() - nets["team"].w.detach()).abs().max())
    used = all(any(w.kind in ("gathered", "team") for w in opts[p].wave_plans) for p in ("duplicate", "team"))
    for o in opts.values():
        o.close()
    return {**{f"last_wave_{p}_s": times[p] for p in _POLICIES}, "duplicate_equal": same,
            "team_max_abs_diff": team_diff, "surplus_used": used}


_POLICIES = ("idle", "duplicate", "team")


def block_of(x: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s row block of ``x`` over ``world`` ranks (``torch.chunk``)."""
    return torch.chunk(x, world, dim=0)[rank].contiguous()


def run(o: _Options) -> _CaseResult:
    import dataclasses as _dc

    from overlap_muon.apps.simulate import SimConfig, simulate

    shape = (o.side(512), o.side(2048)) if o.quick else (o.side(2048), o.side(8192))
    world, steps = 2, 5
    warmup, repeats = 1, o.reps(2, 5)
    res = _run_ranks(_surplus_rank, world, shape, steps, warmup, repeats, timeout_s=o.timeout_s)
    single = _median(_max_over_ranks([r["single_s"] for r in res]))
    team = _median(_max_over_ranks([r["team_s"] for r in res]))
    compute = _median(_max_over_ranks([r["team_compute_s"] for r in res]))
    ratio = _ratio(single, team)
    ex = res[0]
    lw_idle = _median(_max_over_ranks([r["last_wave_idle_s"] for r in res]))
    lw_dup = _median(_max_over_ranks([r["last_wave_duplicate_s"] for r in res]))
    lw_team = _median(_max_over_ranks([r["last_wave_team_s"] for r in res]))
    lw_ratio, lw_team_ratio = _ratio(lw_idle, lw_dup), _ratio(lw_idle, lw_team)
    dup_equal = all(r["duplicate_equal"] for r in res)
    team_diff = max(r["team_max_abs_diff"] for r in res)
    used = all(r["surplus_used"] for r in res)
    base = SimConfig.for_model("llama3-70b", tp_size=8, remat_size=8, dp_size=16)
    sims = {(p, d): simulate(_dc.replace(base, surplus=p, dp_slots=d))
            for p in ("idle", "duplicate", "team", "auto") for d in (1, 4)}
    idle = sims[("idle", 1)]
    best_key = min(sims, key=lambda k: sims[k].exposed_overlap_s)
    best = sims[best_key]
    lines = [
        f"team NS of one {shape[0]}x{shape[1]} matrix, world {world} (gloo, 1 thread per rank): single rank "
        f"{_ms(single).strip()}, team by columns {_ms(team).strip()}, single / team = {ratio:.3f}"
        if ratio else "unavailable",
        f"the column team's matmuls alone (both ranks at once, no collectives) {_ms(compute).strip()}: the rest of "
        f"its time, {_ms(max(0.0, team - compute)).strip()}, is its {steps} Gram all-reduces"
        + (f", {steps} all-gathers of B" if ex["split_poly"] else "") + ", the norm and the final all-gather",
        f"team vs zeropower: bitwise {ex['bitwise']}, max abs {ex['max_abs_diff']:.3g}, relative "
        f"Frobenius {ex['rel_fro_diff']:.3g}",
        f"OverlapMuon, one {shape[0]}x{shape[1]} matrix over TP {world}, step() to last apply: surplus idle "
        f"{_ms(lw_idle).strip()}, duplicate {_ms(lw_dup).strip()}, team {_ms(lw_team).strip()}; idle / duplicate = "
        + (f"{lw_ratio:.3f}" if lw_ratio else "n/a") + ", idle / team = "
        + (f"{lw_team_ratio:.3f}" if lw_team_ratio else "n/a")
        + f"; duplicate's params equal idle's: {dup_equal}; team's max abs difference {team_diff:.3g}"
        + ("" if used else " (the plan kept a policy idle: no surplus work ran)"),
        "simulator, llama3-70b TP 8 x remat 8 x DP 16: exposed optimizer time per surplus policy",
    ]
    for (p, d), r in sims.items():
        lines.append(f"  {p:>9} dp_slots {d}: last wave {_ms(r.last_wave_latency_s).strip():>10}, exposed "
                     f"{_ms(r.exposed_overlap_s).strip():>10} = {100 * r.exposed_fraction_overlap:.2f}% of the step")
    return _CaseResult(
        "surplus slots: team NS latency vs one rank (the kernel), and the simulator's policies at 70B",
        {"single_over_team_world2": ratio, "idle_over_duplicate_last_wave_world2": lw_ratio,
         "idle_over_team_last_wave_world2": lw_team_ratio,
         "sim_70b_idle_exposed_fraction": idle.exposed_fraction_overlap,
         "sim_70b_best_exposed_fraction": best.exposed_fraction_overlap},
        lines,
        {"shape": list(shape), "world": world, "ns_steps": steps, "repeats": repeats, "single_s": single,
         "team_s": team, "team_compute_s": compute,
         "last_wave_idle_s": lw_idle, "last_wave_duplicate_s": lw_dup,
         "last_wave_team_s": lw_team, "duplicate_equal": dup_equal, "team_max_abs_diff": team_diff,
         "surplus_used": used, "bitwise": ex["bitwise"], "max_abs_diff": ex["max_abs_diff"],
         "rel_fro_diff": ex["rel_fro_diff"], "sim_best": {"surplus": best_key[0], "dp_slots": best_key[1]},
         "sim": {f"{p}_dp{d}": {"last_wave_latency_s": r.last_wave_latency_s,
                                "exposed_overlap_s": r.exposed_overlap_s,
                                "exposed_fraction_overlap": r.exposed_fraction_overlap} for (p, d), r in sims.items()}},
    )
