"""What a speculative wave read, recorded when it launches and as it reads, and compared by ``step()``'s commit.

[Note: a wave's reads] A wave launched during backward computes its NS input from inputs the user may still change
before ``step()``, and torch.optim's contract says ``step()`` uses the gradients, state and hyper-parameters current
at that call. So a wave records what identifies the value of each input it reads, before it reads it, and the
commit (:meth:`Reads.unchanged`, the only check there is) re-runs the wave when any of them differs now. What is
recorded, and why it suffices:

* **the hyper-parameters the NS input and NS depend on** (:class:`Hyper`: ``momentum``, ``nesterov``,
  ``ns_coefficients``, ``ns_steps``, ``eps``), as values: a sequence is copied into tuples, so a list mutated in
  place is a change too. ``lr``, ``weight_decay`` and ``adjust_lr_fn`` enter only the apply, which the commit
  queues with the values of that ``step()`` call.
* **the state mapping** (the ``opt.state`` object), **each param's state entry** (the ``state[p]`` dict) and **its
  momentum buffer** (the tensor object, or none yet), by identity: rebinding ``opt.state``, ``clear()``, a new entry
  or a replaced buffer all change an identity.
* **each gradient** (the tensor object) and **the version counters** of every tensor read (gradients, momentum
  buffers, and their local shards: [Note: DTensor foreach versions] in ``version_fix.py``). An in-place op moves a
  tensor's counter *after* it has written (autograd's ``ADInplaceOrView`` kernels bump after the op), so an edit
  that overlaps the read, on any thread, leaves a counter that differs from the one recorded before the read.
* **collectives still writing a gradient**: an asynchronous c10d collective (``dist.all_reduce(g, async_op=True)``
  from the user's own gradient hook) writes after its call returned, below autograd. The read first waits for
  every such collective on the gradient's storage (:func:`overlap_muon.version_fix.wait_in_flight`); one issued
  after the versions were recorded moved the counter at its call ([Note: in-place collectives]), so either the
  read saw its result or the commit re-runs the wave.

Everything is recorded at launch, on the launching thread: any change after it re-runs the wave, whenever the lane
gets to read. One exception: under ``async_step`` the previous step's apply may still be writing a momentum buffer
the wave will read (the pack waits for it); then the buffers' counters are recorded by the pack, after that write
and just before it reads, and the commit waits for that wave's pack first (a host wait on CPU; on CUDA the pack's
host part ran at launch).

What no record can see: writes that move no version counter (``Tensor.data`` edits, which have a counter of their
own by design; memory shared through ``numpy()``, DLPack or ``set_``; a collective reached from C++, through
``torch.ops.c10d``, or a ``torch.distributed`` function imported by name before the optimizer was built). Those are
documented as unsupported (docs/usage.md, "Gradient clipping and in-place gradient edits").
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .domain import MuonParam, local_tensor
from .version_fix import wait_in_flight

__all__ = ["Hyper", "Reads", "versions"]


def _frozen(x: Any) -> Any:
    """``x`` with every list or tuple in it copied into tuples (a value, not a reference to a mutable list)."""
    return tuple(_frozen(v) for v in x) if isinstance(x, (list, tuple)) else x


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters a wave's NS input and NS depend on, as values; a wave launched with other values is
    stale at commit. ``lr`` and ``weight_decay`` are not here: they enter only the apply, read at ``step()``."""

    momentum: float
    nesterov: bool
    ns_coefficients: Any
    ns_steps: int
    eps: float

    @staticmethod
    def of(group: dict[str, Any]) -> "Hyper":
        return Hyper(group["momentum"], group["nesterov"], _frozen(group["ns_coefficients"]), group["ns_steps"],
                     group["eps"])


def versions(t: Tensor) -> tuple[int, int]:
    """Version counters of a tensor and of its local shard: an in-place op on a DTensor bumps the wrapper's only
    (the local op runs below autograd's version tracking), one on the local shard bumps the shard's."""
    return t._version, local_tensor(t)._version


class Reads:
    """Everything one wave's NS input was computed from ([Note: a wave's reads]): identities recorded at launch,
    on the launching thread, and version counters recorded by the pack just before it reads.

    Args:
        hyper: the hyper-parameters the wave was launched with.
        state: the optimizer's state mapping at launch.
        mps: the wave's params with a gradient, in wave order.
        grads: their gradients as ``param.grad`` holds them (DTensor or shard).
    """

    __slots__ = ("hyper", "state", "grads", "entries", "bufs", "buf_versions")

    def __init__(self, hyper: Hyper, state: Any, mps: Sequence[MuonParam], grads: Sequence[Tensor]) -> None:
        self.hyper, self.state = hyper, state
        self.grads = [(g, versions(g)) for g in grads]
        self.entries = [state.get(m.param) for m in mps]
        self.bufs = [e.get("momentum_buffer") if e else None for e in self.entries]
        self.buf_versions: list[tuple[int, int] | None] | None = None if mps else []

    def record_buffers(self) -> None:
        """Record the momentum buffers' counters now (at launch: nothing of the optimizer writes them before the
        pack reads them, so the commit need not wait for the pack)."""
        self.buf_versions = [versions(b) if b is not None else None for b in self.bufs]

    def read(self, state: Any, mps: Sequence[MuonParam]) -> tuple[list[Tensor], list[Tensor]]:
        """Record the momentum buffers' counters, wait for collectives still writing the gradients, then read: the
        local gradient shards and committed momentum shards of ``mps`` (zeros before a param's first step, made
        without inserting a key: the state is the user's until ``step()``).

        Returns:
            ``(grads, bufs)``: local shards, in ``mps`` order.
        """
        entries = [state.get(m.param) for m in mps]
        bufs = [e.get("momentum_buffer") if e else None for e in entries]
        if self.buf_versions is None:
            self.buf_versions = [versions(b) if b is not None else None for b in bufs]
        grads = [g for g, _ in self.grads]
        wait_in_flight(grads)
        local = [m.local(g) for m, g in zip(mps, grads)]
        out = [m.local(b) if b is not None else torch.zeros_like(g, memory_format=torch.preserve_format)
               for m, b, g in zip(mps, bufs, local)]
        return local, out

    def unchanged(self, state: Any, hyper: Hyper, mps: Sequence[MuonParam]) -> bool:
        """Would the wave read the same values now? ``mps``: the wave's params with a gradient now (the caller
        has checked that they are the ones it launched with). Host-side only."""
        if self.buf_versions is None or hyper != self.hyper or state is not self.state:
            return False  # (a pack that failed recorded nothing)
        for m, (g, v) in zip(mps, self.grads):
            if m.param.grad is not g or versions(g) != v:
                return False
        for m, entry, buf, v in zip(mps, self.entries, self.bufs, self.buf_versions):
            now = state.get(m.param)
            cur = now.get("momentum_buffer") if now else None
            if now is not entry or cur is not buf or (buf is not None and versions(buf) != v):
                return False
        return True
