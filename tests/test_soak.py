"""Soak: 300 overlapped steps on a 2x2 domain, bitwise equal to torch.optim.Muon + AdamW at the end, with flat
resident memory, a constant number of live tensors and a constant number of threads.

Run with ``python -m pytest -m slow tests/test_soak.py -s`` (deselected by default); ``-s`` shows the memory
figures.
"""

from __future__ import annotations

import gc
import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, PlainShardNet, block

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
STEPS = 300
WARMUP = 50  # steps before the first sample: allocator pools, gloo buffers and route plans reach steady state
EVERY = 10  # sample period, steps
RSS_SLACK_MIB = 8.0
"""Allowed VmRSS growth after the warm-up, MiB. Each rank moves ~0.3 MiB of tensors through the lanes per step
(gradient blocks, momentum temporaries, bf16 packs, gathered full matrices, NS outputs), so a leak of a tenth of
one step's buffers alone adds ~8 MiB over the 250 sampled steps; smaller tensor leaks are caught exactly by the
live-tensor count. What is left is allocator warm-up (glibc arenas of the lane threads, Python pools): measured
+3 to +4 MiB over steps 50..300 here, flattening later (a 1500-step 1x2 run grew 2.2 MiB up to step 600, then
0.1 MiB up to step 1500)."""


class _SoakNet(PlainShardNet):
    """PlainShardNet with each matrix 8x larger per side (same partition dims and unevenness)."""

    SHAPES = {"l0": ((160, 96), 0), "l1": ((96, 160), 1), "l2": ((56, 96), None), "l3": ((104, 56), 0),
              "l4": ((160, 96), 0), "l5": ((72, 72), 1)}


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def _live_tensors() -> int:
    with warnings.catch_warnings():  # isinstance() on some torch.distributed module attributes warns
        warnings.simplefilter("ignore", FutureWarning)
        return sum(1 for o in gc.get_objects() if isinstance(o, torch.Tensor))


def _soak(rank, world, R, T):
    g, t = divmod(rank, T)
    tp = [dist.new_group([gg * T + tt for tt in range(T)]) for gg in range(R)]
    rm = [dist.new_group([gg * T + tt for gg in range(R)]) for tt in range(T)]
    net = _SoakNet(R, T, g, t)
    opt = OverlapMuon(net, adamw_kwargs=ADAMW_KW, tp_group=tp[g], remat_group=rm[t], overlap=True,
                      muon_filter=lambda n, p: p.ndim == 2, **HP)
    samples = []  # (step, VmRSS MiB, live tensors, threads)
    t0 = time.perf_counter()
    for s in range(STEPS):
        cs, _ = net.local_grads(s)
        net(cs).backward()
        opt.step()
        opt.zero_grad()
        if s + 1 >= WARMUP and (s + 1) % EVERY == 0:
            opt.synchronize()  # a quiescent point: no wave in flight, so the counts are comparable
            gc.collect()
            samples.append((s + 1, _rss_mib(), _live_tensors(), threading.active_count()))
    opt.synchronize()
    secs = time.perf_counter() - t0

    # the reference, after the soak so it does not disturb the samples
    ref_net = _SoakNet(1, 1, 0, 0)
    fulls = {n: nn.Parameter(ref_net.full[n].clone()) for n in ref_net.SHAPES}
    scale = nn.Parameter(torch.ones(5))
    mu = torch.optim.Muon(list(fulls.values()), **HP)
    aw = torch.optim.AdamW([scale], **ADAMW_KW)
    for s in range(STEPS):
        _, fg = ref_net.local_grads(s)
        for n, p in fulls.items():
            p.grad = fg[n]
        scale.grad = fg["scale"]
        mu.step()
        aw.step()
    bad = []
    for n, (_, pd) in net.SHAPES.items():
        w = getattr(net, n).weight
        if not torch.equal(w.detach(), block(fulls[n].detach(), pd, R, T, g, t)):
            bad.append(f"rank {rank}: param {n} differs from torch.optim.Muon after {STEPS} steps")
        ref_buf = block(mu.state[fulls[n]]["momentum_buffer"], pd, R, T, g, t)
        if not torch.equal(opt.state[w]["momentum_buffer"], ref_buf):
            bad.append(f"rank {rank}: momentum {n} differs")
    if not torch.equal(net.scale.detach(), scale.detach()):
        bad.append(f"rank {rank}: AdamW param differs")
    opt.close()
    return {"bad": bad, "samples": samples, "secs": secs}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_soak_300_steps_2x2_bitwise_and_flat_memory():
    """Guards against per-step leaks (lane handles, route plans, staged tensors or events kept forever) and
    against drift: after 300 overlapped steps every shard equals torch.optim.Muon + AdamW bitwise."""
    res = run_ranks(_soak, 4, 2, 2, timeout=280)  # typically 1-2 min; 2 shared cores can be slower
    lines, bad = [], []
    for rank, r in enumerate(res):
        bad += r["bad"]
        steps, rss, tensors, threads = zip(*r["samples"])
        growth = rss[-1] - rss[0]
        lines.append(
            f"  rank {rank}: {STEPS} steps in {r['secs']:.1f} s; VmRSS MiB first {rss[0]:.1f} (step {steps[0]}), "
            f"last {rss[-1]:.1f}, max {max(rss):.1f}, growth {growth:+.2f}; "
            f"live tensors {min(tensors)}..{max(tensors)}; "
            f"threads {min(threads)}..{max(threads)}\n    VmRSS samples: {' '.join(f'{x:.2f}' for x in rss)}"
        )
        if max(rss) - rss[0] > RSS_SLACK_MIB:
            bad.append(f"rank {rank}: VmRSS grew by {max(rss) - rss[0]:.2f} MiB after the warm-up (> {RSS_SLACK_MIB})")
        if max(tensors) != min(tensors):
            bad.append(f"rank {rank}: live tensors went from {tensors[0]} to {tensors[-1]} (max {max(tensors)})")
        if max(threads) != min(threads):
            bad.append(f"rank {rank}: thread count changed: {threads}")
    print(f"\n[soak 2x2, {STEPS} steps, samples every {EVERY} steps after {WARMUP}]\n" + "\n".join(lines))
    assert not bad, "\n".join(bad)
