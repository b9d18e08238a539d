"""Bench case ``ns``: batched Newton-Schulz FLOP/s vs plain ``torch.bmm``, and symmetric Gram vs plain NS.

Batched Newton-Schulz (:func:`overlap_muon._ns.zeropower` on a ``(b, P, Q)`` bf16 stack) achieved FLOP/s,
``b * scheduler.ns_flops((P, Q)) / time``, over the FLOP/s of the same matmuls as plain ``torch.bmm`` in bf16
(``5 x`` ``(b,m,n)@(b,n,m)``, ``(b,m,m)@(b,m,m)``, ``(b,m,m)@(b,m,n)``: exactly the FLOPs ``ns_flops``
counts), the limit on this machine. ``ns_over_bmm`` in (0, 1]; the gap is NS's elementwise work (norm,
casts, ``baddbmm`` scaling, transposes).
``syrk_over_plain``: one-matrix ``zeropower(syrk=True)`` (symmetric Gram and ``A @ A``, upper block rows +
mirror, ``overlap_muon._ns.SYRK_BLOCK``) effective FLOP/s over the plain ``zeropower``'s (both counted as
``ns_flops``, so it is the time ratio plain / syrk), summed over 1024^2, 2048x8192 and 4096^2 (``--quick``:
256^2, 256x1024, 512^2), 1 thread; per shape the details also give whether the result is bitwise equal to the
plain one, the max abs and relative Frobenius difference, and the FLOPs the symmetric products skip.
``gram_over_plain``: ``zeropower(gram=True)`` (Gram Newton-Schulz where the per-shape choice picks it, [Note: Gram
Newton-Schulz] in ``overlap_muon/_ns.py``) against plain NS, one matrix, 1 thread, side by side at 1024x4096,
2048x8192 and 4096x4096 (``--quick``: 256x1024, 512x2048, 512^2): the time ratio plain / Gram summed over the
rectangular shapes; per shape also the ratio of forced Gram NS (the square one shows why it keeps plain NS), and,
on the step case's matrices (the batches above), the NS time with and without ``gram``. Its error against a float64
NS, beside plain bf16 NS's, is measured at 256x1024 and 128x512 (full and rank-16; a float64 NS of the large
shapes takes minutes; their figures are in docs/results.md).
"""

from __future__ import annotations

import math
import time
from typing import Any

import torch
from torch import Tensor

from overlap_muon._ns import SYRK_BLOCK, gram_zeropower, zeropower
from overlap_muon._scheduler import ns_flops

from .common import _CaseResult, _median, _Options, _ratio, _threads

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("ns_over_bmm", "syrk_over_plain", "gram_over_plain")


def _bmm_like_ns(x: Tensor, steps: int) -> Tensor:
    """The matmuls of ``steps`` NS iterations on a ``(b, m, n)`` stack (``m <= n``), nothing else."""
    for _ in range(steps):
        a = torch.bmm(x, x.mT)
        b = torch.bmm(a, a)
        x = torch.bmm(b, x)
    return x


