"""Gradient-ready signals: per-param autograd hooks, and the end of a backward pass (``ddp_readiness.py`` has the
DDP comm hook that signals per averaged bucket).

Generic: these report *param indices*; what happens next (a wave dispatcher, a recorder) is the caller's. A hook
registered on a model outlives the object that registered it unless it holds that object weakly
(:func:`weak_callback`): a dropped optimizer whose hooks still fire would apply every update twice next to its
replacement.
"""

import threading
import weakref
from typing import Any, Callable, Sequence

import torch
from torch.autograd import Variable

__all__ = ["EndOfBackward", "GradReadyTracker", "weak_callback"]


def weak_callback(method: Callable) -> Callable:
    """``method`` (a bound method) as a callback that holds its object weakly; a no-op once it is collected."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        return None if m is None else m(*args)

    return call


class EndOfBackward:
    """Runs ``callback`` once at the end of each backward pass in which :meth:`arm` was called ([Note: end of
    backward]): :meth:`arm` queues it on the current graph task (once per task); a nested task's end (a reentrant
    checkpoint) hands it to the enclosing task, so only the outermost task's end runs it. With ``last``, it runs
    after every end-of-backward callback queued before the outermost task's end (DDP's). ``arm`` outside a
    backward does nothing."""

    def __init__(self, callback: Callable[[], None], last: bool = False) -> None:
        self._callback, self._last = callback, last
        self._lock = threading.Lock()
        self._tasks: set[int] = set()  # graph tasks holding the callback (nested ones included)
        self.enabled = True

    def arm(self) -> None:
        task = torch._C._current_graph_task_id()
        if task == -1 or not self.enabled:
            return  # not inside a backward (a hook invoked by hand): nothing to queue on
        with self._lock:
            if task in self._tasks:
                return
            self._tasks.add(task)
        Variable._execution_engine.queue_callback(self._end_of_graph_task)

    def _end_of_graph_task(self) -> None:
        # A reentrant checkpoint runs a nested backward inside an outer node; its graph task ends while the outer
        # backward still has gradients to produce. There the engine still reports the outer node as current: the
        # callback moves to the outer task through a post-hook of that node, which runs in the outer task once the
        # node is done (when every watched param sits in a checkpointed region, nothing else arms the outer task).
        outer = torch._C._current_autograd_node()
        if outer is not None:
            outer.register_hook(lambda *_: self.arm())
            return
        with self._lock:
            self._tasks.clear()  # ids are never reused; an aborted backward's stay until here
        if self._last:  # after every callback queued so far (DDP's finalize_backward, which waits its buckets)
            Variable._execution_engine.queue_callback(self._callback)
            return
        self._callback()


class GradReadyTracker:
    """Calls ``on_ready(i)`` when param ``i``'s gradient has been accumulated into ``param.grad``.

    Hooks are ``register_post_accumulate_grad_hook`` hooks, so they fire after ``.grad`` holds the whole
    gradient of this backward (a param used several times in the graph fires once, after the sum). They work
    for plain and DTensor params; FSDP2 calls them itself once it has reduce-scattered the sharded ``.grad``
    (``_fsdp_collectives.foreach_reduce``). On CUDA the hook runs on the CPU thread when the work producing the
    grad has been *enqueued*; stream ordering is the consumer's business.

    [Note: end of backward] ``on_backward_end`` must run once after the last gradient of a backward pass, so
    that params whose hooks never fired (unused, no grad) can be flushed (docs/design.md, invariant 3). Autograd
    has no public per-parameter-set "backward done" hook, but its engine runs callbacks queued with
    ``Variable._execution_engine.queue_callback`` once the current graph task has finished (this is how DDP
    and FSDP finalize). The first hook that fires in a graph task queues it; the graph task id
    (``torch._C._current_graph_task_id``) tells "first in this backward" apart, so an aborted backward cannot
    leave a stale "already queued" flag. With reentrant activation checkpointing (``use_reentrant=True``) the
    hooks of params inside a checkpointed region run in a nested graph task; its end is not the end of backward
    (the engine still reports the enclosing checkpoint node as the current node), so it queues the callback on
    the enclosing task instead (a post-hook of that node), and the outermost graph task's end fires
    ``on_backward_end`` (:class:`EndOfBackward`, which DDP's readiness hook uses too).

    Args:
        params: the params to watch; index ``i`` is the position in this sequence. A tensor listed twice (tied
            weights) is hooked once and reported under its first index. Params with ``requires_grad=False``
            never get a gradient and are not hooked.
        on_ready: called with the param index, on the thread autograd runs the hook on (not necessarily the
            thread that called ``backward``).
        on_backward_end: called once at the end of each backward pass in which at least one hook fired while
            the tracker was enabled.
        settle: while it returns True (a backward that adds into gradients already there), a param whose gradient
            is a view into a buffer larger than itself is reported only once that buffer is done ([Note: shared
            gradient buffers]).

    Attributes:
        enabled: when False the hooks do nothing (no ``on_ready``, no end callback): set it False for the
            micro-batches of gradient accumulation that must not trigger a step.

    Raises:
        TypeError: an entry of ``params`` is not a tensor.
        ValueError: a param that requires grad is not a leaf (hooks can only fire on leaves).
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        on_ready: Callable[[int], None],
        on_backward_end: Callable[[], None] | None = None,
        settle: Callable[[], bool] | None = None,
    ) -> None:
        self.enabled = True
        self._on_ready = on_ready
        self._on_backward_end = on_backward_end
        self._settle = settle
        self._held: list[int] = []  # ready, waiting for their shared buffer to be done
        self._held_buffer: tuple | None = None
        self._lock = threading.Lock()
        self._end = EndOfBackward(self._backward_ended) if on_backward_end is not None else None
        self._handles: list[torch.utils.hooks.RemovableHandle] = []
        seen: set[int] = set()
        checked: list[tuple[int, torch.Tensor]] = []
        for i, p in enumerate(params):
            if not isinstance(p, torch.Tensor):
                raise TypeError(f"param {i} is a {type(p).__name__}, expected a torch.Tensor")
            if id(p) in seen or not p.requires_grad:
                continue
            if not p.is_leaf:
                raise ValueError(
                    f"param {i} (shape {tuple(p.shape)}) is not a leaf tensor; grad-ready hooks need leaf params"
                )
            seen.add(id(p))
            checked.append((i, p))
        # Register only after validating everything, so a bad param leaves no hooks behind.
        for i, p in checked:
            self._handles.append(p.register_post_accumulate_grad_hook(self._make_hook(i)))

    def _make_hook(self, i: int) -> Callable[[torch.Tensor], None]:
        def hook(param: torch.Tensor) -> None:
            if not self.enabled:
                return
            if self._end is not None:
                self._end.arm()
            self._ready(i, param)

        return hook

    def _ready(self, i: int, param: torch.Tensor) -> None:
        """[Note: shared gradient buffers] FSDP2 reduce-scatters a module's gradients into one buffer and gives each
        param a view of it; a later backward of the same step adds into those views in place, param after param,
        calling each param's hook after its own add. The views share one version counter, so the add into the next
        param (a bias) moves the counter of the one before (its weight), whose wave has already read it: every
        wave would re-run at ``step()``. While ``settle()`` holds, such a param is held until a hook fires for a
        param of another buffer (FSDP2 has finished this one) or backward ends."""
        settling = self._settle is not None and self._settle()
        buf = _shared_buffer(param) if settling else None
        with self._lock:
            if not settling:
                self._held = []  # a new step's first backward: anything still held belongs to an earlier one
            release = self._held if self._held and buf != self._held_buffer else []
            if release:
                self._held = []
            if buf is not None:
                self._held.append(i)
                self._held_buffer = buf
        for j in release:
            self._on_ready(j)
        if buf is None:
            self._on_ready(i)

    def _release_held(self) -> None:
        with self._lock:
            release, self._held = self._held, []
        for j in release:
            self._on_ready(j)

    def _backward_ended(self) -> None:
        self._release_held()
        assert self._on_backward_end is not None
        self._on_backward_end()

    def remove(self) -> None:
        """Remove every hook. Idempotent."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _shared_buffer(param: torch.Tensor) -> tuple | None:
    """The buffer ``param``'s gradient (its local shard, for a DTensor) is a view into, when that buffer holds more
    than this gradient (``(device, data pointer)``: several params' gradients); else ``None``."""
    grad = param.grad
    if grad is None:
        return None
    local = grad.to_local() if hasattr(grad, "to_local") else grad
    base = local._base
    if base is None or base.numel() <= local.numel():
        return None
    return (base.device, base.untyped_storage().data_ptr())
