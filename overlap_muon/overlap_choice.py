"""Overlap where it pays: time the first steps with the overlap on and off, agree across ranks, keep the faster.

[Note: overlap where it pays] Overlap on and off give the same bits (the waves launched in backward are validated
at ``step()``; launched there, they are the synchronous step), so which one runs is a question of speed alone. It
pays where the lanes have something to hide in: a GPU, whose side streams run beside backward's kernels. It can
cost where they have not: two ranks on two cores, or a CPU without native bf16, where NS is several times
backward and the lane threads only compete with it for the cores. ``auto_overlap=True`` measures instead of
guessing: after one untimed step, :data:`TRIAL` iterations run with the overlap on and :data:`TRIAL` with it off
(the runtime's synchronous plan: one wave, lanes inline; the first iteration after the switch, which builds the
new plan's routes, is not timed), each timed from the end of one ``step()`` to the end of the next (forward,
backward and step: the whole iteration). The medians are agreed across ranks (the largest of
each, on the runtime's gloo group: the slowest rank sets the pace), the faster mode is kept for the rest of the
run, and the choice and both times are logged once and kept in ``stats`` (``overlap_auto_on_us``,
``overlap_auto_off_us``, ``overlap_auto_chose_on``).

CPU: the step barrier has waited for every apply, so the host clock at the end of ``step()`` is the iteration's
end. CUDA: an event recorded on the current stream at the end of each ``step()``; the times are read only once
every event has completed (``query()``), so deciding adds no host sync (until then the last trial mode stays).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

from .messages import warn_user

__all__ = ["OverlapChoice", "TRIAL", "overlap_choice"]

#: Timed iterations per mode.
TRIAL = 5


class OverlapChoice:
    """The trial's schedule and clock; the runtime switches to the mode it says (:meth:`mode_for_next`) and agrees
    on its :meth:`medians`.

    Args:
        event: CUDA: returns a timing event recorded now on the current stream (``Lanes.current_stream_event``);
            ``None``: the host clock.
    """

    def __init__(self, event: Callable[[], Any] | None) -> None:
        self.event = event
        self.marks: list[Any] = []  # the end of each step from the first on: a host time or a CUDA event
        self.result: tuple[float, float] | None = None  # agreed median seconds (on, off), once decided

    def _mark(self) -> Any:
        return self.event() if self.event is not None else time.perf_counter()

    def mode_for_next(self) -> bool | None:
        """After a step ended: mark its end, and say the overlap the next iteration runs with during the trial
        (``None``: every trial iteration has been marked)."""
        if self.result is not None or self.complete():
            return None
        self.marks.append(self._mark())
        return len(self.marks) <= TRIAL  # iterations 1..TRIAL on, then 1 + TRIAL off

    def complete(self) -> bool:
        """Every trial iteration has been marked (the medians may still wait for CUDA events)."""
        return len(self.marks) >= 2 * TRIAL + 2

    def medians(self) -> tuple[float, float] | None:
        """This rank's median iteration seconds with the overlap (on, off), once every trial iteration is timed and
        readable (CUDA: every event completed; no sync), else ``None``."""
        if self.result is not None or not self.complete():
            return None
        if self.event is not None:
            if not all(e.query() for e in self.marks):
                return None
            gaps = [a.elapsed_time(b) / 1e3 for a, b in zip(self.marks, self.marks[1:])]
        else:
            gaps = [b - a for a, b in zip(self.marks, self.marks[1:])]
        return statistics.median(gaps[:TRIAL]), statistics.median(gaps[TRIAL + 1:])


def overlap_choice(config: Any, async_step: bool, event: Callable[[], Any] | None) -> OverlapChoice | None:
    """The trial of ``config.auto_overlap`` (on by default), or ``None`` where it does not run: without the
    option, or where another option decides the mode (``overlap=False``, ``async_step=True``, ``wave_slots``, or
    an ``overlap=True`` the user set while ``auto_overlap`` is the default). Where the user set ``auto_overlap``
    too, one warning at construction names the option that wins."""
    if not config.auto_overlap:
        return None
    chosen = config.sources.get("auto_overlap", "default") != "default"
    wins = ("overlap=False" if not config.overlap else "async_step=True" if async_step else
            f"wave_slots={config.wave_slots}" if config.wave_slots is not None else
            "overlap=True" if not chosen and config.sources.get("overlap", "default") != "default" else None)
    if wins is not None:
        if chosen:
            warn_user(f"OverlapMuon: auto_overlap=True does not combine with {wins}, which wins: no trial runs and "
                      f"the mode stays as {wins} sets it")
        return None
    return OverlapChoice(event)