def run(o: _Options) -> _CaseResult:
    # The step case's matrices as the runtime batches them by shape (square, wide, tall).
    k = 2 if o.small else 1  # --small: half the sides and half the matrices
    batches = ((8 // k, o.side(256), o.side(256)), (4 // k, o.side(1024), o.side(256)),
               (4 // k, o.side(256), o.side(1024))) if o.quick else (
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
    gram = _gram_vs_plain(o, steps, batches)
    lines.append("Gram NS (gram_ns) vs plain NS, one matrix, 1 thread (time plain / time Gram):")
    for r in gram["shapes"]:
        lines.append(f"  {r['shape'][0]:>4}x{r['shape'][1]:<4}  plain {r['plain_s'] * 1e3:8.1f} ms  chosen "
                     f"{'gram ' if r['gram_chosen'] else 'plain'} {r['chosen_s'] * 1e3:8.1f} ms  ratio "
                     f"{r['plain_s'] / r['chosen_s']:.3f}  (forced Gram {r['plain_s'] / r['forced_s']:.3f})")
    for r in gram["error"]:
        lines.append(f"  error vs float64 NS, {r['shape'][0]}x{r['shape'][1]} {r['rank']}: Gram / plain = "
                     f"{r['gram_over_plain_error']:.3f}")
    lines.append(f"  step case's matrices: NS {gram['step_plain_s'] * 1e3:.1f} ms plain, "
                 f"{gram['step_gram_s'] * 1e3:.1f} ms with gram_ns ({gram['step_plain_s'] / gram['step_gram_s']:.3f}x)")
    return _CaseResult(
        "batched Newton-Schulz FLOP/s vs plain torch.bmm (bf16, same matmuls), 1 thread; symmetric Gram and Gram NS "
        "vs plain NS",
        {"ns_over_bmm": ratio, "syrk_over_plain": syrk_ratio, "gram_over_plain": gram["ratio"]},
        lines,
        {"ns_steps": steps, "repeats": repeats, "threads": 1, "shapes": rows,
         "ns_flops_per_s": tot_flops / tot_ns, "bmm_flops_per_s": tot_flops / tot_bmm,
         "syrk": {"block": SYRK_BLOCK, "shapes": syrk_rows}, "gram": gram},
    )


def ns_float64(x: Tensor, steps: int = 5, abc: tuple[float, float, float] = (3.4445, -4.7750, 2.0315)) -> Tensor:
    """``torch.optim.Muon``'s NS iteration on a ``(P, Q)`` matrix in float64 (no bf16 cast): the accuracy reference
    of the bf16 NS paths. Returns a float64 ``(P, Q)`` tensor."""
    x = x.double()
    tall = x.size(0) > x.size(1)
    x = x.mT if tall else x
    x = x / x.norm().clamp(min=1e-7)
    a, b, c = abc
    for _ in range(steps):
        g = x @ x.mT
        x = a * x + (b * g + c * g @ g) @ x
    return x.mT if tall else x


def _gram_vs_plain(o: _Options, steps: int, batches: tuple) -> dict[str, Any]:
    """Time plain, chosen (``gram=True``) and forced Gram NS side by side per shape; the error against float64 at
    two small shapes; the step case's matrices with and without ``gram``."""
    shapes = ((256, 1024), (512, 2048), (512, 512)) if o.quick else ((1024, 4096), (2048, 8192), (4096, 4096))
    shapes = tuple((o.side(p), o.side(q)) for p, q in shapes)
    warmup, repeats = 1, o.reps(5, 5)
    gen = torch.Generator().manual_seed(17)
    out: dict[str, Any] = {"shapes": [], "error": []}
    tot_plain = tot_gram = 0.0
    with _threads(1):
        for P, Q in shapes:
            x = torch.randn(P, Q, generator=gen)
            ts: dict[str, list[float]] = {"plain": [], "chosen": [], "forced": []}
            for r in range(warmup + repeats):
                for name, fn in (("plain", lambda: zeropower(x, ns_steps=steps)),
                                 ("chosen", lambda: zeropower(x, ns_steps=steps, gram=True)),
                                 ("forced", lambda: gram_zeropower(x, ns_steps=steps))):
                    t0 = time.perf_counter()
                    fn()
                    if r >= warmup:
                        ts[name].append(time.perf_counter() - t0)
            row = {"shape": [P, Q], "gram_chosen": max(P, Q) >= 4 * min(P, Q),
                   **{f"{k}_s": _median(v) for k, v in ts.items()}}
            out["shapes"].append(row)
            if row["gram_chosen"]:
                tot_plain += row["plain_s"]
                tot_gram += row["chosen_s"]
        for P, Q in ((o.side(256), o.side(1024)), (o.side(128), o.side(512))):
            for rank in ("full", "rank16"):
                x = (torch.randn(P, Q, generator=gen) if rank == "full"
                     else torch.randn(P, 16, generator=gen) @ torch.randn(16, Q, generator=gen))
                ref = ns_float64(x, steps)
                err = [float((f(x, ns_steps=steps).double() - ref).norm() / ref.norm())
                       for f in (zeropower, gram_zeropower)]
                out["error"].append({"shape": [P, Q], "rank": rank, "plain_error": err[0], "gram_error": err[1],
                                     "gram_over_plain_error": err[1] / err[0]})
        mats = [torch.randn(b, P, Q, generator=gen) for b, P, Q in batches]
        t = {"plain": [], "gram": []}
        for r in range(warmup + repeats):
            for name in t:
                t0 = time.perf_counter()
                for m in mats:
                    zeropower(m, ns_steps=steps, gram=name == "gram")
                if r >= warmup:
                    t[name].append(time.perf_counter() - t0)
        out["step_plain_s"], out["step_gram_s"] = _median(t["plain"]), _median(t["gram"])
    out["ratio"] = _ratio(tot_plain, tot_gram)
    return out


def _syrk_flops(shape: tuple[int, int], steps: int, block: int) -> int:
    """FLOPs ``zeropower(syrk=True)`` executes: block rows of ``X Xᵀ`` and ``A @ A``, the full ``B @ X``."""
    m, n = min(shape), max(shape)
    rows = sum(m - i for i in range(0, m, block)) if block < m else m * m  # entries of the upper block rows
    return steps * (2 * rows * n + 2 * rows * m + 2 * m * m * n)


def _syrk_vs_plain(o: _Options, steps: int) -> tuple[list[dict[str, Any]], float | None]:
    """Time ``zeropower`` with and without ``syrk`` on one matrix per shape, interleaved; compare the results."""
    shapes = ((256, 256), (256, 1024), (512, 512)) if o.quick else ((1024, 1024), (2048, 8192), (4096, 4096))
    shapes = tuple((o.side(p), o.side(q)) for p, q in shapes)
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
