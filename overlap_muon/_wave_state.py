"""One launched wave's record: what it read (and so when it is stale), what it holds, its lane handles.

[Note: a wave's reads] A wave launched during backward computes its NS input from inputs the user may still change
before ``step()``, and torch.optim's contract says ``step()`` uses the gradients, state and hyper-parameters current
at that call. So a wave records what identifies the value of each input it reads, before it reads it, and the
commit (:meth:`Reads.change`, the only check there is) re-runs the wave when any of them differs now. What is
recorded, and why it suffices:

* **the hyper-parameters the NS input and NS depend on** (:class:`Hyper`: ``momentum``, ``nesterov``,
  ``ns_coefficients``, ``ns_steps``, ``eps``), as values: a sequence is copied into tuples, so a list mutated in
  place is a change too. ``lr``, ``weight_decay`` and ``adjust_lr_fn`` enter only the apply, which the commit
  queues with the values of that ``step()`` call.
* **the state mapping** (the ``opt.state`` object), **each param's state entry** (the ``state[p]`` dict) and **its
  momentum buffer** (the tensor object, or none yet), by identity: rebinding ``opt.state``, ``clear()``, a new entry
  or a replaced buffer all change an identity.
* **each gradient** (the tensor object) and **the version counters** of every tensor read (gradients, momentum
  buffers, and their local shards: [Note: DTensor foreach versions] in ``_version_fix.py``). An in-place op moves a
  tensor's counter *after* it has written (autograd's ``ADInplaceOrView`` kernels bump after the op), so an edit
  that overlaps the read, on any thread, leaves a counter that differs from the one recorded before the read.
* **collectives still writing a gradient**: an asynchronous c10d collective (``dist.all_reduce(g, async_op=True)``
  from the user's own gradient hook) writes after its call returned, below autograd. The read first waits for
  every such collective on the gradient's storage (:func:`overlap_muon._version_fix.wait_in_flight`); one issued
  after the versions were recorded moved the counter at its call ([Note: in-place collectives]), so either the
  read saw its result or the commit re-runs the wave.

Everything is recorded at launch, on the launching thread: any change after it re-runs the wave, whenever the lane
gets to read. One exception: under ``async_step`` the previous step's apply may still be writing a momentum buffer
the wave will read (the pack waits for it); then the buffers' counters are recorded by the pack, after that write
and just before it reads, and the commit waits for that wave's pack first (a host wait on CPU; on CUDA the pack's
host part ran at launch).

What no record can see: writes that move no version counter (``Tensor.data`` edits, which have a counter of their
own by design; memory shared through ``numpy()``, DLPack or ``set_``; a collective reached from C++, through
``torch.ops.c10d``, or a ``torch.distributed`` function imported by name before the optimizer was built). So the
records do not decide alone: the pack takes a fingerprint of the bytes it reads, and the commit compares it where
the records saw nothing ([Note: content fingerprints]; ``content_check``).

[Note: release on time] in ``_pipeline.py`` says who releases what, and when.

[Note: content fingerprints] The records of a wave's reads (identities, version counters, wrapped collectives:
[Note: a wave's reads] above) cannot see every writer: ``Tensor.data`` edits, memory shared through
``numpy()`` or DLPack, ``set_``, collectives reached from C++ (DDP's reducer, ``torch.ops.c10d``, a
``ProcessGroup`` method). So the pack also takes a fingerprint of the bytes it is about to read, and the commit
takes it again and re-runs the wave when the two differ.

On CPU the fingerprint of a tensor is the 64-bit XXH3 hash of its bytes (the ``xxhash`` package: one pass at memory
speed, the GIL released, so a pack on a lane thread does not hold back backward's Python); a write that changes the
bytes goes unseen with odds about ``2**-64`` per tensor, whatever its pattern. On CUDA (no host copy, no sync at the
pack) the device computes it: one ``int64`` per tensor, whose bytes are read as 64-bit words ``x_i`` (a tensor whose
bytes do not start on an 8-byte boundary is copied first; a tail shorter than a word counts as single bytes with the
block weights ``v``), in blocks of ``BLOCK`` words; each block's sum ``s_b = sum_i w_i x_i`` and then ``sum_b v_b
s_b`` are taken modulo ``2**64`` (two's-complement wrap-around), with fixed pseudo-random *odd* weights ``w`` and
``v`` (a tensor of at most ``BLOCK`` whole words: its one block's sum). One pass over the data (a copy first only
where it does not start aligned), on its device. Waves launched in a synchronous ``step()`` (nothing can change what
they read before their commit) take none.

Collision odds of the device's sum: a write changes the words by ``d_i = x'_i - x_i``. A write that changes a single
word is always caught (``w_i`` odd, so ``w_i d_i != 0 mod 2**64``, and the same for the block sum times ``v_b``).
Otherwise it goes unseen only when ``sum_i w_i d_i = 0 mod 2**64`` in every block it touched; for weights drawn at
random this happens with probability about ``2**-(63 - k)``, ``2**k`` being the largest power of two dividing every
``d_i`` of the block: about ``2**-63`` for a write that changes values (averaging, scaling, clipping, masking),
``2**-41`` for a float32 halving (only exponents change, ``k = 23``). One pattern is never seen: changes confined to
the top bit of an even number of words of a block (``w_i * 2**63 = 2**63`` for every odd ``w_i``), i.e. sign flips
of exactly an even number of float32 values at odd positions (bf16 at positions 3 mod 4) of a 32 KiB block and
nothing else; no write of a training loop we know makes it (a negation flips the other signs too). The comparison
runs only where the records saw nothing; at one such write per wave and step, a million steps of a thousand waves
meet a collision with odds below ``10**9 * 2**-41 < 5e-4`` in the halving case and ``1e-10`` for ordinary writes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch import Tensor

from ._exchanges import Leg
from ._lanes import LaneHandle
from ._placement import MuonParam
from ._scheduler.waves import Wave
from ._version_fix import clipped_only, versions, wait_in_flight, writer_of

__all__ = ["Hyper", "Reads", "versions", "WaveState", "EarlyRelease", "LateRelease", "fingerprint"]


BLOCK = 4096
"""Words (8 bytes) per block: the weight vector ``w`` is this long (32 KiB per device)."""

_WEIGHTS: dict[tuple[str, int | None], tuple[Tensor, Tensor]] = {}


def _odd(n: int, seed: int, device: torch.device) -> Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randint(-(2**62), 2**62, (n,), dtype=torch.int64, generator=gen) * 2 + 1
    return w.to(device)


def _weights(device: torch.device, blocks: int) -> tuple[Tensor, Tensor]:
    """``(w, v)`` on ``device``: ``BLOCK`` word weights and at least ``blocks`` block weights (grown by doubling)."""
    key = (device.type, device.index)
    have = _WEIGHTS.get(key)
    if have is None or have[1].numel() < blocks:
        n = max(blocks, 2 * have[1].numel() if have is not None else 64)
        have = _WEIGHTS[key] = (have[0] if have is not None else _odd(BLOCK, 20261204, device),
                                _odd(n, 20261205, device))
    return have


def _one(t: Tensor) -> Tensor:
    """The fingerprint of one tensor's bytes (a 0-d ``int64`` on its device). Few ops where the bytes are whole
    8-byte-aligned words (the common case: the host cost counts on many small matrices); otherwise on a copy, whose
    bytes start aligned, with a tail of single bytes. Never raises on a valid tensor: a pack that failed on one rank
    only would leave the ranks' collectives out of step."""
    flat = t.detach().reshape(-1)
    size = flat.element_size()
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=t.device)
    if (flat.numel() * size) % 8 or (flat.storage_offset() * size) % 8:
        flat = flat.clone()  # storage offset 0: aligned
        b = flat.view(torch.uint8)
        n = b.numel() // 8
        tail = (b[n * 8:].to(torch.int64) * _weights(t.device, 1)[1][: b.numel() - n * 8]).sum()
        return tail + (_words(b[: n * 8].view(torch.int64), t.device) if n else 0)
    return _words(flat.view(torch.int64), t.device)


