"""The time model of ``overlap-muon-bench --quick``: each case's ``[spawns, bf16_gflop, fp32_gflop]``
(``overlap_muon.apps.time_model``), fitted to runs of this CPU emulating slower ones (docs/results.md, "Time
models"), and the run's budget on the slowest CPU we know.

The bench prints, after a ``--quick`` run of every case, the model's total for this machine's rates next to the
measured total, and its total on the slowest CPU (``time_model.SLOWEST``), whose budget is :data:`QUICK_BUDGET_S`.
"""

from __future__ import annotations

from typing import Any

from overlap_muon.apps.time_model import SLOWEST, predict

__all__ = ["QUICK_BUDGET_S", "QUICK_MODEL", "quick_summary"]

#: What the model may predict for ``--quick`` (every case) on the slowest CPU we know, seconds (the budget is 2 min).
QUICK_BUDGET_S = 110.0

#: Per case, ``[spawns, bf16_gflop, fp32_gflop]`` of a ``--quick --small`` run (``--small`` is on by itself where
#: bf16 is slow), fitted to three runs on a 2-core AMD EPYC with avx512_bf16: native, oneDNN at AVX2, and that with
#: MKL's compatible code path (bf16 406 / 3.3 / 3.0 GFLOP/s, fp32 97 / 99 / 30; docs/results.md, "Time models").
QUICK_MODEL: dict[str, list[float]] = {
    "balance": [0.0186, 0.0, 0.0],
    "comm": [0.6286, 0.8232, 0.0],
    "memory": [0.3606, 1.1033, 5.3285],
    "ns": [0.0838, 38.8685, 0.0],
    "overhead": [2.8017, 0.0, 6.5677],
    "overlap": [1.2514, 32.4824, 0.0],
    "step": [3.74, 2.3438, 195.0],  # +2 starts, +147: world 4, Gram variants, float64 reference (one native run)
    "surplus": [0.8201, 23.8542, 0.0],
}


def quick_summary(elapsed: dict[str, float], rates: dict[str, float], small: bool) -> tuple[str, dict[str, Any]]:
    """One line (and its figures): the model's total on the slowest CPU with its budget and, for a ``small`` run
    (the one the model is of), the measured ``elapsed`` (``{case: seconds}``) beside the model at ``rates``
    (``bf16``, ``fp32``, ``spawn``)."""
    here, unknown = predict(QUICK_MODEL, elapsed, rates, rates)
    slowest, _ = predict(QUICK_MODEL, elapsed, rates, SLOWEST)
    got = sum(elapsed.values())
    there = (f"on the slowest CPU we know (bf16 {SLOWEST['bf16']}, fp32 {SLOWEST['fp32']:.0f}, start "
             f"{SLOWEST['spawn']:.1f} s, --small) it says {slowest:.0f} s (budget {QUICK_BUDGET_S:.0f} s)")
    line = (f"time model (overlap_muon/apps/bench/budget.py): the cases took {got:.0f} s here (matmul bf16 "
            f"{rates['bf16']:.1f}, fp32 {rates['fp32']:.1f} GFLOP/s, interpreter start {rates['spawn']:.2f} s), "
            + (f"the model says {here:.0f} s; " if small else "without --small, which the model is of; ") + there
            + (f"; {unknown} cases unknown to it" if unknown else ""))
    return line, {"measured_s": got, "model_here_s": here if small else None, "model_slowest_s": slowest,
                  "unknown_cases": unknown}
