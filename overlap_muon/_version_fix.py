"""Gradient edits that torch makes without moving a version counter, made visible to overlap mode.

[Note: DTensor foreach versions] Overlap mode computes a wave from the gradients as backward leaves them and, at
``step()``, re-runs every wave whose gradients changed since: it compares each gradient's ``_version`` (and its
local tensor's) with the values it saw at launch (``_agreement.Agreement.stale``). torch 2.13 edits gradients
in place without moving any version counter in two places that sit exactly between ``backward()`` and ``step()``:

* in-place *foreach* ops on DTensors: ``torch._foreach_mul_([dt], c)`` changes the local tensor and leaves both
  counters alone (upstream: pytorch/pytorch#197502, open when this was written). ``clip_grad_norm_`` (default
  ``foreach``) and ``clip_grad_value_`` edit gradients that way;
* ``torch._amp_foreach_non_finite_check_and_unscale_`` (``torch.amp.GradScaler.unscale_``) on any tensor, plain
  ones included: the op has no version-counting kernel.

Unseen, either would commit updates computed from the unclipped or still-scaled gradients: a silent difference
from ``torch.optim.Muon``. :func:`install` wraps those functions of the ``torch`` namespace, which is where torch's
clipping, unscaling and optimizers look them up at call time, so that after the original op the mutated tensors (the
first argument's list: its DTensors for the foreach ops, every tensor for the unscale op) get their version counters
incremented (``torch.autograd.graph.increment_version``), as the non-foreach ``Tensor.mul_`` already does. The op,
its values and its arguments are unchanged; no communication, no host-device sync. Each wrapper is registered as the
same TorchScript builtin as the function it wraps (``torch.jit.script`` keeps compiling calls to it) and is found
under its own name (``pickle`` works). :func:`acquire` runs for each ``OverlapMuon(overlap=True)`` (logged on
rank 0 the first time it wraps anything) and :func:`release` when it closes: the last one puts the original
functions back. It wraps only what a probe finds broken (the DTensor part only with DTensor Muon params).

[Note: in-place collectives] The eager c10d collectives of ``torch.distributed`` write their output through the
C++ process group, below autograd: ``dist.all_reduce(p.grad)`` after backward (a data-parallel loop without DDP),
``dist.reduce_scatter_tensor(p.grad, ...)`` or ``dist.broadcast(p.grad, src)`` change the gradient and move no
version counter, on any backend. :func:`install` wraps the collectives of :data:`C10D_INPLACE` in the
``torch.distributed`` namespace the same way: after the call (or, with ``async_op=True``, at the call: the
counter only has to have moved by the next ``step()``, before which the caller waits on the work) the written
tensors' counters move. An asynchronous call also registers its work with the storages it writes, and
a wave waits for those before it reads a gradient (:func:`wait_in_flight`): gloo writes after the call has returned
(and after the bump), so without the wait a wave could read a half-reduced gradient whose counter it recorded after
the call. A more general mechanism was looked for and not found: the c10d ops are not
autograd-visible in-place ops (their dispatcher schemas run no ``ADInplaceOrView`` kernel), and a
``TorchDispatchMode`` would see every op of the job, not only these. Unlike the foreach fix this one has no probe:
a probe would be a collective, and no c10d op of torch 2.13 moves a counter. While Dynamo traces, the wrappers
call the collective alone (Dynamo rewrites it to a functional collective, which bumps by itself).

[Note: a clip that does not bite] ``clip_grad_norm_`` multiplies every gradient by ``min(1, max_norm / (norm +
1e-6))`` in place, also when that is exactly 1.0 (torch avoids the branch to avoid a host sync). The values do not
change, but the counters move, and the stale check would re-run every wave: Hugging Face's ``Trainer`` calls
``accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)`` each step, and with ``max_grad_norm=0`` still
``clip_grad_norm_(..., inf)`` to log the norm; torchtitan calls ``clip_grads_with_norm_`` every step. :func:`install`
wraps ``clip_grads_with_norm_`` (the public name and the module global that ``clip_grad_norm_`` calls):
- where the coefficient is on the CPU, it computes it as torch does and, when it is exactly 1.0, returns without
  multiplying: bit for bit what the multiplication would leave, and no counter moves. A coefficient below 1 (or NaN,
  from a non-finite norm) takes torch's own path;
- on a device (CUDA), reading it would be a host sync in every user clip, so torch multiplies as always and the
  wrapper notes the gradients' counters before and after (:func:`clipped_only`). A wave whose gradients only such a
  clip moved is not stale by its records: the commit compares its content fingerprint instead ([Note: content
  fingerprints] in ``_wave_state.py``, read with the other waves' flags, the step's one read), which is unchanged
  exactly when the clip changed no bit. A held step ([Note: learned clipping] in ``scheduler/dispatch.py``) asks
  :func:`clip_bit` whether the clip bit: a flag copied to the host behind an event, read once the event has
  completed (no sync; until then the last flag read stands). Without the content check
  (``content_check=False``) such a wave re-runs.
A DTensor coefficient is read through ``full_tensor()`` (no communication when it is replicated).

Not covered: the same ops reached from C++ or through ``torch.ops.aten`` / ``torch._C._VariableFunctions``, and
edits through ``Tensor.data`` (a separate version counter by design: ``p.grad.data.mul_(c)`` is invisible to autograd
and to overlap mode alike; edit ``p.grad`` itself).
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["FOREACH_INPLACE", "AMP_UNSCALE", "C10D_INPLACE", "foreach_bumps_dtensor_versions", "unscale_bumps_versions",
           "install", "acquire", "release", "uninstall", "wait_in_flight", "forget_completed", "writer_of",
           "end_step", "versions", "host_read_free", "note_device_clip", "clipped_only", "clip_bit", "snapshot",
           "edited_since", "FlagQueue"]

logger = logging.getLogger("overlap_muon")

#: The in-place foreach functions of the ``torch`` namespace (those present in this torch).
FOREACH_INPLACE: tuple[str, ...] = tuple(n for n in dir(torch) if n.startswith("_foreach_") and n.endswith("_"))
#: GradScaler's unscale op.
AMP_UNSCALE = "_amp_foreach_non_finite_check_and_unscale_"
#: The ``torch.distributed`` collectives that write a tensor argument in place: name -> (position, keyword) of
#: that argument (a tensor, or a list of tensors for ``all_reduce_coalesced``).
C10D_INPLACE: dict[str, tuple[int, str]] = {
    "all_reduce": (0, "tensor"), "all_reduce_coalesced": (0, "tensors"), "reduce": (0, "tensor"),
    "broadcast": (0, "tensor"), "scatter": (0, "tensor"), "reduce_scatter": (0, "output"),
    "reduce_scatter_tensor": (0, "output"), "reduce_scatter_single": (0, "output"),
}

_lock = threading.RLock()
_in_flight: list[tuple[frozenset[int], Any]] = []  # (storages written, work) of asynchronous collectives
_writers: dict[int, tuple[str, Any]] = {}  # storage -> (the wrapped op that last wrote it this step, its tensor weakly)
_users = 0  # live OverlapMuon(overlap=True) instances that acquired the fixes
_originals: list[tuple[Any, str, Callable[..., Any]]] = []  # (module, name, original) of every wrapped function
_done: set[str] = set()  # "dtensor_foreach", "amp_unscale", "c10d", "unit_clip": the fixes in place in this process
_device_clips: dict[int, tuple[Any, tuple[int, int], tuple[int, int]]] = {}  # storage -> (the gradient weakly,
# its versions before the step's first device clip, after its last) ([Note: a clip that does not bite])
_clip_bits: "FlagQueue"  # the device clips' flags (set below, after the class)
_last_bit = [True]  # the last clip_bit read; True before any: a held step stays held
_flag_mover: list[Callable[[torch.Tensor], tuple[Any, torch.Tensor]] | None] = [None]  # lanes.flag_to_host, given
# by acquire(): this module is a leaf of the wave's trip and imports none of its files


def foreach_bumps_dtensor_versions(mesh: Any) -> bool:
    """Whether ``torch._foreach_mul_`` moves a DTensor's version counter (a probe on a 1-element replicated
    DTensor of ``mesh``'s device type; no collective). False on torch 2.13 (without :func:`install`)."""
    from torch.distributed.tensor import DTensor, Replicate

    probe = DTensor.from_local(torch.zeros(1, device=mesh.device_type), mesh, [Replicate()] * mesh.ndim,
                               run_check=False)
    before = probe._version
    with torch.no_grad():
        torch._foreach_mul_([probe], 1.0)
    return probe._version != before


