"""A time model of a run made of parts (tests, bench cases): each part's seconds as interpreter starts, bf16 work and
fp32 work, so that a run measured on one machine predicts the run on a machine with other rates.

A part's duration on a machine is modelled as ``spawns * spawn + bf16_gflop / bf16 + fp32_gflop / fp32``, with the
machine's three rates: ``spawn``, the seconds to start Python and import torch (:func:`spawn_seconds`: what every
rank, subprocess and example pays, and a fair measure of the machine's speed at plain Python), and ``bf16`` /
``fp32``, its one-thread matmul GFLOP/s (``bench.common.matmul_gflops``). ``bf16_gflop`` is the work that runs at
the bf16 matmul rate (NS, in bf16 as ``torch.optim.Muon``), ``fp32_gflop`` the work that runs at the fp32 rate
(forward and backward, fp32 references), ``spawns`` the rest (spawning ranks, imports, Python, gloo) in units of
one interpreter start. The three numbers of each part are fitted (:func:`fit`, non-negative least squares) to its
durations measured at three or more sets of rates: one CPU can emulate slower matmuls (docs/results.md, "Time
models").
"""

from __future__ import annotations

import itertools
import subprocess
import sys
import time
from typing import Any

__all__ = ["SLOWEST", "spawn_seconds", "predict", "fit"]

#: The rates of the slowest CPU we know, a 2-core AMD EPYC with AVX2 only: one-thread matmul GFLOP/s as measured
#: there, and its interpreter start as inferred from its run of the test suite (docs/results.md, "Time models").
SLOWEST = {"bf16": 1.5, "fp32": 21.0, "spawn": 2.1}


def spawn_seconds(rounds: int = 5) -> float:
    """Seconds to start this Python and import ``torch`` and ``torch.distributed`` in a new process: the fastest of
    ``rounds`` (the machine's own speed; a busy neighbour only ever slows a round). Measure it on a quiet machine."""
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch, torch.distributed"], check=True)
        times.append(time.perf_counter() - t0)
    return min(times)


def predict(model: dict[str, list[float]], measured: dict[str, float], here: dict[str, float],
            there: dict[str, float]) -> tuple[float, int]:
    """Seconds the parts of ``measured`` (``{name: seconds here}``) take on a machine with rates ``there``.

    A part the model does not know (new since the fit) counts as interpreter starts at its time ``here``: scaled by
    ``there["spawn"] / here["spawn"]``.

    Returns:
        ``(seconds, number of tests the model does not know)``.
    """
    total, unknown = 0.0, 0
    for node, secs in measured.items():
        m = model.get(node)
        if m is None:
            unknown += 1
            total += secs * there["spawn"] / here["spawn"]
        else:
            total += m[0] * there["spawn"] + m[1] / there["bf16"] + m[2] / there["fp32"]
    return total, unknown


#: How far a rate must vary between a part's runs (largest over smallest) for its work to be fitted.
_SPREAD = 1.5


def _nnls3(a: Any, t: Any) -> Any:
    """Least squares ``a @ x ~ t`` with ``x >= 0`` for up to three unknowns (every subset of columns tried; numpy
    arrays)."""
    import numpy as np  # only fitting needs it (predicting does not: the bench and the suite's summary)

    best, best_err = np.zeros(a.shape[1]), float(np.sum(t ** 2))
    for k in range(1, a.shape[1] + 1):
        for cols in itertools.combinations(range(a.shape[1]), k):
            x, *_ = np.linalg.lstsq(a[:, cols], t, rcond=None)
            if (x < 0).any():
                continue
            err = float(np.sum((a[:, cols] @ x - t) ** 2))
            if err < best_err:
                best, best_err = np.zeros(a.shape[1]), err
                best[list(cols)] = x
    return best


def fit(runs: list[dict]) -> dict[str, list[float]]:
    """Per part, the ``[spawns, bf16_gflop, fp32_gflop]`` that best explain its durations in ``runs`` (each
    ``{"rates": {"bf16", "fp32", "spawn"}, "durations": {name: seconds}}``, e.g. a ``--time-log`` file). A part
    missing from some runs (a test moved to the long tier where bf16 is slow) is fitted on the runs it is in, and
    a rate that varies less than 1.5-fold across those runs gets no work (with one run, all of its time is
    interpreter starts)."""
    import numpy as np

    nodes = sorted(set().union(*(r["durations"] for r in runs)))
    out = {}
    for node in nodes:
        rows = [(r["rates"]["spawn"], 1.0 / r["rates"]["bf16"], 1.0 / r["rates"]["fp32"], r["durations"][node])
                for r in runs if node in r["durations"]]
        arr = np.array(rows)
        # A rate that barely differs between this part's runs cannot be told from the interpreter starts: its
        # column would only fit the noise (and the slowest CPU's low rates would magnify it).
        keep = [0] + [c for c in (1, 2) if arr[:, c].max() >= _SPREAD * arr[:, c].min()]
        x = np.zeros(3)
        x[keep] = _nnls3(arr[:, keep], arr[:, 3])
        out[node] = [round(float(v), 4) for v in x]
    return out


