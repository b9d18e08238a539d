"""Bench case ``balance``: NS load per rank of LPT vs round robin, on public model shapes (planning only).

Pure planning: max/mean NS load per rank (``scheduler.load_report`` of ``ns_flops`` costs) of LPT vs round
robin, for every Muon matrix of a step of GPT-2 small, a Llama-3-8B-class and a Llama-3-70B-class model,
on domains of 8, 16 and 64 ranks. ``{model}_S{S}_lpt_max_over_mean`` and ``..._rr_max_over_mean`` (>= 1;
1 is perfect balance).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from overlap_muon._scheduler import load_report, lpt_homes, ns_flops, plan_waves, round_robin_homes

from .common import _CaseResult, _Options


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    layers: int
    d_model: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gated: bool  #: gated MLP (gate, up, down) vs plain (fc, proj)
    fused_qkv: bool  #: one (q + 2 kv, d) matrix vs three
    source: str

    def matrices(self) -> list[tuple[int, int]]:
        """Every Muon matrix of the model, full logical ``(out, in)`` shapes, layer 0 first."""
        d, f = self.d_model, self.ffn
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = [(q + 2 * kv, d)] if self.fused_qkv else [(q, d), (kv, d), (kv, d)]
        attn.append((d, q))
        mlp = [(f, d), (f, d), (d, f)] if self.gated else [(f, d), (d, f)]
        return (attn + mlp) * self.layers


_FAMILIES = (
    _Family("gpt2_small", 12, 768, 3072, 12, 12, 64, False, True,
            "GPT-2 small (Radford et al. 2019): 12 layers, d 768, 12 heads, MLP 3072, fused c_attn"),
    _Family("llama3_8b", 32, 4096, 14336, 32, 8, 128, True, False,
            "Llama 3 8B ('The Llama 3 Herd of Models', Meta 2024, Table 3): 32 layers, d 4096, FFN 14336, GQA 32/8"),
    _Family("llama3_70b", 80, 8192, 28672, 64, 8, 128, True, False,
            "Llama 3 70B (same source): 80 layers, d 8192, FFN 28672, GQA 64/8"),
)
_DOMAINS = (8, 16, 64)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = tuple(f"{f.name}_S{s}_{b}_max_over_mean" for f in _FAMILIES for s in _DOMAINS
                                    for b in ("lpt", "rr"))


def run(o: _Options) -> _CaseResult:
    ratios: dict[str, float | None] = {}
    lines = [f"{'model':<12}{'matrices':>9}{'S':>5}{'LPT max/mean':>14}{'RR max/mean':>13}{'bound':>8}"
             f"{'waves LPT':>11}{'waves RR':>10}"]
    det: dict[str, Any] = {}
    for fam in _FAMILIES:
        mats = fam.matrices()
        costs = [float(ns_flops(s)) for s in mats]
        det[fam.name] = {"source": fam.source, "matrices": len(mats), "ns_flops_per_step": sum(costs)}
        for S in _DOMAINS:
            lpt = load_report(costs, lpt_homes(costs, S), S)
            rr = load_report(costs, round_robin_homes(len(costs), S), S)
            # The best any assignment can do: max(heaviest matrix, mean).
            bound = max(max(costs), sum(costs) / S) / (sum(costs) / S)
            # The overlap plan (waves of S matrices in gradient-ready order, taper), total load per rank.
            order = list(reversed(range(len(mats))))
            wl = {}
            for bal in ("lpt", "round_robin"):
                homes = [0] * len(mats)
                for w in plan_waves(order, costs, S, wave_slots=S, balance=bal, taper=True):
                    for i, h in w.homes.items():
                        homes[i] = h
                wl[bal] = load_report(costs, homes, S).max_over_mean
            ratios[f"{fam.name}_S{S}_lpt_max_over_mean"] = lpt.max_over_mean
            ratios[f"{fam.name}_S{S}_rr_max_over_mean"] = rr.max_over_mean
            det[fam.name][f"S{S}"] = {"lpt_max_over_mean": lpt.max_over_mean, "rr_max_over_mean": rr.max_over_mean,
                                      "lower_bound": bound, "waves_lpt_max_over_mean": wl["lpt"],
                                      "waves_rr_max_over_mean": wl["round_robin"]}
            lines.append(f"{fam.name:<12}{len(mats):>9}{S:>5}{lpt.max_over_mean:>14.4f}{rr.max_over_mean:>13.4f}"
                         f"{bound:>8.4f}{wl['lpt']:>11.4f}{wl['round_robin']:>10.4f}")
    lines.append("bound = max(heaviest matrix, mean)/mean; waves: the overlap plan (S matrices per wave, taper)")
    return _CaseResult("NS load balance per rank, LPT vs round robin (planning only, ns_flops costs)", ratios, lines,
                       det)
