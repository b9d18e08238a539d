"""The NS strategy table: each strategy's step estimate per layout, and what ``mode="auto"`` picks.

Per layout, the estimate of [Note: NS strategy per weight] (``overlap_muon/scheduler/strategy.py``) of one
optimizer step's NS work and exchanges with every weight at its home (layer-sharded), every weight duplicated,
every Gram-able weight in Gram space (the others at their homes), and ``mode="auto"``'s picks, exact (home and
duplicated) and with inexact NS allowed (Gram too); then how many weights each auto pick took::

    python -m overlap_muon.apps.strategies                         # llama3-70b and the MoE preset, 8 to 8192 GPUs
    python -m overlap_muon.apps.strategies --profile gb300 --gb300  # the 32-GPU GB300-class configuration
    python -m overlap_muon.apps.strategies --profile cpu_gloo --json traces/strategies.json
    python -m overlap_muon.apps.strategies --measure                # this machine's cpu_gloo figures

Layouts (the weight-shard domain of a weight is its FSDP/remat x TP ranks; DP replicas repeat its work):

- dense models: TP 8 within a node (column-parallel q, k, v, gate, up; row-parallel o, down), FSDP over the other
  ranks, so the domain is the job (within one node at 8 GPUs, across nodes beyond); and "TP 8 + DP", a domain of
  one node whatever the job's size;
- the MoE preset: attention over a TP 2 x FSDP domain of the whole job; experts EP ``min(N/2, E)`` x expert TP 2,
  the remaining factor expert FSDP, so an expert's domain is its expert TP x expert FSDP ranks;
- ``--gb300``: 32 GPUs of an NVL72 rack: the MoE preset with attention TP 2 x remat 8 (DP 2) and experts EP 8 x
  expert TP 2 (x expert FSDP 2), and llama3-70b with TP 2 x remat 8 (DP 2).

A matrix is Gram-able where its shards split only its long side (the runtime's ``_gram_mode.gram_orientations``).
Estimates are planning figures of the cost model, not measurements.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from overlap_muon._scheduler.strategy import pick_strategies, step_estimate
from overlap_muon._scheduler.surplus_cost import PROFILES, SurplusCostModel

from .simulate import MODEL_PRESETS

__all__ = ["MoEShape", "MOE_PRESETS", "Layout", "layouts", "table_rows", "measure_cpu_gloo", "main"]


@dataclass(frozen=True, kw_only=True, slots=True)
class MoEShape:
    """Published dimensions of a mixture-of-experts decoder (grouped-query attention, gated-MLP experts)."""

    name: str
    num_layers: int
    d_model: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int
    expert_ffn: int
    source: str = ""

    def attention(self) -> list[tuple[tuple[int, int], int]]:
        """One layer's attention matrices: ``((out, in), TP partition dim)``."""
        d, q, kv = self.d_model, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return [((q, d), 0), ((kv, d), 0), ((kv, d), 0), ((d, q), 1)]

    def expert(self) -> list[tuple[tuple[int, int], int]]:
        """One expert's matrices (gate, up, down)."""
        d, f = self.d_model, self.expert_ffn
        return [((f, d), 0), ((f, d), 0), ((d, f), 1)]


#: Built-in MoE presets, by name.
MOE_PRESETS = {"qwen3-30b-a3b": MoEShape(
    name="qwen3-30b-a3b", num_layers=48, d_model=2048, num_heads=32, num_kv_heads=4, head_dim=128, num_experts=128,
    expert_ffn=768, source="Qwen3-30B-A3B's published config.json (hidden 2048, 48 layers, 128 experts of 768)")}


