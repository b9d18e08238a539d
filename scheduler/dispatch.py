"""Dispatch of the planned waves: the per-step state machine, which backward launches them, and the recorder of the
gradient-ready order.

Dispatch (:class:`WaveDispatcher`) is the per-step state machine that turns gradient-ready marks, arriving in any
order from any thread, into ``launch(wave)`` calls in strict wave order (docs/design.md, invariant 2: every rank
issues the exchanges in the same order). :class:`BackwardCount` says which backward pass of a step's gradient
accumulation launches them. :class:`ReadinessRecorder` measures the gradient-ready order that the plan
(``scheduler/waves.py``) is built from.

[Note: learned accumulation] A loop that accumulates gradients over ``n`` backward passes per step without
``no_sync()`` would launch every wave from each of them, and each later backward makes the earlier launch stale:
NS ``n`` times per matrix per step, exact but ``n`` times the work. :class:`BackwardCount` counts the backward
passes between steps and, from the count of the steps before, says whether the backward running now is one the
loop runs before its last: its gradients are not final, so its hooks launch nothing. A wrong guess stays exact:
an extra backward makes the waves launched before it stale (they run again, as without the guess), a missing one
leaves every launch to ``step()``.

The guess (:attr:`BackwardCount.expected`) is the first step's count, then a count two steps in a row had: a
shorter last accumulation of an epoch (one step with fewer passes) costs that step its overlap and leaves the
guess as it was. Every rank runs the same backward passes (their collectives pair up), so every rank guesses the
same and launches the same waves.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from .waves import Wave

__all__ = ["LearnedEdits", "WaveDispatcher", "BackwardCount", "ReadinessRecorder"]


class WaveDispatcher:
    """Turns per-param "gradient ready" marks into ``launch(wave)`` calls, strictly in wave order.

    A wave is launched once every one of its params is marked and every earlier wave has been launched, so
    the launch sequence is ``waves[0], waves[1], ...`` on every rank whatever order (or thread) the marks
    arrive in. :meth:`flush` launches what is left, so a param whose gradient never arrives cannot stall a
    wave (docs/design.md, invariant 3).

    [Note: launch under the lock] ``launch`` is called while holding the dispatcher's lock. That is the
    simplest way to keep launches in order when marks race on several threads (autograd device threads, a
    DDP comm hook's completion thread): a thread that finds wave k launchable launches it before any other
    thread can look at wave k+1. The cost is that ``launch`` should be quick (enqueue work on a lane, not do
    it). The lock is re-entrant: a ``launch`` that itself calls :meth:`mark_ready` or :meth:`flush` on the
    same thread only records the mark; the outer launch loop picks it up after ``launch`` returns, so order
    still holds. If ``launch`` raises, the exception propagates, that wave counts as not launched and the
    dispatcher refuses further marks and flushes (``RuntimeError``) until :meth:`reset`: a half-launched
    step must not go on issuing collectives.

    Args:
        waves: the plan, ``waves[k].index == k``, each param in exactly one wave, no empty wave.
        launch: called once per wave per step with the :class:`Wave`.

    Raises:
        ValueError: a wave's index is not its position, a wave is empty, or a param is in two waves.
    """

    def __init__(self, waves: Sequence[Wave], launch: Callable[[Wave], None]) -> None:
        self._waves = tuple(waves)
        self._launch = launch
        self._wave_of: dict[int, int] = {}
        for k, w in enumerate(self._waves):
            if w.index != k:
                raise ValueError(f"wave at position {k} has index {w.index}; expected {k}")
            if not w.params:
                raise ValueError(f"wave {k} has no params")
            for i in w.params:
                if i in self._wave_of:
                    raise ValueError(f"param {i} is in wave {self._wave_of[i]} and wave {k}")
                self._wave_of[i] = k
        self._lock = threading.RLock()
        self._in_launch = False
        self._pending_flush = False
        self._failed: BaseException | None = None
        self.reset()

    def reset(self) -> None:
        """Start a new step: forget every mark and launch."""
        with self._lock:
            self._marked: set[int] = set()
            self._remaining = [len(w.params) for w in self._waves]
            self._next = 0
            self._failed = None

    @property
    def num_waves(self) -> int:
        return len(self._waves)

    @property
    def launched(self) -> int:
        """Number of waves launched this step (waves ``0 .. launched-1``)."""
        with self._lock:
            return self._next

    def mark_ready(self, i: int) -> None:
        """Param ``i``'s gradient is ready; launch every wave that has become launchable, in order.

        Marking a param twice in a step is a no-op. Thread-safe.

        Raises:
            ValueError: ``i`` is in no wave.
            RuntimeError: an earlier ``launch`` raised this step.
        """
        k = self._wave_of.get(i)
        if k is None:
            raise ValueError(f"param {i!r} is in no wave (known params: {len(self._wave_of)})")
        with self._lock:
            self._check_failed()
            if i in self._marked:
                return
            self._marked.add(i)
            self._remaining[k] -= 1
            self._drain(flush=False)

    def flush(self) -> int:
        """Launch every wave not yet launched, in order, marked or not. Returns how many it launched.

        Raises:
            RuntimeError: an earlier ``launch`` raised this step.
        """
        with self._lock:
            self._check_failed()
            before = self._next
            self._drain(flush=True)
            return self._next - before

    def _check_failed(self) -> None:
        if self._failed is not None:
            raise RuntimeError(
                f"a launch failed earlier this step (wave {self._next}: {self._failed!r}); call reset()"
            )

    def _drain(self, flush: bool) -> None:
        # Called with the lock held. A re-entrant call from inside launch only records its mark (done by the
        # caller); the running loop below re-reads the state after launch returns.
        if self._in_launch:
            if flush:
                self._pending_flush = True
            return
        self._pending_flush = flush
        self._in_launch = True
        try:
            while self._next < len(self._waves) and (self._pending_flush or self._remaining[self._next] == 0):
                wave = self._waves[self._next]
                try:
                    self._launch(wave)
                except BaseException as e:
                    self._failed = e
                    raise
                self._next += 1
        finally:
            self._in_launch = False
            self._pending_flush = False


class BackwardCount:
    """Counts the backward passes between optimizer steps and guesses how many the next step will have.

    Attributes:
        expected: backward passes per step the loop is expected to run (1 until a step has been counted).
    """

    def __init__(self) -> None:
        self.expected = 1
        self._seen = 0  # backward passes ended since the last step
        self._last: int | None = None  # the count of the step before

    def holds(self) -> bool:
        """The backward running now comes before the one expected to be the last of the step: launch nothing."""
        return self._seen + 1 < self.expected

    def accumulating(self) -> bool:
        """The backward running now follows another of the same step: it adds into the gradients that one left."""
        return self._seen > 0

    def backward_ended(self) -> None:
        """A backward pass of this step ended (the gradient-ready hooks' end-of-backward callback)."""
        self._seen += 1

    def stepped(self) -> None:
        """A step ended: update the guess from its count (none counted: readiness came from elsewhere, e.g. DDP's
        comm hook, and the guess stays)."""
        n, self._seen = self._seen, 0
        if n:
            if self._last is None or n == self._last:
                self.expected = n
            self._last = n


class LearnedEdits:
    """[Note: learned clipping] A gradient edit between backward and ``step()`` (a clip that bites, GradScaler's
    unscale, a user's scaling) makes every wave launched in backward stale: it re-runs in ``step()``, so the step
    does its optimizer work twice. Where such edits repeat (LLM training often clips every step early on), the
    step after one that was edited launches nothing in backward (:meth:`holds`) and launches its waves in
    ``step()``, after the edit, once: the synchronous step's cost, not twice it. Such a held step still learns
    whether the edit happened (its gradients' version counters moved between the end of backward and ``step()``,
    or ``max_grad_norm``'s own clip bit): once a step is not edited, speculation resumes at the next one. Exact
    either way: a held wave reads what the edit left. The ranks decide alike (or their collectives would part): a
    speculative step holds the next one when the agreed set of re-run waves is not empty, whatever the cause; a held
    step's edit is agreed over the ranks (one host flag).

    Args:
        snapshot: what the gradients are now (``_version_fix.snapshot``), taken at the end of a held backward.
        edited: whether the gradients were edited since a snapshot (``_version_fix.edited_since``).
    """

    def __init__(self, snapshot: Callable[[], Any], edited: Callable[[Any], bool]) -> None:
        self.hold = False
        self._snapshot, self._edited = snapshot, edited
        self._then: Any = None  # the gradients at the end of a held backward

    def backward_ended(self) -> None:
        """A backward ended: a held step remembers its gradients."""
        if self.hold:
            self._then = self._snapshot()

    def stepped(self, reruns: int, clipped: bool, any_rank: Callable[[bool], bool]) -> None:
        """The step's waves are committed: ``reruns`` waves re-ran (agreed over the ranks), ``clipped``: the
        optimizer's own clip bit. A held step asks ``any_rank`` (a max of one flag over the ranks) whether its
        gradients were edited since its backward ended. The next step holds exactly when this one was edited."""
        held = self.hold
        moved = held and self._then is not None and self._edited(self._then)
        self.hold, self._then = reruns > 0 or (held and any_rank(moved or clipped)), None


class ReadinessRecorder:
    """Records the order in which params' gradients became ready during one step.

    Feed it the same marks as the dispatcher (thread-safe; only a param's first mark in a step counts) and
    read :meth:`order` after backward. Ranks can observe different orders (thread timing, DDP buckets), so a
    caller that plans from it broadcasts one rank's order (e.g. rank 0's) before :func:`plan_waves`.

    Args:
        num_params: params are ``0 .. num_params-1``.

    Raises:
        ValueError: ``num_params < 0``.
    """

    def __init__(self, num_params: int) -> None:
        if not isinstance(num_params, int) or num_params < 0:
            raise ValueError(f"num_params must be an int >= 0, got {num_params!r}")
        self._n = num_params
        self._lock = threading.Lock()
        self._seen: dict[int, None] = {}  # insertion-ordered set

    def mark_ready(self, i: int) -> None:
        """Record param ``i`` (first occurrence only). Raises ValueError if ``i`` is out of range."""
        if not isinstance(i, int) or not 0 <= i < self._n:
            raise ValueError(f"param index {i!r} out of range [0, {self._n})")
        with self._lock:
            self._seen.setdefault(i, None)

    @property
    def recorded(self) -> tuple[int, ...]:
        """Params marked so far this step, in mark order."""
        with self._lock:
            return tuple(self._seen)

    def order(self) -> list[int]:
        """A full permutation of ``range(num_params)``: the marked params in mark order, then the unmarked ones
        in reverse index order (the order backward usually reaches them)."""
        with self._lock:
            seen = list(self._seen)
        marked = set(seen)
        rest = [i for i in range(self._n - 1, -1, -1) if i not in marked]
        return seen + rest

    def reset(self) -> None:
        """Start a new step."""
        with self._lock:
            self._seen.clear()