def unscale_bumps_versions() -> bool:
    """Whether GradScaler's unscale op moves a (CPU) tensor's version counter. False on torch 2.13."""
    t, found, inv = torch.zeros(1), torch.zeros(1), torch.ones(1)
    before = t._version
    getattr(torch, AMP_UNSCALE)([t], found, inv)
    return t._version != before


def _bumping(name: str, fn: Callable[..., Any], which: Callable[[Any], bool]) -> Callable[..., Any]:
    """``fn`` followed by a version bump of the tensors ``t`` of its first argument with ``which(t)``."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = fn(self, *args, **kwargs)
        mutated = [t for t in self if which(t)] if isinstance(self, (list, tuple)) else []
        if mutated:
            torch.autograd.graph.increment_version(mutated)
            _note_writer(name, mutated)
        return out

    wrapper.__module__, wrapper.__qualname__, wrapper.__name__ = "torch", name, name  # pickled as torch.<name>
    wrapper.__overlap_muon_version_fix__ = fn  # type: ignore[attr-defined]
    try:
        from torch.jit._builtins import _find_builtin, _register_builtin

        op = _find_builtin(fn)
        if op is not None:
            _register_builtin(wrapper, op)  # TorchScript compiles a call to the wrapper as the op itself
    except Exception:  # pragma: no cover - TorchScript internals differ: scripting these calls is then unsupported
        pass
    return wrapper


def _bumping_collective(name: str, fn: Callable[..., Any], pos: int, key: str) -> Callable[..., Any]:
    """``fn`` (a c10d collective) followed by a version bump of the tensor(s) it writes ([Note: in-place
    collectives])."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = fn(*args, **kwargs)
        if not torch.compiler.is_compiling():
            target = args[pos] if len(args) > pos else kwargs.get(key)
            written = list(target) if isinstance(target, (list, tuple)) else [target]
            written = [t for t in written if isinstance(t, torch.Tensor)]
            if written and out is not None:  # async_op=True: still writing (registered before the bump)
                _register_in_flight(out, written)
            if written:
                torch.autograd.graph.increment_version(written)
                _note_writer(f"collective:{name}", written)
        return out

    wrapper.__module__, wrapper.__qualname__, wrapper.__name__ = "torch.distributed", name, name
    wrapper.__overlap_muon_version_fix__ = fn  # type: ignore[attr-defined]
    return wrapper


