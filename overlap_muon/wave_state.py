"""One launched wave's state: the hyper-parameters it used, the tensors it holds, its lane handles.

[Note: release on time] in ``pipeline.py`` says who releases what, and when.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from .exchanges import Leg
from .lanes import LaneHandle
from .reads import Hyper, Reads
from .scheduler.waves import Wave

__all__ = ["WaveState", "EarlyRelease", "LateRelease", "wait_handle"]


@dataclass(eq=False)
class WaveState:
    """Everything one launched wave holds, and the lane handles that say when it may be released.

    Tensor fields are written by the task named beside them and set to ``None`` when released ([Note: release
    on time]). Shapes: "shard" is this rank's block of a param (its local tensor), "(P, Q)" a full matrix.
    """

    wave: Wave
    items: list[int]
    """Param indices of the wave that have a gradient on this rank, in wave order."""
    hyper: Hyper
    grads: list[Tensor] | None
    """The gradients read, as ``param.grad`` holds them (DTensor or shard; set by ``launch``; read again by the
    apply, which recomputes the new momentum in place; released after it)."""
    reads: Reads | None = None
    """What the pack read, recorded as it read it; ``commit`` compares it ([Note: a wave's reads] in ``reads.py``)."""
    bufs: list[Tensor] | None = None
    """The committed momentum buffer of each item (``state[p]["momentum_buffer"]``), taken by ``commit`` on the
    calling thread: the apply writes these, whatever the user does with the state mapping meanwhile."""
    packed: list[Tensor | None] | None = None
    """Shards, bf16: the NS inputs (``pack``; released after ``from_home``)."""
    legs: list[Leg] | None = None
    """One per exchange the wave uses (``overlap_muon.exchanges``): the exchanged params, then the replicated ones;
    each holds its matrices, results and route (``pack``; released after ``from_home``)."""
    updates: list[Tensor] | None = None
    """Shards, bf16: this rank's block of each NS result (``from_home``; released after the apply)."""
    empty: bool = False
    """No rank of the domain has a gradient for this wave (``to_home``): nothing to apply."""
    # Handles. On CUDA each carries an event recorded by its lane after its kernels. Who waits on it:
    # h_check -- the pack (the presence check, when the wave runs one); h_pack -- the gather (h_to), and
    # async_step's step(), which returns once every gradient has been read;
    # h_to -- the compute lane (h_ns's dependency); h_ns -- the from_home lane; h_from -- the apply task;
    # h_apply -- forward pre-hooks (current stream, FSDP2's all-gather streams), synchronize(), reap().
    h_check: LaneHandle | None = None
    h_pack: LaneHandle | None = None
    h_to: LaneHandle | None = None
    h_ns: LaneHandle | None = None
    h_from: LaneHandle | None = None
    h_apply: LaneHandle | None = None
    committed: bool = False
    momentum: Any = None
    """How the wave commits its momentum (``muon_math.CommitAtApply`` / ``KeepForApply`` / ``CommitAtPack``, chosen
    at launch; the one that keeps the new momentum holds it until the apply)."""

    def handles(self) -> list[LaneHandle]:
        return [h for h in (self.h_check, self.h_pack, self.h_to, self.h_ns, self.h_from, self.h_apply) if h is not None]

    def done(self) -> bool:
        """Every queued task has finished (CPU: host side; CUDA: its event has completed). Never blocks."""
        return all(h.done() for h in self.handles())

    def release(self) -> None:
        """Drop every tensor the wave holds."""
        self.grads = self.packed = self.legs = self.updates = self.momentum = self.reads = self.bufs = None


class EarlyRelease:
    """CPU (and inline lanes): each task drops what the next no longer needs ([Note: release on time])."""

    eager = True
    """A discarded wave whose tasks are done is released at once (CUDA: only after its last event)."""

    def after_ns(self, leg: Leg) -> None:
        leg.mats = None

    def after_scatter(self, st: WaveState) -> None:
        st.packed = st.legs = None

    def after_apply(self, st: WaveState) -> None:
        st.release()


class LateRelease(EarlyRelease):
    """CUDA: a tensor read on another stream than the one that allocated it lives until that stream is done with
    it (no ``record_stream``): the wave keeps everything until its apply event has completed (released by the
    pipeline's ``wait`` / ``reap`` then)."""

    eager = False

    def after_ns(self, leg: Leg) -> None:
        return None

    def after_scatter(self, st: WaveState) -> None:
        return None

    def after_apply(self, st: WaveState) -> None:
        return None


def wait_handle(h: LaneHandle | None, streams: Sequence[Any]) -> None:
    """Make the caller wait for ``h`` (CPU: the host; CUDA: the current stream and ``streams``); raise its task's
    error (a ``ValueError`` stays one: bad input found on a lane is raised on every rank)."""
    if h is None:
        return
    try:
        h.wait_on_current_stream()
        if h.event is not None:
            for s in streams:
                s.wait_event(h.event)
    except ValueError as e:  # bad input found on the lane (gradient presence): raised on every rank, stays a ValueError
        raise ValueError(f"OverlapMuon: {e}") from e
    except BaseException as e:
        raise RuntimeError(
            f"OverlapMuon: a {h.lane} lane task failed (see the chained exception for its traceback); "
            "the step's Muon update is incomplete"
        ) from e
