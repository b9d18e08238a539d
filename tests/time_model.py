"""A time model of the test suite: each test's duration as a fixed part plus a bf16 part and an fp32 part.

A test's duration on a machine whose one-thread matmul rates are ``bf16`` and ``fp32`` GFLOP/s is modelled as
``seconds + bf16_gflop / bf16 + fp32_gflop / fp32``: ``bf16_gflop`` is the work that runs at the bf16 matmul rate
(the NS, in bf16 as ``torch.optim.Muon``), ``fp32_gflop`` the work that runs at the fp32 rate (the models'
forward and backward, fp32 references), ``seconds`` the rest (spawning ranks, imports, Python, gloo). The three
numbers of each test are fitted to its measured durations on machines with different rates (``fit``: one CPU
emulating others, see docs/results.md, "The suite's time model"), and stored in ``tests/time_model.json``.

``tests/conftest.py`` prints, after every run, the model's total for the tests that ran with this machine's rates
next to the measured total, and its total for the default tier on the slowest CPU we know (:data:`SLOWEST`:
no native bf16), whose budget is :data:`BUDGET_S`.

    python -m pytest -q --time-log run.json          # durations and rates of one run
    python -m tests.time_model fit a.json b.json c.json   # refit tests/time_model.json from three or more runs
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import numpy as np

MODEL = Path(__file__).with_name("time_model.json")
#: One-thread matmul rates of the slowest CPU we know, GFLOP/s (a 2-core AMD EPYC with AVX2 only).
SLOWEST = {"bf16": 1.5, "fp32": 21.0}
#: What the model may predict for the default tier on :data:`SLOWEST` (the test command's budget is 10 min).
BUDGET_S = 540.0


def load() -> dict[str, list[float]]:
    """``{nodeid: [seconds, bf16_gflop, fp32_gflop]}`` (empty without a model file)."""
    return json.loads(MODEL.read_text())["tests"] if MODEL.exists() else {}


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


def main(argv: list[str]) -> None:
    if len(argv) < 2 or argv[0] != "fit":
        raise SystemExit("usage: python -m tests.time_model fit RUN.json [RUN.json ...]")
    runs = [json.loads(Path(p).read_text()) for p in argv[1:]]
    model = fit(runs)
    MODEL.write_text(json.dumps({"fitted_on": [r["rates"] for r in runs], "tests": model}, indent=0,
                                sort_keys=True) + "\n")
    for r in runs:
        got = sum(r["durations"].values())
        pred, _ = predict(model, r["durations"], r["rates"], r["rates"])
        print(f"bf16 {r['rates']['bf16']:.1f} fp32 {r['rates']['fp32']:.1f} GFLOP/s: measured {got:.0f} s, "
              f"model {pred:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
