"""The driver of ``overlap-muon-bench``: the argument parser, the header, the case registry, running the chosen
cases, the table and the JSON. Re-exported by the package (``overlap_muon.apps.bench.main`` is the console script).

The registry maps each case name to its module; a case module has ``RATIO_KEYS`` (the keys of its ``ratios`` in
the JSON) and ``run(options) -> result``. This module imports the case modules; they import only
:mod:`overlap_muon.apps.bench.common` and the library, so there is no import cycle.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import time
from types import ModuleType
from typing import Any

from overlap_muon.apps.time_model import spawn_seconds

from . import balance, choice, comm, memory, ns, overhead, overlap, peers, step, surplus
from .budget import QUICK_MODEL, quick_summary
from .common import _Options, _two_thread_speedup, machine_info, matmul_gflops, quiet_split_log, slow_bf16

__all__ = ["main", "CASES", "CASE_MODULES", "expected_ratio_keys", "machine_info"]

#: Case name -> its module, in the order a full run executes them.
CASE_MODULES: dict[str, ModuleType] = {
    "step": step,
    "overhead": overhead,
    "ns": ns,
    "comm": comm,
    "overlap": overlap,
    "choice": choice,
    "balance": balance,
    "surplus": surplus,
    "memory": memory,
    "peers": peers,
}

#: Case names, in the order a full run executes them.
CASES: tuple[str, ...] = tuple(CASE_MODULES)

#: Cases a ``--quick`` run leaves out unless named, to stay within its budget on a CPU without native bf16
#: (``budget.py``): ``choice`` times ``auto_overlap`` after its trial (13 steps per world before it measures),
#: ``peers`` runs torchtitan's DistMuon beside us (a third of the quick run's bf16 NS there).
NOT_QUICK: tuple[str, ...] = ("choice", "peers")


def expected_ratio_keys(case: str) -> tuple[str, ...]:
    """The keys of ``cases[case]["ratios"]`` in the JSON (each present in every run of the case).

    Raises:
        ValueError: unknown case.
    """
    if case not in CASE_MODULES:
        raise ValueError(f"unknown bench case {case!r}; known: {', '.join(CASES)}")
    return CASE_MODULES[case].RATIO_KEYS


# ----------------------------------------------------------------------------------------------------------------
# py-spy, CLI
# ----------------------------------------------------------------------------------------------------------------


def _py_spy(o: _Options) -> dict[str, Any]:
    """Record a flame graph of the overhead case's OverlapMuon step (no baseline) with py-spy, if installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        msg = ("py-spy is not installed, so no flame graph was recorded; install it with `pip install py-spy` "
               "(or the project's [profile] extra) and rerun with --py-spy")
        print(msg)
        return {"ok": False, "message": msg}
    out = os.path.join(o.trace_dir, "overhead_flame.svg")
    os.makedirs(o.trace_dir, exist_ok=True)
    cmd = [exe, "record", "--output", out, "--format", "flamegraph", "--rate", "250", "--",
           sys.executable, "-m", "overlap_muon.apps.bench", "--cases", "overhead", "--no-baseline",
           "--repeats", "5" if o.quick else "20"]
    print("recording: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=o.timeout_s)
    except subprocess.TimeoutExpired:
        msg = f"py-spy ran past {o.timeout_s:.0f} s and was stopped; no flame graph"
        print(msg)
        return {"ok": False, "message": msg}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        msg = f"py-spy failed (exit {proc.returncode}): " + " | ".join(tail)
        print(msg)
        return {"ok": False, "message": msg}
    print(f"flame graph of the OverlapMuon dispatch path: {out}")
    return {"ok": True, "svg": out}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="overlap-muon-bench",
        description="Benchmarks of overlap-muon; each case measures our path and its baseline in the same run.",
        epilog=("Every case and its ratios are described in its module's docstring "
                "(pydoc overlap_muon.apps.bench.CASE, e.g. overlap_muon.apps.bench.comm)."),
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 cores)")
    ap.add_argument("--small", action="store_true",
                    help="half-size matrices in the NS-heavy cases, fewer tokens and iterations in the training cases; "
                         "on by itself with --quick where bf16 matmul is slower than fp32")
    ap.add_argument("--cases", default=None, help=f"comma-separated subset of {','.join(CASES)} (default: every "
                    f"case; with --quick every case but {', '.join(NOT_QUICK)})")
    ap.add_argument("--json", metavar="PATH", help="write every figure, ratio and the machine description here")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default: per case)")
    ap.add_argument("--no-baseline", action="store_true", help="overhead case: time our step only (what --py-spy records)")
    ap.add_argument("--py-spy", action="store_true", help="also record a flame graph of the overhead case's step")
    ap.add_argument("--trace-dir", default="traces", help="where traces, timelines and flame graphs go (%(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit of one multi-rank spawn, s (%(default)s)")
    return ap