def _storage(t: torch.Tensor) -> int:
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return local.untyped_storage().data_ptr()


def _register_in_flight(work: Any, written: list[torch.Tensor]) -> None:
    if not hasattr(work, "wait"):
        return
    with _lock:
        forget_completed()
        _in_flight.append((frozenset(_storage(t) for t in written), work))


def _note_writer(name: str, written: list[torch.Tensor]) -> None:
    for t in written:
        _writers[_storage(t)] = (name, weakref.ref(t))


def writer_of(t: torch.Tensor) -> str | None:
    """The wrapped op (a c10d collective, ``clip_grad_norm_``, a foreach op or GradScaler's unscale on a DTensor)
    that last wrote ``t``'s storage in place since the last :func:`end_step`, if any: the re-run warning names it.
    (Only while the tensor it wrote lives: a freed tensor's address may come back as another one's.)"""
    entry = _writers.get(_storage(t)) if _writers else None
    return entry[0] if entry is not None and entry[1]() is not None else None


def end_step() -> None:
    """A step ended: forget the completed collectives and who wrote what (``writer_of``)."""
    forget_completed()
    _writers.clear()


def forget_completed() -> None:
    """Drop the registered collectives that have completed (a work keeps the tensors it wrote alive)."""
    with _lock:
        _in_flight[:] = [(s, w) for s, w in _in_flight if not w.is_completed()]


def wait_in_flight(tensors: Any) -> None:
    """Wait for every asynchronous collective issued through the wrapped ``torch.distributed`` functions that still
    writes the storage of one of ``tensors`` ([Note: in-place collectives]; [Note: a wave's reads] in
    ``_wave_state.py``): CPU, the calling thread blocks until it has written; CUDA (NCCL), the current stream waits on
    it. Free when none is in flight."""
    if not _in_flight:
        return
    mine = {_storage(t) for t in tensors}
    with _lock:
        forget_completed()
        works = [w for s, w in _in_flight if s & mine]
    for w in works:
        w.wait()


def versions(t: torch.Tensor) -> tuple[int, int]:
    """Version counters of a tensor and of its local shard: an in-place op on a DTensor bumps the wrapper's only
    (the local op runs below autograd's version tracking), one on the local shard bumps the shard's."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    return t._version, local._version


def host_read_free(device: torch.device) -> bool:
    """Whether the clip's coefficient can be read on the host without a sync ([Note: a clip that does not bite])."""
    return device.type == "cpu"


