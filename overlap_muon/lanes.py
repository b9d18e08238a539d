"""The lane context: every side stream / worker thread of the runtime lives here.

A wave runs as three tasks on three lanes, each lane FIFO in wave order (docs/design.md, invariant 2):

- ``to_home``   -- momentum update + bf16 cast + pack, then the ``all_to_all`` to the NS homes;
- ``compute``   -- batched NS on the home;
- ``from_home`` -- the ``all_to_all`` back to the shards, then the update applied to the param shards.

[Note: one process-group set per communicating lane] ``to_home`` and ``from_home`` issue collectives
concurrently (wave k+1's gather while wave k's scatter), so each uses its own process groups: on each group
every rank issues the same collectives in the same (wave) order, whatever the timing. Sharing one group would
let rank A run "scatter k" while rank B runs "gather k+1" on it: a mismatch.

Backends:

- CPU (gloo): one worker thread per lane, ``concurrent.futures`` futures as the handles. A task first waits on
  its dependencies' futures, so an exception in one lane reaches every later task and, at the next wait point,
  the main thread, with the original traceback chained.
- CUDA: one stream per lane, created here, each with a comment on why it exists; a task is enqueued at once
  from the calling thread on its stream after ``wait_event`` on its dependencies, and records an event. The
  tensors a task touches are kept by the wave pipeline's ``WaveState`` next to that event until the event has
  completed (invariant 5: no ``record_stream``).
- inline (``side_streams=False``): the task runs immediately on the calling thread (the ablation baseline).
"""

from __future__ import annotations

import concurrent.futures as cf
from collections.abc import Callable, Sequence
from typing import Any

import torch

__all__ = ["Lanes", "LaneHandle", "LANES"]

LANES = ("to_home", "compute", "from_home")


class LaneHandle:
    """The result of a lane task and how to wait for it.

    Attributes:
        lane: the lane's name.
        future: CPU/inline: a ``concurrent.futures.Future`` holding the task's return value.
        event: CUDA: recorded on the lane's stream after the task's kernels (recorded by the lane, waited on by
            later tasks, forward pre-hooks and ``synchronize()``).
    """

    __slots__ = ("lane", "future", "event", "value")

    def __init__(self, lane: str) -> None:
        self.lane = lane
        self.future: cf.Future | None = None
        self.event: Any = None
        self.value: Any = None

    def result(self) -> Any:
        """Block the calling thread until the task is done (host side) and return its value; re-raise its error."""
        if self.future is not None:
            return self.future.result()
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

    def wait_on_current_stream(self) -> None:
        """Make the caller wait: CUDA: the current stream waits on the event (host returns); else host wait."""
        if self.event is not None:
            torch.cuda.current_stream().wait_event(self.event)
        else:
            self.result()


class Lanes:
    """Owns the runtime's side streams (CUDA) or worker threads (CPU).

    Args:
        device: where the Muon params live.
        side_streams: False runs every task inline on the calling thread.
    """

    def __init__(self, device: torch.device, *, side_streams: bool = True) -> None:
        self.device = device
        self.cuda = device.type == "cuda" and side_streams
        self.inline = not side_streams
        self._executors: dict[str, cf.ThreadPoolExecutor] = {}
        self._streams: dict[str, Any] = {}
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

    def submit(self, lane: str, fn: Callable[[], Any], deps: Sequence[LaneHandle] = ()) -> LaneHandle:
        """Run ``fn()`` on ``lane`` after ``deps``; return its handle.

        CPU: ``fn`` runs on the lane's thread under ``torch.no_grad()`` (grad mode is thread-local) after every
        dependency's future has resolved (a failed dependency fails this task with the same error).
        CUDA: ``fn`` runs now on the calling thread inside the lane's stream, which first waits on the
        dependencies' events and on the current stream (the producer of the inputs); ``fn`` and its return
        value are kept by the caller (``WaveState``) until its event completes.
        """
        h = LaneHandle(lane)
        def run() -> Any:
            for d in deps:
                d.result()
            with torch.no_grad():
                return fn()

        if self.cuda:
            stream = self._streams[lane]
            stream.wait_stream(torch.cuda.current_stream())
            for d in deps:
                if d.event is not None:
                    stream.wait_event(d.event)
            with torch.cuda.stream(stream):
                with torch.no_grad():
                    out = fn()
                h.event = torch.cuda.Event()
                h.event.record(stream)
            h.value = out
            # The tensors the task touched are kept alive by the caller (the wave pipeline's WaveState) until
            # this event has completed: the caching allocator must not hand their memory to another stream early.
            return h
        if self.inline:
            f: cf.Future = cf.Future()
            try:
                f.set_result(run())
            except BaseException as e:  # noqa: BLE001 - surfaced at the next wait, like a lane error
                f.set_exception(e)
            h.future = f
            return h
        h.future = self._executors[lane].submit(run)
        return h

    def current_stream_event(self) -> Any:
        """CUDA: an event recorded now on the current stream (the step barrier hands it to FSDP2's
        ``set_post_optim_event``: recorded by ``step()`` after the current stream's waits on the applies, waited on
        by FSDP2's all-gather streams at the next forward)."""
        event = torch.cuda.Event()
        event.record()
        return event

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker threads after the queued tasks finish (``wait``: block until they have)."""
        for ex in self._executors.values():
            ex.shutdown(wait=wait)
        self._executors.clear()