def _header(info: dict[str, Any], o: _Options) -> str:
    return (f"overlap-muon bench ({'quick' if o.quick else 'full'}): {info['cpu_model']} "
            f"[{' '.join(info['cpu_simd'])}], {info['usable_cpus']}/{info['logical_cpus']} CPUs usable, "
            f"torch {info['torch']}, Python {info['python']}, load average {info['load_average_at_start']}, "
            f"two compute threads get {info['two_thread_speedup_at_start']:.2f} cores")


def main(argv: list[str] | None = None) -> int:
    """Run the selected cases, print a table, optionally write JSON; return 0, or 1 if any case failed.

    Raises:
        SystemExit: bad arguments (argparse), e.g. an unknown case name.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    cases = args.cases or ",".join(c for c in CASES if not (args.quick and c in NOT_QUICK))
    names = [c.strip() for c in cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        ap.error(f"--cases: unknown {unknown or 'empty list'}; choose from {','.join(CASES)}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.timeout > 0:
        ap.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    o = _Options(quick=args.quick, repeats=args.repeats, baseline=not args.no_baseline, trace_dir=args.trace_dir,
                 timeout_s=args.timeout)
    quiet_split_log()
    info = machine_info()
    info["two_thread_speedup_at_start"] = round(_two_thread_speedup(), 3)
    info["matmul_gflops"] = {k: round(v, 1) for k, v in matmul_gflops().items()}
    print(_header(info, o), flush=True)
    rates = info["matmul_gflops"]
    bf16_slow = slow_bf16(rates)
    o = dataclasses.replace(o, small=args.small or (o.quick and bf16_slow))
    print(f"matmul, 1 thread: bf16 {rates['bf16']:.0f} GFLOP/s, fp32 {rates['fp32']:.0f} GFLOP/s"
          + ("  (bf16 slower than fp32: no native bf16, so NS, in bf16, runs slowly here)" if bf16_slow else "")
          + ("; the NS-heavy cases use half-size matrices (--small)" if o.small else ""), flush=True)
    t_all = time.perf_counter()
    report: dict[str, Any] = {"schema": 1, "machine": info, "quick": o.quick, "cases": {}, "ratios": {}}
    failed = []
    for i, name in enumerate(names):
        t0 = time.perf_counter()
        print(f"[{i + 1}/{len(names)}] {name} ...", flush=True)
        try:
            res = CASE_MODULES[name].run(o)
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others' figures
            failed.append(name)
            print(f"\n== {name}: FAILED ({type(e).__name__})\n{e}", flush=True)
            report["cases"][name] = {"error": f"{type(e).__name__}: {e}",
                                     "ratios": {k: None for k in expected_ratio_keys(name)}}
            for k in expected_ratio_keys(name):
                report["ratios"][f"{name}.{k}"] = None
            continue
        dt = time.perf_counter() - t0
        print(f"\n== {name}: {res.title}  [{dt:.1f} s]", flush=True)
        for line in res.lines:
            print("   " + line)
        report["cases"][name] = {"title": res.title, "elapsed_s": dt, "ratios": res.ratios, "details": res.details}
        for k in expected_ratio_keys(name):
            report["ratios"][f"{name}.{k}"] = res.ratios.get(k)
    if args.py_spy:
        report["py_spy"] = _py_spy(o)
    report["elapsed_s"] = time.perf_counter() - t_all
    if o.quick and not failed and set(QUICK_MODEL) <= set(names):  # the model's figures are for the whole run
        line, report["time_model"] = quick_summary({n: report["cases"][n]["elapsed_s"] for n in names},
                                                   dict(rates, spawn=spawn_seconds(3)), o.small)
    with contextlib.suppress(OSError):
        info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\n{'ratio':<52}{'value':>10}")
    for k, v in report["ratios"].items():
        print(f"{k:<52}{'-' if v is None else format(v, '.4f'):>10}")
    print(f"total {report['elapsed_s']:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if "time_model" in report:
        print(line)
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if failed else 0