def _skipping_unit_clip(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``clip_grads_with_norm_`` that leaves no trace when its coefficient is exactly 1.0 ([Note: a clip that does
    not bite])."""

    @functools.wraps(fn)
    def wrapper(parameters: Any, max_norm: float, total_norm: torch.Tensor, foreach: bool | None = None) -> None:
        if torch.compiler.is_compiling():
            return fn(parameters, max_norm, total_norm, foreach)
        parameters = [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)
        grads = [p.grad for p in parameters if p.grad is not None]
        with torch.no_grad():
            coef = torch.clamp(float(max_norm) / (total_norm + 1e-6), max=1.0)
            coef = coef.full_tensor() if hasattr(coef, "full_tensor") else coef
            on_host = host_read_free(coef.device)
            if on_host and bool(coef == 1.0):
                return None
        before = [versions(g) for g in grads] if not on_host else []
        out = fn(parameters, max_norm, total_norm, foreach)
        if not on_host:
            note_device_clip(grads, before, coef)
        _note_writer("clip_grad_norm_", grads)
        return out

    wrapper.__overlap_muon_version_fix__ = fn  # type: ignore[attr-defined]
    return wrapper


def note_device_clip(grads: list[torch.Tensor], before: list[tuple[int, int]], coef: torch.Tensor) -> None:
    """Record a device clip: each gradient's versions around it (chained with an earlier clip of the step that
    left them as they were), and whether it bit, copied to the host behind an event. Records outlive the step (a
    later optimizer's commit reads them); a write since makes them no match, and the dead ones are dropped here."""
    for key in [k for k, (ref, _, _) in _device_clips.items() if ref() is None]:
        del _device_clips[key]
    for g, b in zip(grads, before):
        seen = _device_clips.get(_storage(g))
        if seen is not None and seen[0]() is g and seen[2] == b:
            b = seen[1]
        _device_clips[_storage(g)] = (weakref.ref(g), b, versions(g))
    with torch.no_grad():
        bit = (coef < 1.0) | (coef != coef)
    if bit.device.type == "cpu":
        _clip_bits.push((None, bit))
    elif _flag_mover[0] is not None:  # else no overlap optimizer reads it
        _clip_bits.push(_flag_mover[0](bit))


def clipped_only(t: torch.Tensor, before: tuple[int, int]) -> bool:
    """Whether device clips of this step are the only writes that moved ``t``'s versions since they were
    ``before`` ([Note: a clip that does not bite]): its bytes then differ exactly where a clip bit."""
    seen = _device_clips.get(_storage(t)) if _device_clips else None
    return seen is not None and seen[0]() is t and seen[1] == before and seen[2] == versions(t)


def snapshot(grads: list[torch.Tensor | None]) -> list[tuple[Any, tuple[int, int]]]:
    """The gradients and their versions now, for :func:`edited_since`."""
    return [(g, versions(g) if g is not None else (-1, -1)) for g in grads]


def edited_since(then: list[tuple[Any, tuple[int, int]]], grads: list[torch.Tensor | None]) -> bool:
    """Whether ``grads`` were replaced or written since :func:`snapshot` gave ``then``; gradients that only device
    clips moved count when the clip bit (:func:`clip_bit`: a flag read without a sync)."""
    clipped = False
    for g, (was, v) in zip(grads, then):
        if g is not was:
            return True
        if g is not None and versions(g) != v:
            if not clipped_only(g, v):
                return True
            clipped = True
    return clipped and clip_bit()


def clip_bit() -> bool:
    """Whether the latest device clip whose flag is readable without a sync bit (scaled some gradient, or its
    norm was not finite); the last flag read while none is readable (True before any)."""
    for bit in _clip_bits.drain():
        _last_bit[0] = bit
    return _last_bit[0]


class FlagQueue:
    """Flags on their way to the host, oldest first: ``(event, host)`` pairs (``_lanes.flag_to_host``; ``event``
    ``None`` for a flag already on the host). :meth:`drain` returns the ones readable without a sync."""

    def __init__(self, bound: int = 64) -> None:
        self._q: list[tuple[Any, torch.Tensor]] = []
        self._bound = bound

    def push(self, entry: tuple[Any, torch.Tensor]) -> None:
        """Queue one flag; past ``bound`` unread ones (nobody asks), the oldest are dropped."""
        self._q.append(entry)
        if len(self._q) > self._bound:
            self.drain()
            del self._q[:-self._bound]

    def drain(self) -> list[bool]:
        """The queued flags whose copies have completed (no sync), in order; they leave the queue."""
        out = []
        while self._q and (self._q[0][0] is None or self._q[0][0].query()):
            out.append(bool(self._q.pop(0)[1]))
        return out


_clip_bits = FlagQueue()


def _wrap(names: tuple[str, ...], which: Callable[[Any], bool]) -> None:
    for name in names:
        fn = getattr(torch, name, None)
        if fn is not None and not hasattr(fn, "__overlap_muon_version_fix__"):
            _originals.append((torch, name, fn))
            setattr(torch, name, _bumping(name, fn, which))


def acquire(mesh: Any = None, flag_mover: Callable[[torch.Tensor], tuple[Any, torch.Tensor]] | None = None
            ) -> set[str]:
    """:func:`install` for one more user (an ``OverlapMuon(overlap=True)``); :func:`release` undoes it once the
    last user is gone. Logs on rank 0 what it wrapped and why, the first time it wraps anything. ``flag_mover``:
    copies a device flag to the host behind an event (``_lanes.flag_to_host``; :func:`clip_bit` reads those)."""
    global _users
    with _lock:
        _users += 1
        if flag_mover is not None:
            _flag_mover[0] = flag_mover
        before = set(_done)
        done = install(mesh)
    new = done - before
    if new and (not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0):
        names = sorted({f"{m.__name__}.{n}" for m, n, _ in _originals})
        logger.info("OverlapMuon: wrapped %d torch functions (%s) so that in-place gradient edits move version "
                    "counters, which overlap mode's stale-wave check reads (%s: see overlap_muon/_version_fix.py); "
                    "same ops, same values; removed when the last overlap-mode OverlapMuon closes. Wrapped: %s",
                    len(names), ", ".join(sorted(new)), "torch 2.13 moves none for these", ", ".join(names[:12])
                    + (" ..." if len(names) > 12 else ""))
    return done


def release() -> None:
    """One user fewer; the last one restores every wrapped function (:func:`uninstall`)."""
    global _users
    with _lock:
        _users = max(0, _users - 1)
        if _users == 0:
            uninstall()


def uninstall() -> None:
    """Put every function :func:`install` wrapped back (the originals), as if it had never run."""
    with _lock:
        for module, name, fn in reversed(_originals):
            setattr(module, name, fn)
        _originals.clear()
        _done.clear()
        _in_flight.clear()
        _writers.clear()


def install(mesh: Any = None) -> set[str]:
    """Put in place the fixes of [Note: DTensor foreach versions] that this torch needs: the unscale op's always
    (probed on CPU), the DTensor foreach ops' when ``mesh`` (the DeviceMesh of DTensor Muon params) is given.
    Idempotent and thread safe.

    The c10d fix ([Note: in-place collectives]) and the unit-clip one ([Note: a clip that does not bite]) are always
    put in place.

    Returns:
        The fixes in place in this process after the call: a subset of ``{"amp_unscale", "dtensor_foreach",
        "c10d", "unit_clip"}``.
    """
    with _lock:
        if "c10d" not in _done and dist.is_available():
            for name, (pos, key) in C10D_INPLACE.items():
                fn = getattr(dist, name, None)
                if fn is not None and not hasattr(fn, "__overlap_muon_version_fix__"):
                    _originals.append((dist, name, fn))
                    setattr(dist, name, _bumping_collective(name, fn, pos, key))
            _done.add("c10d")
        if "unit_clip" not in _done:
            import torch.nn.utils.clip_grad as clip_grad

            fn = clip_grad._clip_grads_with_norm_
            if not hasattr(fn, "__overlap_muon_version_fix__"):
                wrapped = _skipping_unit_clip(fn)
                for module, name in ((clip_grad, "_clip_grads_with_norm_"), (torch.nn.utils, "clip_grads_with_norm_")):
                    if getattr(module, name, None) is fn:
                        _originals.append((module, name, fn))
                        setattr(module, name, wrapped)
            _done.add("unit_clip")
        if "amp_unscale" not in _done and not unscale_bumps_versions():
            _wrap((AMP_UNSCALE,), lambda t: isinstance(t, torch.Tensor))
            _done.add("amp_unscale")
        if mesh is not None and "dtensor_foreach" not in _done and not foreach_bumps_dtensor_versions(mesh):
            from torch.distributed.tensor import DTensor

            _wrap(FOREACH_INPLACE, lambda t: isinstance(t, DTensor))
            _done.add("dtensor_foreach")
        return set(_done)
