"""A time model of a run made of parts (tests, bench cases): each part's seconds as a fixed part plus a bf16 part and
an fp32 part, so that a run measured on one machine predicts the run on a machine with other matmul rates.

A part's duration on a machine whose one-thread matmul rates are ``bf16`` and ``fp32`` GFLOP/s is modelled as
``seconds + bf16_gflop / bf16 + fp32_gflop / fp32``: ``bf16_gflop`` is the work that runs at the bf16 matmul rate
(NS, in bf16 as ``torch.optim.Muon``), ``fp32_gflop`` the work that runs at the fp32 rate (forward and backward,
fp32 references), ``seconds`` the rest (spawning ranks, imports, Python, gloo). The three numbers of each part are
fitted (:func:`fit`, non-negative least squares) to its durations measured at three or more pairs of rates: one CPU
can emulate slower ones (docs/results.md, "Time models").
"""

from __future__ import annotations

import itertools

import numpy as np

__all__ = ["SLOWEST", "predict", "fit"]

#: One-thread matmul rates of the slowest CPU we know, GFLOP/s (a 2-core AMD EPYC with AVX2 only).
SLOWEST = {"bf16": 1.5, "fp32": 21.0}


def predict(model: dict[str, list[float]], measured: dict[str, float], here: dict[str, float],
            there: dict[str, float]) -> tuple[float, int]:
    """Seconds the tests of ``measured`` (``{nodeid: seconds here}``) take on a machine with rates ``there``.

    A test the model does not know (new since the fit) counts as all fp32 work at its time ``here``: scaled by
    ``here["fp32"] / there["fp32"]`` (a pessimistic guess on a slower machine).

    Returns:
        ``(seconds, number of tests the model does not know)``.
    """
    total, unknown = 0.0, 0
    for node, secs in measured.items():
        m = model.get(node)
        if m is None:
            unknown += 1
            total += secs * here["fp32"] / there["fp32"]
        else:
            total += m[0] + m[1] / there["bf16"] + m[2] / there["fp32"]
    return total, unknown


def _nnls3(a: np.ndarray, t: np.ndarray) -> np.ndarray:
    """Least squares ``a @ x ~ t`` with ``x >= 0`` for three unknowns (every subset of columns tried)."""
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
    """Per test, the ``[seconds, bf16_gflop, fp32_gflop]`` that best explain its durations in ``runs`` (each a
    ``--time-log`` file's content: ``{"rates": {...}, "durations": {nodeid: seconds}}``). A test missing from some
    runs (moved to the long tier where bf16 is slow) is fitted on the runs it is in: with one, all of its time is
    fixed."""
    nodes = sorted(set().union(*(r["durations"] for r in runs)))
    out = {}
    for node in nodes:
        rows = [(1.0, 1.0 / r["rates"]["bf16"], 1.0 / r["rates"]["fp32"], r["durations"][node])
                for r in runs if node in r["durations"]]
        arr = np.array(rows)
        if len(rows) == 1:
            x = np.array([arr[0, 3], 0.0, 0.0])
        else:
            x = _nnls3(arr[:, :3], arr[:, 3])
        out[node] = [round(float(v), 4) for v in x]
    return out