@dataclass(frozen=True, slots=True)
class Domain:
    """Weights sharded over ``tp x remat`` ranks: ``(full shape, TP partition dim)`` each."""

    weights: list[tuple[tuple[int, int], int]]
    tp: int
    remat: int

    @property
    def size(self) -> int:
        return self.tp * self.remat

    def gram_ok(self) -> dict[int, bool]:
        """The weights whose shards split only their long side: the runtime's own rule
        (``_gram_mode.gram_orientations``) on stand-ins of the weights."""
        from types import SimpleNamespace

        from overlap_muon._gram_mode import gram_orientations

        stand_ins = [SimpleNamespace(index=j, full_shape=sh, partition_dim=pd, domain=0, replicated=False,
                                     transposed=False, parts=None, expert=None)
                     for j, (sh, pd) in enumerate(self.weights)]
        return gram_orientations(stand_ins, self.remat, self.tp)


@dataclass(frozen=True, slots=True)
class Layout:
    """One row of the table: a name, the GPUs, and its domains (every rank runs each domain's share in turn)."""

    model: str
    gpus: int
    name: str
    domains: list[Domain]


def _dense(name: str, gpus: int, tp: int, dp: int) -> Layout:
    shape = MODEL_PRESETS[name]
    pds = {"wq": 0, "wk": 0, "wv": 0, "wo": 1, "w_gate": 0, "w_up": 0, "w_down": 1}
    weights = [(sh, pds[n]) for n, sh in shape.layer_matrices()] * shape.num_layers
    tp = min(tp, gpus)
    return Layout(name, gpus, f"TP {tp} x FSDP {gpus // tp // dp}" + (f" (DP {dp})" if dp > 1 else ""),
                  [Domain(weights, tp, gpus // tp // dp)])


def _moe(m: MoEShape, gpus: int, tp: int, ep: int, etp: int, remat: int | None = None) -> Layout:
    remat = remat or gpus // tp
    attention = Domain(m.attention() * m.num_layers, tp, remat)
    experts = Domain(m.expert() * (m.num_experts // ep) * m.num_layers, etp, gpus // ep // etp)
    dp = gpus // tp // remat
    return Layout(m.name, gpus, f"attention TP {tp} x FSDP {remat}" + (f" (DP {dp})" if dp > 1 else "")
                  + f"; experts EP {ep} x ETP {etp} x EFSDP {gpus // ep // etp}", [attention, experts])


def layouts(gb300: bool = False) -> list[Layout]:
    """The table's rows (module docstring)."""
    moe = MOE_PRESETS["qwen3-30b-a3b"]
    if gb300:
        return [_moe(moe, 32, 2, 8, 2, remat=8), _dense("llama3-70b", 32, 2, 2)]
    rows = []
    for gpus in (8, 64, 512, 8192):
        rows.append(_dense("llama3-70b", gpus, 8, 1))
    rows.append(_dense("llama3-70b", 64, 8, 8))
    for gpus in (8, 64, 512, 8192):
        rows.append(_moe(moe, gpus, 2, min(gpus // 2, moe.num_experts), 2))
    return rows


def _estimate(d: Domain, cm: SurplusCostModel, picks: Sequence[str]) -> float:
    est = step_estimate([sh for sh, _ in d.weights], d.size, cm, picks)
    assert est is not None
    return est


def table_rows(cm: SurplusCostModel, gb300: bool = False) -> list[dict]:
    """One dict per layout: estimates in ms (``home``, ``duplicated``, ``gram``, ``auto``, ``auto_inexact``) and
    the picks of both autos."""
    out = []
    for lay in layouts(gb300):
        est = {k: 0.0 for k in ("home", "duplicated", "gram", "auto", "auto_inexact")}
        counts = {"auto": {}, "auto_inexact": {}}
        for d in lay.domains:
            shapes, ok = [sh for sh, _ in d.weights], d.gram_ok()
            est["home"] += _estimate(d, cm, ["home"] * len(shapes))
            dup = ["duplicated" if step_estimate([sh], d.size, cm, ["duplicated"]) is not None else "home"
                   for sh in shapes]
            est["duplicated"] += _estimate(d, cm, dup)
            gram = ["gram" if j in ok and step_estimate([sh], d.size, cm, ["gram"]) is not None else "home"
                    for j, sh in enumerate(shapes)]
            est["gram"] += _estimate(d, cm, gram)
            for key, allowed in (("auto", {}), ("auto_inexact", ok)):
                picks = pick_strategies(shapes, d.size, cm, gram_ok=allowed)
                est[key] += _estimate(d, cm, picks)
                for k in picks:
                    counts[key][k] = counts[key].get(k, 0) + 1
        out.append({"model": lay.model, "gpus": lay.gpus, "layout": lay.name,
                    **{k: round(v * 1e3, 3) for k, v in est.items()}, "picks": counts})
    return out


def _markdown(rows: list[dict], profile: str) -> str:
    head = (f"NS step estimate per strategy, ms ({profile}); auto's picks (home / duplicated / gram)\n\n"
            "| model | GPUs | layout | home | duplicated | gram | auto | auto, inexact | auto picks | inexact picks |\n"
            "|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        p = [" / ".join(str(r["picks"][k].get(s, 0)) for s in ("home", "duplicated", "gram"))
             for k in ("auto", "auto_inexact")]
        lines.append(f"| {r['model']} | {r['gpus']} | {r['layout']} | {r['home']:.1f} | {r['duplicated']:.1f} | "
                     f"{r['gram']:.1f} | {r['auto']:.1f} | {r['auto_inexact']:.1f} | {p[0]} | {p[1]} |")
    return "\n".join(lines)


def _measure_rank(rank: int, world: int) -> dict[str, float]:
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from overlap_muon._ns import zeropower
    from overlap_muon._scheduler.cost import ns_flops

    torch.set_num_threads(1)

    def median_s(fn: Any, reps: int, barrier: bool = False) -> float:
        fn()
        took = []
        for _ in range(reps):
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            fn()
            took.append(time.perf_counter() - t0)
        return statistics.median(took)

    one, nbytes = torch.zeros(1), 8 << 20
    x = torch.zeros(nbytes // 2, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    out = {"latency_s": median_s(lambda: dist.all_reduce(one), 200),
           "bytes_per_s": nbytes * (world - 1) / world / median_s(lambda: dist.all_to_all_single(y, x), 20, True)}
    m, a = torch.randn(512, 2048).bfloat16(), torch.randn(1024, 1024)
    out["ns_flops_per_s"] = ns_flops((512, 2048), 5) / median_s(lambda: zeropower(m), 5)
    out["fp32_flops_per_s"] = 2 * 1024 ** 3 / median_s(lambda: a @ a, 5)
    return out


def measure_cpu_gloo() -> SurplusCostModel:
    """This machine's ``cpu_gloo`` figures: one thread's NS (512 x 2048, bf16) and fp32 matmul rates, and gloo's
    latency (a 1-element all-reduce) and bandwidth (an 8 MiB all-to-all) between two local ranks (medians)."""
    from .spawn import spawn_ranks

    res = [r for ok, r in spawn_ranks(_measure_rank, 2, timeout=300) if ok]
    if len(res) != 2:
        raise RuntimeError(f"the measurement failed: {res}")
    lo = {k: min(r[k] for r in res) for k in res[0]}
    return SurplusCostModel(ns_flops_per_s=lo["ns_flops_per_s"], fp32_flops_per_s=lo["fp32_flops_per_s"],
                            intra_node_bytes_per_s=lo["bytes_per_s"], inter_node_bytes_per_s=lo["bytes_per_s"],
                            ranks_per_node=1 << 20, latency_s=max(r["latency_s"] for r in res))


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m overlap_muon.apps.strategies", description=__doc__.split("\n")[0])
    ap.add_argument("--profile", default="h200", choices=sorted(PROFILES), help="machine figures (%(default)s)")
    ap.add_argument("--gb300", action="store_true", help="the 32-GPU GB300-class configuration")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--measure", action="store_true", help="measure this machine's cpu_gloo figures, print them")
    args = ap.parse_args(argv)
    if args.measure:
        print(measure_cpu_gloo())
        return 0
    rows = table_rows(PROFILES[args.profile], args.gb300)
    print(_markdown(rows, args.profile))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"profile": args.profile, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
