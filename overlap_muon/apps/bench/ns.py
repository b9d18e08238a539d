"""Bench case ``ns``: batched Newton-Schulz FLOP/s vs plain ``torch.bmm``, and symmetric Gram vs plain NS.

Batched Newton-Schulz (:func:`overlap_muon.ns.zeropower` on a ``(b, P, Q)`` bf16 stack) achieved FLOP/s,
``b * scheduler.ns_flops((P, Q)) / time``, over the FLOP/s of the same matmuls as plain ``torch.bmm`` in bf16
(``5 x`` ``(b,m,n)@(b,n,m)``, ``(b,m,m)@(b,m,m)``, ``(b,m,m)@(b,m,n)``: exactly the FLOPs ``ns_flops``
counts), the limit on this machine. ``ns_over_bmm`` in (0, 1]; the gap is NS's elementwise work (norm,
casts, ``baddbmm`` scaling, transposes).
``syrk_over_plain``: one-matrix ``zeropower(syrk=True)`` (symmetric Gram and ``A @ A``, upper block rows +
mirror, ``overlap_muon.ns.SYRK_BLOCK``) effective FLOP/s over the plain ``zeropower``'s (both counted as
``ns_flops``, so it is the time ratio plain / syrk), summed over 1024^2, 2048x8192 and 4096^2 (``--quick``:
256^2, 256x1024, 512^2), 1 thread; per shape the details also give whether the result is bitwise equal to the
plain one, the max abs and relative Frobenius difference, and the FLOPs the symmetric products skip.
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from overlap_muon.ns import SYRK_BLOCK, zeropower
from overlap_muon.scheduler import ns_flops

from .common import _CaseResult, _median, _Options, _ratio, _threads

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("ns_over_bmm", "syrk_over_plain")


def _bmm_like_ns(x: Tensor, steps: int) -> Tensor:
    """The matmuls of ``steps`` NS iterations on a ``(b, m, n)`` stack (``m <= n``), nothing else."""
    for _ in range(steps):
        a = torch.bmm(x, x.mT)
        b = torch.bmm(a, a)
        x = torch.bmm(b, x)
    return x


def run(o: _Options) -> _CaseResult:
    # The step case's matrices as the runtime batches them by shape (square, wide, tall).
    batches = ((8, 256, 256), (4, 1024, 256), (4, 256, 1024)) if o.quick else (
        (48, 256, 256), (12, 1024, 256), (12, 256, 1024))
    warmup, repeats = 1, o.reps(3, 7)
    steps = 5
    rows, tot_flops, tot_ns, tot_bmm = [], 0, 0.0, 0.0
    gen = torch.Generator().manual_seed(3)
    with _threads(1):
        for b, P, Q in batches:
            x = torch.randn(b, P, Q, generator=gen).bfloat16()
            m, k = min(P, Q), max(P, Q)
            y = torch.randn(b, m, k, generator=gen).bfloat16() / math.sqrt(m * k)
            t_ns, t_bmm = [], []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                zeropower(x, ns_steps=steps)
                t1 = time.perf_counter()
                _bmm_like_ns(y, steps)
                t2 = time.perf_counter()
                if r >= warmup:
                    t_ns.append(t1 - t0)
                    t_bmm.append(t2 - t1)
            flops = b * ns_flops((P, Q), steps)
            mn, mb = _median(t_ns), _median(t_bmm)
            rows.append({"batch": b, "shape": [P, Q], "flops": flops, "ns_s": mn, "bmm_s": mb,
                         "ns_flops_per_s": flops / mn, "bmm_flops_per_s": flops / mb})
            tot_flops += flops
            tot_ns += mn
            tot_bmm += mb
    ratio = _ratio(tot_bmm, tot_ns)
    lines = [
        f"({r['batch']:>2}, {r['shape'][0]:>4}, {r['shape'][1]:>4})  NS {r['ns_flops_per_s'] / 1e9:7.1f} GFLOP/s"
        f"   bmm {r['bmm_flops_per_s'] / 1e9:7.1f} GFLOP/s   ratio {r['bmm_s'] / r['ns_s']:.3f}"
        for r in rows
    ]
    lines.append(f"all shapes: NS {tot_flops / tot_ns / 1e9:.1f} GFLOP/s over bmm {tot_flops / tot_bmm / 1e9:.1f}"
                 f" GFLOP/s = {ratio:.3f}")
    syrk_rows, syrk_ratio = _syrk_vs_plain(o, steps)
    lines.append(f"symmetric Gram (syrk, block {SYRK_BLOCK}) vs plain NS, one matrix, 1 thread:")
    for r in syrk_rows:
        lines.append(f"  {r['shape'][0]:>4}x{r['shape'][1]:<4}  plain {r['plain_flops_per_s'] / 1e9:7.1f} GFLOP/s  "
                     f"syrk {r['syrk_flops_per_s'] / 1e9:7.1f} GFLOP/s  ratio {r['plain_s'] / r['syrk_s']:.3f}  "
                     f"bitwise {r['bitwise']}  max abs {r['max_abs_diff']:.3g}  rel {r['rel_fro_diff']:.3g}")
    lines.append(f"all shapes: syrk / plain FLOP/s = {syrk_ratio:.3f}" if syrk_ratio else "syrk ratio unavailable")
    return _CaseResult(
        "batched Newton-Schulz FLOP/s vs plain torch.bmm (bf16, same matmuls), 1 thread; symmetric Gram vs plain NS",
        {"ns_over_bmm": ratio, "syrk_over_plain": syrk_ratio},
        lines,
        {"ns_steps": steps, "repeats": repeats, "threads": 1, "shapes": rows,
         "ns_flops_per_s": tot_flops / tot_ns, "bmm_flops_per_s": tot_flops / tot_bmm,
         "syrk": {"block": SYRK_BLOCK, "shapes": syrk_rows}},
    )


def _syrk_flops(shape: tuple[int, int], steps: int, block: int) -> int:
    """FLOPs ``zeropower(syrk=True)`` executes: block rows of ``X Xᵀ`` and ``A @ A``, the full ``B @ X``."""
    m, n = min(shape), max(shape)
    rows = sum(m - i for i in range(0, m, block)) if block < m else m * m  # entries of the upper block rows
    return steps * (2 * rows * n + 2 * rows * m + 2 * m * m * n)


def _syrk_vs_plain(o: _Options, steps: int) -> tuple[list[dict[str, Any]], float | None]:
    """Time ``zeropower`` with and without ``syrk`` on one matrix per shape, interleaved; compare the results."""
    shapes = ((256, 256), (256, 1024), (512, 512)) if o.quick else ((1024, 1024), (2048, 8192), (4096, 4096))
    warmup, repeats = 1, o.reps(2, 3)
    gen = torch.Generator().manual_seed(13)
    rows, tot_plain, tot_syrk, tot_flops = [], 0.0, 0.0, 0
    with _threads(1):
        for P, Q in shapes:
            x = torch.randn(P, Q, generator=gen)
            t_plain, t_syrk = [], []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                plain = zeropower(x, ns_steps=steps)
                t1 = time.perf_counter()
                sym = zeropower(x, ns_steps=steps, syrk=True)
                t2 = time.perf_counter()
                if r >= warmup:
                    t_plain.append(t1 - t0)
                    t_syrk.append(t2 - t1)
            flops = ns_flops((P, Q), steps)
            mp, ms = _median(t_plain), _median(t_syrk)
            diff = (sym.float() - plain.float()).abs()
            rows.append({"shape": [P, Q], "flops": flops, "syrk_flops_executed": _syrk_flops((P, Q), steps, SYRK_BLOCK),
                         "plain_s": mp, "syrk_s": ms, "plain_flops_per_s": flops / mp, "syrk_flops_per_s": flops / ms,
                         "bitwise": bool(torch.equal(sym, plain)), "max_abs_diff": float(diff.max()),
                         "rel_fro_diff": float(diff.norm() / plain.float().norm())})
            tot_plain += mp
            tot_syrk += ms
            tot_flops += flops
    return rows, _ratio(tot_plain, tot_syrk)
