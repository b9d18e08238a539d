"""The test suite's time model: each test's ``[seconds, bf16_gflop, fp32_gflop]`` (``overlap_muon.apps.time_model``),
fitted to its durations in runs at different matmul rates (one CPU emulating others: docs/results.md, "Time
models") and stored in ``tests/time_model.json``.

``tests/conftest.py`` prints, after every run, the model's total for the tests that ran with this machine's rates
next to the measured total, and its total for the default tier on the slowest CPU we know (:data:`SLOWEST`:
no native bf16), whose budget is :data:`BUDGET_S`.

    python -m pytest -q --time-log run.json          # durations and rates of one run
    python -m tests.time_model fit a.json b.json c.json   # refit tests/time_model.json from three or more runs
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from overlap_muon.apps.time_model import SLOWEST, fit, predict

__all__ = ["MODEL", "SLOWEST", "BUDGET_S", "load", "predict", "fit"]

MODEL = Path(__file__).with_name("time_model.json")
#: What the model may predict for the default tier on :data:`SLOWEST` (the test command's budget is 10 min).
BUDGET_S = 540.0


def load() -> dict[str, list[float]]:
    """``{nodeid: [seconds, bf16_gflop, fp32_gflop]}`` (empty without a model file)."""
    return json.loads(MODEL.read_text())["tests"] if MODEL.exists() else {}


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
