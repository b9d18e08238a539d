"""Benchmarks of overlap-muon: each case measures our path and its baseline in the same run, on the same inputs.

Usage::

    python -m overlap_muon.apps.bench                          # every case, full sizes
    overlap-muon-bench --quick --json traces/bench_quick.json
    python -m overlap_muon.apps.bench --cases comm,balance     # a subset
    python -m overlap_muon.apps.bench --cases overhead --py-spy  # plus a py-spy flame graph of the dispatch path

Times are medians over repeats after warm-up; where a case compares variants, the variants are interleaved
(A, B, A, B, ...) so drift in the machine's load hits both alike. Multi-rank cases spawn gloo ranks on a free
loopback port, one intra-op thread per rank (``torch.set_num_threads(1)``), with a hard timeout; world-1 cases
run in this process, also with one intra-op thread. Nothing here asserts a speed.

Cases (the JSON has every key of :func:`expected_ratio_keys`; a value is ``None`` where it could not be measured,
e.g. ``--no-baseline``), one module each, whose docstring says what the case measures and what each ratio means:
:mod:`.step`, :mod:`.overhead`, :mod:`.ns`, :mod:`.comm`, :mod:`.overlap`, :mod:`.balance`, :mod:`.surplus`,
:mod:`.memory`, :mod:`.peers`. Each has ``RATIO_KEYS`` and ``run(options)`` and imports only :mod:`.common` (the
shared options, timing helpers, rank spawner and model pieces) and the library; :mod:`.cli` (the parser, the
driver, the JSON) imports the case modules, and this package re-exports its ``main``. No module imports a
sibling case module, so there is no import cycle; the ranks a case spawns unpickle its module-level rank
functions by module path.
"""

from __future__ import annotations

from .cli import CASE_MODULES, CASES, expected_ratio_keys, machine_info, main

__all__ = ["main", "CASES", "CASE_MODULES", "expected_ratio_keys", "machine_info"]
