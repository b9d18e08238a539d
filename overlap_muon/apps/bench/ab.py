"""Two checkouts' bench figures side by side, in one run: the cases run alternately (A, B, A, B, ...) so that both
see the same machine load, and the ratios of each round and their medians are printed.

Each checkout needs its own environment with the project installed (``pip install -e``) and torch; give each one's
Python. Issue 31 used it to compare ``main`` before and after the wave-reads change:

    python -m overlap_muon.apps.bench.ab /tmp/oldvenv/bin/python .venv/bin/python --cases overlap,overhead --rounds 3

Prints, per case and ratio key, A's and B's value in each round and the medians; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile


def _bench(python: str, cases: str, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "bench.json")
        cmd = [python, "-m", "overlap_muon.apps.bench", "--quick", "--cases", cases, "--json", out, *extra]
        subprocess.run(cmd, check=True, cwd=tmp, stdout=subprocess.DEVNULL)
        with open(out) as f:
            return json.load(f)


def _ratios(report: dict) -> dict[str, float]:
    """``case.key -> value`` of every ratio measured in a bench JSON report."""
    return {k: float(v) for k, v in report.get("ratios", {}).items() if isinstance(v, (int, float))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("python_a")
    ap.add_argument("python_b")
    ap.add_argument("--cases", default="overlap,overhead")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json")
    args, extra = ap.parse_known_args()
    rounds: dict[str, dict[str, list[float]]] = {"a": {}, "b": {}}
    for r in range(args.rounds):
        for side, python in (("a", args.python_a), ("b", args.python_b)):
            report = _bench(python, args.cases, extra)
            for key, value in _ratios(report).items():
                rounds[side].setdefault(key, []).append(value)
            rates = {k: v for k, v in report.get("machine", {}).items() if "gflop" in k.lower() or "load" in k}
            print(f"round {r + 1} {side} done; machine: {rates}", file=sys.stderr, flush=True)
    print(f"{'ratio':58s} {'A rounds':>26s} {'B rounds':>26s} {'A med':>7s} {'B med':>7s}")
    for key in sorted(rounds["a"]):
        a, b = rounds["a"][key], rounds["b"].get(key, [])
        fmt = lambda xs: " ".join(f"{x:.3f}" for x in xs)  # noqa: E731
        print(f"{key:58s} {fmt(a):>26s} {fmt(b):>26s} {statistics.median(a):7.3f} "
              f"{statistics.median(b) if b else float('nan'):7.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)


if __name__ == "__main__":
    main()