def _words(words: Tensor, device: torch.device) -> Tensor:
    n = words.numel()
    if n <= BLOCK:
        return (words * _weights(device, 1)[0][:n]).sum()
    full = n // BLOCK
    w, v = _weights(device, full + 1)
    s = (words[: full * BLOCK].view(full, BLOCK) * w).sum(1)
    if n > full * BLOCK:
        s = torch.cat([s, (words[full * BLOCK:] * w[: n - full * BLOCK]).sum().reshape(1)])
    return (s * v[: s.numel()]).sum()


def _xxh3(t: Tensor) -> int:
    """XXH3-64 of a CPU tensor's bytes (row-major; a strided tensor is copied first), as a signed ``int64``."""
    b = t.detach()
    if not b.is_contiguous():
        b = b.contiguous()
    h = xxhash.xxh3_64_intdigest(b.reshape(-1).view(torch.uint8).numpy()) if b.numel() else 0
    return h - (1 << 64) if h >= (1 << 63) else h


def fingerprint(tensors: Sequence[Tensor | None]) -> Tensor:
    """One ``int64`` per tensor of ``tensors`` (``None``: 0), stacked: shape ``(len(tensors),)``, on the device of
    the first tensor (CPU when there is none). Every tensor must be on that device ([Note: content fingerprints])."""
    present = [t for t in tensors if t is not None]
    device = present[0].device if present else torch.device("cpu")
    if device.type == "cpu":
        return torch.tensor([0 if t is None else _xxh3(t) for t in tensors], dtype=torch.int64)
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return torch.stack([zero if t is None else _one(t) for t in tensors]) if tensors else zero.reshape(0)


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


