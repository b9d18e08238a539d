"""Experiment (issue 15, item 2): NS calls and exposed fraction of cost-planned waves at world 1.

Not part of the package. Variants per model: no optimizer, overlap off, overlap on with the count-based default
(one matrix per wave at world 1), overlap on with ``wave_slots=k`` (public knob), and overlap on with the
cost-based plan (``scheduler.plan_waves_by_cost``, swapped in for ``plan_waves`` in this experiment process only,
since the optimizer is not wired yet). Interleaved rounds; exposed = (on - none) / (off - none).

    PYTHONPATH=. python experiments/exp_cost_waves.py [rounds]
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch import nn

from overlap_muon import optimizer as om
from overlap_muon._spawn import spawn_ranks
from scheduler import plan_waves, plan_waves_by_cost

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


class Llama(nn.Module):
    """6 layers, d 256, GQA 4 query / 2 KV heads of 64, SwiGLU 688; no biases, no norm weights."""

    def __init__(self, layers: int = 6, d: int = 256) -> None:
        super().__init__()
        self.d = d
        self.layers = nn.ModuleList()
        for _ in range(layers):
            m = nn.Module()
            m.q, m.k, m.v, m.o = (nn.Linear(d, 256, bias=False), nn.Linear(d, 128, bias=False),
                                  nn.Linear(d, 128, bias=False), nn.Linear(256, d, bias=False))
            m.gate, m.up, m.down = nn.Linear(d, 688, bias=False), nn.Linear(d, 688, bias=False), nn.Linear(688, d, bias=False)
            self.layers.append(m)

    def forward(self, x):
        B, S, _ = x.shape
        for m in self.layers:
            h = F.rms_norm(x, (self.d,))
            q = m.q(h).view(B, S, 4, 64).transpose(1, 2)
            k = m.k(h).view(B, S, 2, 64).transpose(1, 2)
            v = m.v(h).view(B, S, 2, 64).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + m.o(a.transpose(1, 2).reshape(B, S, 256))
            h = F.rms_norm(x, (self.d,))
            x = x + m.down(F.silu(m.gate(h)) * m.up(h))
        return x


class BenchStack(nn.Module):
    """The overlap case's stack at world 1: per block (d, d), (d, d), (4d, d), (d, 4d), RMS-normed."""

    def __init__(self, blocks: int = 6, d: int = 256) -> None:
        super().__init__()
        self.d = d
        self.blocks = nn.ModuleList()
        for _ in range(blocks):
            m = nn.Module()
            m.a, m.b = nn.Linear(d, d, bias=False), nn.Linear(d, d, bias=False)
            m.up, m.down = nn.Linear(d, 4 * d, bias=False), nn.Linear(4 * d, d, bias=False)
            self.blocks.append(m)

    def forward(self, x):
        for m in self.blocks:
            x = x + m.b(F.gelu(m.a(F.rms_norm(x, (self.d,)))))
            x = x + m.down(F.gelu(m.up(F.rms_norm(x, (self.d,)))))
        return x


def _cost_plan(shapes):
    def plan(order, costs, num_ranks, wave_slots=None, balance="lpt", taper=True):
        return plan_waves_by_cost(order, costs, shapes, num_ranks, balance=balance)
    return plan


def _rank(rank, world, model_name, rounds, chunk, slots_list):
    torch.manual_seed(0)
    make = {"llama": lambda: Llama(), "bench": lambda: BenchStack()}[model_name]
    x = torch.randn(4, 256, 256) if model_name == "llama" else torch.randn(1, 1024, 256)
    variants = {}
    names = ["none", "off", "on_count"] + [f"on_slots{k}" for k in slots_list] + ["on_cost"]
    for name in names:
        torch.manual_seed(1)
        net = make()
        shapes = [tuple(p.shape) for p in net.parameters()]
        opt = None
        if name == "off":
            opt = om.OverlapMuon(net, overlap=False, **HP)
        elif name == "on_count":
            opt = om.OverlapMuon(net, overlap=True, **HP)
        elif name.startswith("on_slots"):
            opt = om.OverlapMuon(net, overlap=True, wave_slots=int(name[8:]), **HP)
        elif name == "on_cost":
            om.plan_waves = _cost_plan(shapes)
            try:
                opt = om.OverlapMuon(net, overlap=True, **HP)
            finally:
                om.plan_waves = plan_waves
        variants[name] = (net, opt)

    def chunk_s(name):
        net, opt = variants[name]
        t0 = time.perf_counter()
        for _ in range(chunk):
            net(x).pow(2).mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        if opt is not None:
            opt.synchronize()
        return (time.perf_counter() - t0) / chunk

    for n in names:
        chunk_s(n)
    for n, (_, o) in variants.items():
        if o is not None:
            o.stats.clear()
    times = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(chunk_s(n))
    out = {"median_s": {n: statistics.median(v) for n, v in times.items()}, "ns_calls_per_step": {},
           "waves": {}}
    for n, (_, o) in variants.items():
        if o is not None:
            out["ns_calls_per_step"][n] = o.stats["ns_calls"] / max(1, o.stats["steps"])
            out["waves"][n] = [len(w.params) for w in o.waves]
        if o is not None:
            o.close()
    return out


if __name__ == "__main__":
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 6
    for model, slots in (("bench", (2, 4)), ("llama", (4, 7))):
        (ok, res), = spawn_ranks(_rank, 1, model, rounds, 3, slots, timeout=1200)
        if not ok:
            print(res)
            continue
        med = res["median_s"]
        opt = med["off"] - med["none"]
        print(f"== {model}: none {1e3 * med['none']:.1f} ms, off {1e3 * med['off']:.1f} ms (optimizer {1e3 * opt:.1f} ms)")
        for n in med:
            if n.startswith("on"):
                print(f"  {n:<12} {1e3 * med[n]:7.1f} ms  exposed {(med[n] - med['none']) / opt:6.3f}  "
                      f"NS calls/step {res['ns_calls_per_step'][n]:5.1f}  waves {res['waves'][n]}")
        print(f"  off          NS calls/step {res['ns_calls_per_step']['off']:5.1f}")
