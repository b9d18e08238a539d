"""Overlap where it pays: time the first steps with the overlap on and off, agree across ranks, keep the faster.

[Note: overlap where it pays] Overlap on and off give the same bits (the waves launched in backward are validated
at ``step()``; launched there, they are the synchronous step), so which one runs is a question of speed alone. It
pays where the lanes have something to hide in: a GPU, whose side streams run beside backward's kernels. It can
cost where they have not: two ranks on two cores, or a CPU without native bf16, where NS is several times
backward and the lane threads only compete with it for the cores. ``auto_overlap=True`` measures instead of
guessing: after one untimed step, :data:`TRIAL` iterations run with the overlap on and :data:`TRIAL` with it off
(the runtime's synchronous plan: one wave, lanes inline; the first iteration after the switch, which builds the
new plan's routes, is not timed), each timed from its first ready gradient to the end of its ``step()`` (backward
and step: all that the overlap changes; the forward and whatever the loop does between steps, such as loading data,
logging, or another model's iterations, stay out of the clock). The medians are agreed across ranks (the largest of
each, on the runtime's gloo group: the slowest rank sets the pace), the faster mode is kept for the rest of the
run, and the choice and both times are logged once and kept in ``stats`` (``overlap_auto_on_us``,
``overlap_auto_off_us``, ``overlap_auto_chose_on``).

CPU: the step barrier has waited for every apply, so the host clock at the end of ``step()`` is the iteration's end.
CUDA: events recorded on the current stream at the first gradient and at the end of each ``step()``; the times are
read only once every event has completed (``query()``), so deciding adds no host sync (until then the last trial
mode stays).
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ._agreement import max_everywhere
from ._messages import warn_user

logger = logging.getLogger("overlap_muon")

__all__ = ["OverlapChoice", "TRIAL", "overlap_choice"]

#: Timed iterations per mode.
TRIAL = 5


class OverlapChoice:
    """The trial's schedule and clock; the runtime switches to the mode it says (:meth:`mode_for_next`) and keeps
    the mode every rank agrees on (:meth:`agreed`).

    Args:
        event: CUDA: returns a timing event recorded now on the current stream (``Lanes.current_stream_event``);
            ``None``: the host clock.
    """

    def __init__(self, event: Callable[[], Any] | None) -> None:
        self.event = event
        self.starts: list[Any] = []  # per iteration: its first gradient (or None: no hook fired), then its end
        self.ends: list[Any] = []
        self.result: tuple[float, float] | None = None  # agreed median seconds (on, off), once decided

    def _mark(self) -> Any:
        return self.event() if self.event is not None else time.perf_counter()

    def begin(self) -> None:
        """A gradient is ready: the first one since the last ``step()`` starts this iteration's clock (the forward
        and the loop's own work between steps, alike in both modes, stay out of it)."""
        if self.result is None and len(self.starts) == len(self.ends) and not self.complete():
            self.starts.append(self._mark())

    def mode_for_next(self) -> bool | None:
        """After a step ended: mark its end, and say the overlap the next iteration runs with during the trial
        (``None``: every trial iteration has been marked)."""
        if self.result is not None or self.complete():
            return None
        if len(self.starts) == len(self.ends):
            self.starts.append(None)  # no gradient hook fired: timed from the previous step's end
        self.ends.append(self._mark())
        return len(self.ends) <= TRIAL  # iterations 1..TRIAL on, then 1 + TRIAL off

    def complete(self) -> bool:
        """Every trial iteration has been marked (the medians may still wait for CUDA events)."""
        return len(self.ends) >= 2 * TRIAL + 2

    def medians(self) -> tuple[float, float] | None:
        """This rank's median iteration seconds with the overlap (on, off), once every trial iteration is timed and
        readable (CUDA: every event completed; no sync), else ``None``."""
        if self.result is not None or not self.complete():
            return None
        spans = [(s if s is not None else self.ends[k - 1], e)
                 for k, (s, e) in enumerate(zip(self.starts, self.ends)) if k > 0]
        if self.event is not None:
            if not all(m.query() for span in spans for m in span):
                return None
            took = [a.elapsed_time(b) / 1e3 for a, b in spans]
        else:
            took = [b - a for a, b in spans]
        return statistics.median(took[:TRIAL]), statistics.median(took[TRIAL + 1:])

    def agreed(self, group: Any) -> tuple[float, float] | None:
        """Once complete: every rank's medians, agreed (the largest of each over ``group``, the runtime's gloo
        group or ``None``: the slowest rank sets the pace), kept in :attr:`result`; ``None`` while some rank's
        times are not readable yet (one host collective per call until then, none after).

        Raises:
            RuntimeError: the collective failed (a rank left).
        """
        if not self.complete() or self.result is not None:
            return None
        mine = self.medians()
        times = torch.tensor([1.0, 0.0, 0.0] if mine is None else [0.0, *mine], dtype=torch.float64)
        if group is not None:
            max_everywhere(times, group)
        if times[0] > 0:
            return None
        self.result = (times[1].item(), times[2].item())
        on, off = self.result
        if not dist.is_initialized() or dist.get_rank() == 0:
            logger.info("OverlapMuon auto_overlap: the overlap stays %s (backward and step %.1f ms with it on, "
                        "%.1f ms off; medians of %d, slowest rank)", "on" if on <= off else "off", on * 1e3,
                        off * 1e3, TRIAL)
        return self.result


    def after_step(self, group: Any, switch: Callable[[bool], None], unhook: Callable[[], None],
                   stats: dict[str, int]) -> None:
        """A step ended: ``switch`` to the next trial iteration's mode, then, once every rank's times are in, to the
        agreed one for good (off: ``unhook`` drops what the overlap alone needs), kept in ``stats``."""
        trial = self.mode_for_next()
        if trial is not None:
            switch(trial)
        agreed = self.agreed(group)
        if agreed is None:
            return
        on, off = agreed
        switch(on <= off)
        if on > off:
            unhook()
        stats["overlap_auto_on_us"], stats["overlap_auto_off_us"] = round(on * 1e6), round(off * 1e6)
        stats["overlap_auto_chose_on"] = int(on <= off)


def overlap_choice(config: Any, async_step: bool, lanes: Any) -> OverlapChoice | None:
    """The trial of ``config.auto_overlap`` (on by default), or ``None`` where it does not run: without the
    option, or where another option decides the mode (``overlap=False``, ``async_step=True``, ``wave_slots``, or
    an ``overlap=True`` the user set while ``auto_overlap`` is the default). Where the user set ``auto_overlap``
    too, one warning at construction names the option that wins. ``lanes``: the runtime's (on CUDA the trial
    times with events on the current stream)."""
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
    return OverlapChoice(functools.partial(lanes.current_stream_event, timing=True) if lanes.cuda else None)

