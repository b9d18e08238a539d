"""The lane context: every side stream / worker thread of the runtime lives here, and the profiler ranges its
tasks run in.

A wave runs as up to six tasks on three lanes, each lane FIFO in wave order (docs/design.md, invariant 2):

- ``to_home``   -- ``check`` (the gradient-presence check, when the wave runs one), ``pack`` (momentum, Nesterov,
  bf16 cast) and ``a2a_to_home`` (the exchange to the ranks that orthogonalize each matrix);
- ``compute``   -- ``ns``, on what this rank orthogonalizes;
- ``from_home`` -- ``a2a_from_home`` (the exchange back to the shards), then ``apply`` (queued by ``step()``).

Every task runs inside a ``torch.profiler.record_function`` range named ``OverlapMuon::wave{k}::{phase}`` (and an
NVTX range with ``nvtx``), so a ``torch.profiler`` trace and an Nsight Systems timeline (``nsys profile
--trace=cuda,nvtx,osrt``) show the same ranges.

[Note: one process-group set per communicating lane] ``to_home`` and ``from_home`` issue collectives
concurrently (wave k+1's gather while wave k's scatter), so each uses its own process groups: on each group
every rank issues the same collectives in the same (wave) order, whatever the timing. Sharing one group would
let rank A run "scatter k" while rank B runs "gather k+1" on it: a mismatch.

Backends:

- CPU (gloo): one worker thread per lane, ``concurrent.futures`` futures as the handles. A task first waits on
  its dependencies' futures, so an exception in one lane reaches every later task and, at the next wait point,
  the main thread, with the original traceback chained. CUDA keeps a task's error in its handle the same way (a
  dependent task is not run and carries it), so an error found while backward launches a wave (an out-of-memory
  in a pack) is raised at the next wait, not inside the grad hook.
- CUDA: one stream per lane, created here, each with a comment on why it exists; a task is enqueued at once
  from the calling thread on its stream after ``wait_event`` on its dependencies, and records an event. Every
  "current stream" is the one of the params' device, named: a process whose current device is another (params on
  ``cuda:k`` without ``set_device(k)``) must not order the lanes against ``cuda:0``. The
  tensors a task touches are kept by the wave pipeline's ``WaveState`` next to that event until the event has
  completed (invariant 5: no ``record_stream``).
- inline (``side_streams=False``): the task runs immediately on the calling thread (the ablation baseline).

[Note: a waiting thread helps] On CPU the thread that waits for the lanes (``step()``'s barrier, ``async_step``'s
forward waits, ``synchronize()``) would sit idle while the compute lane works through its queue. A compute task
submitted ``shareable`` (it issues no collective, so which thread runs it cannot change any rank's collective
order) may run on either thread, once: the lane's worker takes the queue from the front, and :meth:`Lanes.help`,
called by the waiting thread, takes it from the back (the last waves: those the next forward needs first). A task
the helper took is still a step of the lane's queue: when the worker reaches it, it waits for the helper and hands
on its value or error, so the task's handle resolves in queue order, as without help.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

__all__ = ["Lanes", "LaneHandle", "LANES", "PHASES", "prof_range", "wave_range_name"]

LANES = ("to_home", "compute", "from_home")

#: The ranged phases of one wave, in pipeline order.
PHASES = ("pack", "a2a_to_home", "ns", "a2a_from_home", "apply")

try:  # the nvtx package is a declared dependency, but keep the CPU path alive without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover
    _nvtx = None


def wave_range_name(wave: int, phase: str) -> str:
    """``OverlapMuon::wave{wave}::{phase}``."""
    return f"OverlapMuon::wave{wave}::{phase}"


@contextlib.contextmanager
def prof_range(name: str, *, nvtx: bool = False) -> Iterator[None]:
    """Emit ``name`` as a ``record_function`` range, and as an NVTX range when ``nvtx`` is True."""
    nv = None
    if nvtx:
        if _nvtx is not None:
            nv = _nvtx.annotate(name, domain="OverlapMuon")
        elif torch.cuda.is_available():
            nv = torch.cuda.nvtx.range(name)
    with torch.profiler.record_function(name):
        if nv is None:
            yield
        else:
            with nv:
                yield


class LaneHandle:
    """The result of a lane task and how to wait for it.

    Attributes:
        lane: the lane's name.
        future: CPU/inline: a ``concurrent.futures.Future`` holding the task's return value.
        event: CUDA: recorded on the lane's stream after the task's kernels (recorded by the lane, waited on by
            later tasks, forward pre-hooks and ``synchronize()``).
        error: CUDA: what the task raised when it was enqueued (or its failed dependency's), kept for the next wait,
            as a CPU task's future keeps it: not raised inside the grad hook that launched the wave.
    """

    __slots__ = ("lane", "future", "event", "value", "device", "error")

    def __init__(self, lane: str, device: torch.device | None = None) -> None:
        self.lane, self.device = lane, device  # CUDA: the lanes' device, whose current stream waits on the event
        self.future: cf.Future | None = None
        self.event: Any = None
        self.value: Any = None
        self.error: BaseException | None = None

    def result(self) -> Any:
        """Block the calling thread until the task is done (host side) and return its value; re-raise its error."""
        if self.future is not None:
            return self.future.result()
        if self.error is not None:
            raise self.error
        return self.value

    def settle(self) -> None:
        """Block until the task's host side has finished, without raising its error (CPU: its future; CUDA and
        inline tasks ran at submit)."""
        if self.future is not None:
            cf.wait([self.future])

    def done(self) -> bool:
        if self.future is not None:
            return self.future.done()
        if self.event is not None:
            return bool(self.event.query())
        return True

    def wait(self, streams: Sequence[Any] = ()) -> None:
        """Make the caller wait for the task (CPU: the host; CUDA: the current stream and ``streams``, the host
        returns); raise its error (a ``ValueError`` stays one: bad input found on a lane is raised on every rank).

        Raises:
            ValueError: the task found bad input (the gradient-presence check).
            RuntimeError: the task failed; its exception is chained.
        """
        try:
            if self.error is not None:
                raise self.error
            if self.event is not None:
                torch.cuda.current_stream(self.device).wait_event(self.event)
                for s in streams:
                    s.wait_event(self.event)
            else:
                self.result()
        except ValueError as e:
            raise ValueError(f"OverlapMuon: {e}") from e
        except BaseException as e:
            raise RuntimeError(
                f"OverlapMuon: a {self.lane} lane task failed (see the chained exception for its traceback); "
                "the step's Muon update is incomplete"
            ) from e


class _Shared:
    """A task that the lane's worker or a helping thread runs, whichever takes it first ([Note: a waiting thread
    helps])."""

    __slots__ = ("fn", "taken", "done", "value", "error")

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn: Callable[[], Any] | None = fn
        self.taken = False
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def run(self) -> None:
        """Run the task on this thread (the caller has taken it)."""
        fn, self.fn = self.fn, None  # the closure holds the wave's tensors: drop it once run
        try:
            self.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed on by the worker, as any lane error
            self.error = e
        finally:
            self.done.set()

    def result(self) -> Any:
        self.done.wait()
        if self.error is not None:
            raise self.error
        return self.value


class Lanes:
    """Owns the runtime's side streams (CUDA) or worker threads (CPU).

    Args:
        device: where the Muon params live.
        side_streams: False runs every task inline on the calling thread.
        nvtx: the tasks' ranges are NVTX ranges too.
    """

    def __init__(self, device: torch.device, *, side_streams: bool = True, nvtx: bool = False) -> None:
        self.device, self.nvtx = device, nvtx
        self.cuda = device.type == "cuda" and side_streams
        self.inline = not side_streams
        self._executors: dict[str, cf.ThreadPoolExecutor] = {}
        self._streams: dict[str, Any] = {}
        self._shared: list[_Shared] = []  # shareable compute tasks, in queue order ([Note: a waiting thread helps])
        self._shared_lock = threading.Lock()
        if self.cuda:
            # to_home: pack + gather all_to_all, off the default stream so backward kernels keep running.
            self._streams["to_home"] = torch.cuda.Stream(device=device)
            # compute: NS kernels, separate so wave k's NS overlaps wave k+1's gather and wave k-1's scatter.
            self._streams["compute"] = torch.cuda.Stream(device=device)
            # from_home: scatter all_to_all + apply, its own stream because its NCCL group differs from to_home's.
            self._streams["from_home"] = torch.cuda.Stream(device=device)
        elif not self.inline:
            for name in LANES:
                self._executors[name] = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"overlap_muon_{name}")

    def submit(self, lane: str, fn: Callable[[], Any], deps: Sequence[LaneHandle] = (), name: str | None = None,
               shareable: bool = False) -> LaneHandle:
        """Run ``fn()`` on ``lane`` after ``deps``, inside the profiler range ``name`` (if any); return its handle.
        ``shareable`` (CPU worker threads only): a thread in :meth:`help` may run it instead of the worker.

        CPU: ``fn`` runs on the lane's thread under ``torch.no_grad()`` (grad mode is thread-local) after every
        dependency's future has resolved (a failed dependency fails this task with the same error).
        CUDA: ``fn`` runs now on the calling thread inside the lane's stream, which first waits on the
        dependencies' events and on the current stream (the producer of the inputs); the tensors it touches are
        kept by the caller (``WaveState``) until the current stream has waited on the wave's apply ([Note: release
        on time] in ``_pipeline.py``); an error it raises stays in the handle for the next wait.
        """
        h = LaneHandle(lane, self.device)
        if name is not None:
            fn = _ranged(fn, name, self.nvtx)

        def run() -> Any:
            for d in deps:
                d.result()
            with torch.no_grad():
                return fn()

        if self.cuda:
            self._enqueue(h, self._streams[lane], fn, deps)
            return h
        if self.inline:
            f: cf.Future = cf.Future()
            try:
                f.set_result(run())
            except BaseException as e:  # noqa: BLE001 - surfaced at the next wait, like a lane error
                f.set_exception(e)
            h.future = f
            return h
        if shareable:
            h.future = self._executors[lane].submit(self._share(run))
        else:
            h.future = self._executors[lane].submit(run)
        return h

    def _enqueue(self, h: LaneHandle, stream: Any, fn: Callable[[], Any], deps: Sequence[LaneHandle]) -> None:
        """CUDA: enqueue ``fn`` on ``stream`` now, after ``deps`` and the current stream; record ``h``'s event. An
        error (``fn``'s, or a dependency's: ``fn`` is then not run) stays in ``h`` for the next wait."""
        failed = next((d.error for d in deps if d.error is not None), None)
        if failed is not None:  # as a CPU task whose dependency failed: not run, the same error
            h.error = failed
            return
        stream.wait_stream(torch.cuda.current_stream(self.device))
        for d in deps:
            if d.event is not None:
                stream.wait_event(d.event)
        try:
            with torch.cuda.stream(stream):
                with torch.no_grad():
                    h.value = fn()
                h.event = torch.cuda.Event()
                h.event.record(stream)
        except Exception as e:  # noqa: BLE001 - kept for the next wait, as a CPU future keeps it
            h.error = e
        # The tensors the task touched are kept alive by the caller (the wave pipeline's WaveState) until the
        # current stream has waited on the apply that follows them ([Note: release on time] in _pipeline.py).

    def _share(self, run: Callable[[], Any]) -> Callable[[], Any]:
        """Queue ``run`` as a :class:`_Shared` task; return what the lane's worker runs for it."""
        task = _Shared(run)
        with self._shared_lock:
            self._shared.append(task)

        def by_worker() -> Any:
            with self._shared_lock:
                mine = not task.taken
                task.taken = True
                if mine:
                    self._shared.remove(task)
            if mine:
                task.run()
            return task.result()  # taken by a helper: wait for it, hand on its value or error

        return by_worker

    def help(self) -> None:
        """Run the shareable tasks no thread has taken yet on the calling thread, last queued first; return once
        none is left ([Note: a waiting thread helps]). Their errors reach the waiters through the lane, not here."""
        while True:
            with self._shared_lock:
                if not self._shared:
                    return
                task = self._shared.pop()
                task.taken = True
            task.run()

    def capturing(self) -> bool:
        """The current CUDA stream is capturing a CUDA graph: nothing may be queued on the lanes now (and a graph's
        replay runs no Python hook). Off CUDA always False; no host sync."""
        if self.device.type != "cuda":
            return False
        with torch.cuda.device(self.device):
            return torch.cuda.is_current_stream_capturing()

    def refuse_capture(self, what: str) -> None:
        """Raise a ``RuntimeError`` saying ``what`` (why it cannot run captured, and the fix) when the current
        stream is capturing a CUDA graph ([Note: CUDA graph capture] in ``_wiring.py``): an event query or a wait on
        an event recorded outside the capture would invalidate it, and a replay would run none of it."""
        if self.capturing():
            raise RuntimeError(f"OverlapMuon: {what}")

    def current_stream_event(self, timing: bool = False) -> Any:
        """CUDA: an event recorded now on the current stream (``timing``: one that ``elapsed_time`` can read; the
        clock of ``auto_overlap``'s trial)."""
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker threads after the queued tasks finish (``wait``: block until they have)."""
        for ex in self._executors.values():
            ex.shutdown(wait=wait)
        self._executors.clear()


def flag_to_host(flag: torch.Tensor) -> tuple[Any, torch.Tensor]:
    """``(event, host)``: a 0-d ``flag`` copied without a sync to pinned host memory behind an event recorded on
    the current stream of its device (``host`` is valid once ``event.query()``); a CPU flag as it is, with ``None``."""
    if flag.device.type == "cpu":
        return None, flag
    host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
    host.copy_(flag, non_blocking=True)
    event = torch.Event(flag.device)
    event.record(torch.get_device_module(flag.device).current_stream(flag.device))
    return event, host


def _ranged(fn: Callable[[], Any], name: str, nvtx: bool) -> Callable[[], Any]:
    def call() -> Any:
        with prof_range(name, nvtx=nvtx):
            return fn()

    return call
