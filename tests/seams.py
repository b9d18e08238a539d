"""Test seams, injected from the tests: the library has no test keyword and no test branch on its hot path.

``SeamedOverlapMuon(..., _testing=TestingSeam(...))`` builds a real ``OverlapMuon`` and then wraps methods of its
wave pipeline *instance* (the class is untouched), so a test can slow NS down to make the overlap observable,
record a timeline of launches / NS starts / waits, count or break NS calls, or run something inside each apply.
Without ``_testing`` it is a plain ``OverlapMuon``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from overlap_muon import OverlapMuon
__all__ = ["TestingSeam", "SeamedOverlapMuon", "attach"]


@dataclass
class TestingSeam:
    """What a test injects (every field read at call time, so a test may change it after construction).

    Attributes:
        ns_delay_s: seconds slept at the start of each NS task, on its lane (makes overlap observable on CPU).
        timeline: when a list, ``(event, wave, time.perf_counter())`` records of ``launch``, ``ns_start``,
            ``wait_begin`` and ``wait_end``.
        ns_wrap: when set, ``ns_wrap(ns, mats, kw)`` replaces each NS call ``ns(mats, kw)`` (count calls, inject a
            failure).
        on_state: when set, called with each launched ``WaveState``.
        before_apply: when set, called at the start of each apply task, on its lane (CUDA: inside its stream).
    """

    __test__ = False  # not a pytest class

    ns_delay_s: float = 0.0
    timeline: list[tuple[str, int, float]] | None = None
    ns_wrap: Callable[..., Any] | None = None
    on_state: Callable[[Any], None] | None = None
    before_apply: Callable[[Any], None] | None = None

    def record(self, event: str, wave: int) -> None:
        if self.timeline is not None:
            self.timeline.append((event, wave, time.perf_counter()))


def attach(pipeline: Any, seam: TestingSeam) -> None:
    """Wrap ``pipeline``'s launch, NS, apply and wait methods (instance attributes) with ``seam``."""
    launch, ns_task, apply_task, wait = pipeline.launch, pipeline._ns_task, pipeline._apply_task, pipeline.wait
    ctx = pipeline._ctx  # the exchanges' NS (exchanges.ExchangeContext)
    ns_many, team_ns = ctx.ns, ctx.team_ns

    def _launch(wave: Any, hyper: Any, committed: bool = False) -> Any:
        seam.record("launch", wave.index)
        st = launch(wave, hyper, committed)
        if seam.on_state is not None:
            seam.on_state(st)
        return st

    def _ns_task(st: Any) -> None:
        if seam.ns_delay_s:
            time.sleep(seam.ns_delay_s)
        if not st.empty:
            seam.record("ns_start", st.wave.index)
        ns_task(st)

    def _wrapped(ns: Callable[..., Any]) -> Callable[..., Any]:
        def call(mats: Any, kw: dict) -> Any:
            return seam.ns_wrap(ns, mats, kw) if seam.ns_wrap is not None else ns(mats, kw)

        return call

    def _apply_task(st: Any, *args: Any) -> None:
        if seam.before_apply is not None:
            seam.before_apply(st)
        apply_task(st, *args)

    def _wait(waves: Any, streams: Any = ()) -> None:
        waves = list(waves)
        with pipeline._lock:
            pending = [k for k in waves if k in pipeline._applied]
        for k in pending:
            seam.record("wait_begin", k)
        wait(waves, streams)
        for k in pending:
            seam.record("wait_end", k)

    pipeline.launch, pipeline._ns_task, pipeline._apply_task, pipeline.wait = _launch, _ns_task, _apply_task, _wait
    ctx.ns, ctx.team_ns = _wrapped(ns_many), _wrapped(team_ns)


class SeamedOverlapMuon(OverlapMuon):
    """``OverlapMuon`` with a :class:`TestingSeam` attached after construction (``_testing=``)."""

    def __init__(self, *args: Any, _testing: TestingSeam | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._testing = _testing if _testing is not None else TestingSeam()
        attach(self._pipeline, self._testing)