class Reads:
    """Everything one wave's NS input was computed from ([Note: a wave's reads]): identities recorded at launch,
    on the launching thread, and version counters recorded by the pack just before it reads.

    Args:
        hyper: the hyper-parameters the wave was launched with.
        state: the optimizer's state mapping at launch.
        mps: the wave's params with a gradient, in wave order.
        grads: their gradients as ``param.grad`` holds them (DTensor or shard).
    """

    __slots__ = ("hyper", "state", "grads", "entries", "bufs", "buf_versions", "content", "fp", "read_tensors",
                 "clipped")

    def __init__(self, hyper: Hyper, state: Any, mps: Sequence[MuonParam], grads: Sequence[Tensor],
                 content: bool = True) -> None:
        self.hyper, self.state, self.content = hyper, state, content
        self.fp: Tensor | None = None
        self.read_tensors: list[Tensor | None] = []
        self.clipped = False  # a device clip moved the gradients since: the content check decides
        self.grads = [(g, versions(g)) for g in grads]
        self.entries = [state.get(m.param) for m in mps]
        self.bufs = [e.get("momentum_buffer") if e else None for e in self.entries]
        self.buf_versions: list[tuple[int, int] | None] | None = None if mps else []

    def rebase_grads(self) -> None:
        """Record the gradients' counters again: a writer known to rewrite the bytes they hold moved them."""
        self.grads = [(g, versions(g)) for g, _ in self.grads]

    def record_buffers(self) -> None:
        """Record the momentum buffers' counters now (at launch: nothing of the optimizer writes them before the
        pack reads them, so the commit need not wait for the pack)."""
        self.buf_versions = [versions(b) if b is not None else None for b in self.bufs]

    def read(self, state: Any, mps: Sequence[MuonParam]) -> tuple[list[Tensor], list[Tensor]]:
        """Record the momentum buffers' counters, wait for collectives still writing the gradients, take the
        fingerprint of their bytes (``content``), then read: the local gradient shards and committed momentum
        shards of ``mps`` (zeros before a param's first step, made without inserting a key: the state is the
        user's until ``step()``).

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
        local_bufs = [m.local(b) if b is not None else None for m, b in zip(mps, bufs)]
        if self.content:  # before the pack reads them: a write during the read then differs at commit
            self.read_tensors = local + local_bufs
            self.fp = fingerprint(self.read_tensors)
        out = [b if b is not None else torch.zeros_like(g, memory_format=torch.preserve_format)
               for b, g in zip(local_bufs, local)]
        return local, out

    def content_changed(self) -> Tensor | None:
        """A 0-d bool tensor on the tensors' device: the bytes the pack read differ now ([Note: content
        fingerprints]); ``None`` when not checked (no fingerprint taken). The caller has
        checked the identities (:meth:`change`) and made the current stream wait for the pack."""
        if self.fp is None:
            return None
        return (fingerprint(self.read_tensors) != self.fp).any()

    def change(self, state: Any, hyper: Hyper, mps: Sequence[MuonParam]) -> str | None:
        """What the wave would read differently now (``None``: nothing): a key of ``_messages.RERUN_CAUSES``, or
        ``grad_edited:<op>`` naming the op that last wrote a gradient in place where it is known
        (``_version_fix.writer_of``). Gradients that only a device clip moved leave the verdict to the content check
        (:attr:`clipped`). ``mps``: the wave's params with a gradient now (the caller has checked that
        they are the ones it launched with). Host-side only."""
        if self.buf_versions is None:
            return "failed"  # a pack that failed recorded nothing
        if hyper != self.hyper:
            return "hyper"
        if state is not self.state:
            return "state"
        self.clipped = False
        for m, (g, v) in zip(mps, self.grads):
            if m.param.grad is not g:
                return "grad_replaced"
            if versions(g) != v and self.content and clipped_only(g, v):
                self.clipped = True  # [Note: a clip that does not bite] in _version_fix.py: its bytes decide
            elif versions(g) != v:
                op = writer_of(g)
                return f"grad_edited:{op}" if op else "grad_edited"
        for m, entry, buf, v in zip(mps, self.entries, self.bufs, self.buf_versions):
            now = state.get(m.param)
            cur = now.get("momentum_buffer") if now else None
            if now is not entry or cur is not buf or (buf is not None and versions(buf) != v):
                return "state"
        return None


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
    """What the pack read, recorded as it read it; ``commit`` compares it ([Note: a wave's reads])."""
    bufs: list[Tensor] | None = None
    """The committed momentum buffer of each item (``state[p]["momentum_buffer"]``), taken by ``commit`` on the
    calling thread: the apply writes these, whatever the user does with the state mapping meanwhile."""
    packed: list[Tensor | None] | None = None
    """Shards, bf16: the NS inputs (``pack``; released after ``from_home``)."""
    legs: list[Leg] | None = None
    """One per exchange the wave uses (``overlap_muon._exchanges``): the exchanged params, then the replicated ones;
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
    """How the wave commits its momentum (``_muon_math.CommitAtApply`` / ``KeepForApply`` / ``CommitAtPack``, chosen
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

    def at_wait(self, st: WaveState) -> bool:
        """The caller's stream now waits on ``st``'s apply: whether ``st`` may be released now though its tasks
        are not all done (CPU: the host waited, so they are; nothing to decide)."""
        return False

    def synchronize(self) -> None:
        """Block the host until every apply released by :meth:`at_wait` has completed."""

    def prune(self) -> None:
        """Forget the applies released by :meth:`at_wait` that have completed. Never blocks."""


class LateRelease(EarlyRelease):
    """CUDA: a tensor read on another stream than the one that allocated it lives until that stream is done with
    it (no ``record_stream``): the wave keeps everything until the current stream has waited on its apply event
    (:meth:`at_wait`), or, for a wave nothing waited on (discarded, retired), until its events have completed
    (the pipeline's ``reap``).

    Why the wait is enough: the caching allocator hands a freed block only to a later allocation on the stream it
    was allocated on. The wave's blocks come from the current stream (its gradients) and from the lanes' streams
    (packs, gathered matrices, NS results, update blocks). After ``current.wait_event(apply)``, every later kernel
    on the current stream follows the apply, which followed every use of the wave's tensors; and every later
    allocation on a lane's stream is made by a lane task, which first makes that stream wait on the current one
    (``Lanes.submit``). So whatever reuses a block runs after the wave is done with it, with no host sync."""

    eager = False

    def __init__(self) -> None:
        self._landing: list[LaneHandle] = []  # applies released at a wait, maybe still running on the device

    def after_ns(self, leg: Leg) -> None:
        return None

    def after_scatter(self, st: WaveState) -> None:
        return None

    def after_apply(self, st: WaveState) -> None:
        return None

    def at_wait(self, st: WaveState) -> bool:
        if st.h_apply is not None:
            self._landing.append(st.h_apply)
        return True

    def synchronize(self) -> None:
        landing, self._landing = self._landing, []
        for h in landing:
            if h.event is not None:
                h.event.synchronize()

    def prune(self) -> None:
        self._landing = [h for h in self._landing if not h.done()]
