"""Gradient-ready signals: per-param autograd hooks, and a DDP comm hook that signals per averaged bucket.

Generic: these report *param indices*; what happens next (a wave dispatcher, a recorder) is the caller's. A hook
registered on a model outlives the object that registered it unless it holds that object weakly
(:func:`weak_callback`): a dropped optimizer whose hooks still fire would apply every update twice next to its
replacement.
"""

# No `from __future__ import annotations` here: DDP.register_comm_hook checks the hook's annotations as
# objects (dist.GradBucket, torch.futures.Future[torch.Tensor]) and rejects strings.

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd import Variable

__all__ = ["EndOfBackward", "GradReadyTracker", "ddp_readiness_hook", "attach_ddp_readiness", "weak_callback"]


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

    @property
    def num_hooks(self) -> int:
        """Number of registered hooks (distinct params that require grad)."""
        return len(self._handles)

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


@dataclass
class _DDPReadinessState:
    on_ready: Callable[[list[int]], None]
    param_index: dict[int, int]
    process_group: dist.ProcessGroup | None
    on_bucket: Callable[[], None] | None = None
    """Called as each bucket's hook starts, on the autograd thread (:meth:`EndOfBackward.arm`)."""
    user_hook: Callable | None = None
    """The user's own comm hook, registered after ours (:func:`attach_ddp_readiness`); it reduces instead of ours."""
    user_state: object = None


def _shares_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def _ddp_readiness_comm_hook(
    state: _DDPReadinessState, bucket: dist.GradBucket
) -> torch.futures.Future[torch.Tensor]:
    if state.on_bucket is not None:
        state.on_bucket()
    buf = bucket.buffer()
    params = bucket.parameters()
    watched: list[tuple[torch.Tensor, int]] = []
    for p in params:
        if p.grad is not None and not _shares_storage(p.grad, buf):
            # Raised on every rank alike (same DDP config), before the all-reduce.
            raise ValueError(
                f"ddp_readiness_hook: a param of shape {tuple(p.shape)} has a .grad that is not a view of its DDP "
                f"bucket; construct DistributedDataParallel with gradient_as_bucket_view=True "
                f"(see [Note: DDP readiness])"
            )
        idx = state.param_index.get(id(p))
        if idx is not None:
            watched.append((p, idx))
    if state.user_hook is not None:
        fut = state.user_hook(state.user_state, bucket)
    else:
        group = state.process_group if state.process_group is not None else dist.group.WORLD
        # Average as DDP's default allreduce_hook does: divide first (no overflow in low precision), then sum.
        buf.div_(dist.get_world_size(group))
        fut = dist.all_reduce(buf, group=group, async_op=True).get_future()

    def _done(f: torch.futures.Future) -> torch.Tensor:
        value = f.value()
        out = value[0] if isinstance(value, (list, tuple)) else value
        # A result in the bucket itself is in .grad now; any other one DDP copies there at the end of backward,
        # so those params are left to the step (WaveDispatcher.flush).
        ready = [idx for p, idx in watched if p.grad is not None] if _shares_storage(out, buf) else []
        if ready:
            state.on_ready(ready)
        return out

    return fut.then(_done)


def attach_ddp_readiness(ddp_model: torch.nn.Module, on_ready: Callable[[list[int]], None],
                         param_index: dict[int, int], on_backward_end: Callable[[], None] | None = None) -> bool:
    """Register :func:`ddp_readiness_hook` on ``ddp_model`` and chain the comm hook the user registers after it.

    DDP's reducer takes one comm hook per model. Ours goes in, and ``ddp_model.register_comm_hook`` (on the
    instance) then routes the user's ``(hook_state, hook)`` into it: our hook calls the user's hook instead of its
    own all-reduce, and reports the bucket's params once the user's future has completed (a second user hook
    raises DDP's own ``RuntimeError``). Called again on the same model (the optimizer re-bound to replaced
    params), the registered hook is pointed at the new ``on_ready`` and ``param_index``.

    ``on_backward_end`` runs once at the end of each backward in which a bucket's hook ran (:class:`EndOfBackward`),
    after DDP's own end-of-backward work (which waits for every bucket's hook, so ``on_ready`` has run by then).

    Returns:
        False when the model already has another comm hook (registered before ours; then nothing is changed).
    """
    arm = EndOfBackward(on_backward_end, last=True).arm if on_backward_end is not None else None
    prior = getattr(ddp_model.__dict__.get("register_comm_hook"), "readiness", None)
    if prior is not None:
        prior.on_ready, prior.param_index, prior.on_bucket = on_ready, dict(param_index), arm
        return True
    state, hook = ddp_readiness_hook(on_ready, param_index, process_group=ddp_model.process_group)
    state.on_bucket = arm
    try:
        ddp_model.register_comm_hook(state, hook)
    except RuntimeError as e:
        if "once" not in str(e):
            raise
        return False

    def register_comm_hook(hook_state: object, hook: Callable) -> None:
        if state.user_hook is not None:
            raise RuntimeError("register_comm_hook or register_builtin_comm_hook can only be called once.")
        state.user_state, state.user_hook = hook_state, hook

    register_comm_hook.readiness = state  # type: ignore[attr-defined]
    ddp_model.register_comm_hook = register_comm_hook  # type: ignore[method-assign]
    return True


def ddp_readiness_hook(
    on_ready: Callable[[list[int]], None],
    param_index: dict[int, int],
    process_group: dist.ProcessGroup | None = None,
) -> tuple[object, Callable[..., torch.futures.Future[torch.Tensor]]]:
    """A DDP comm hook that averages each bucket and then reports its params as ready.

    Use: ``ddp.register_comm_hook(*ddp_readiness_hook(on_ready, {id(p): i for i, p in enumerate(muon_params)}))``
    on a model built with ``DistributedDataParallel(..., gradient_as_bucket_view=True)``.

    [Note: DDP readiness] When is the averaged gradient in ``param.grad``? Torch 2.13's reducer
    (``torch/csrc/distributed/c10d/reducer.cpp``), checked on CPU/gloo:

    * ``gradient_as_bucket_view=False``: autograd's grad is *copied into* the bucket, the comm hook reduces the
      bucket, and the result is copied back into ``param.grad`` only in ``finalize_backward``, an engine
      callback queued when the last bucket is marked ready, i.e. at the end of backward. A signal from the
      hook's future would expose the *local, un-averaged* gradient in ``.grad``.
    * ``gradient_as_bucket_view=True``: when a param is marked ready the reducer makes ``param.grad`` a view
      of the bucket buffer (it copies the first time, or after ``zero_grad(set_to_none=True)``), before the
      bucket's comm hook is called. The hook all-reduces ``bucket.buffer()`` in place and returns that same
      tensor, so the reducer's later ``bucket_view_in.copy_(bucket_view_out)`` is skipped (they alias) and
      ``.grad`` already holds the average when the all-reduce future completes.

    So this hook requires ``gradient_as_bucket_view=True``: at each call it checks that every bucket param's
    ``.grad`` lives in the bucket's storage and raises ``ValueError`` otherwise (on every rank, before the
    all-reduce). The guarantee: ``on_ready(indices)`` runs after the bucket's all-reduce completed, and for
    each reported index ``param.grad`` is a view of the averaged buffer, so it holds the averaged gradient
    and DDP will not write it again this step.

    Only params with a ``.grad`` at that moment are reported. A param unused on this rank
    (``find_unused_parameters=True``) has ``.grad is None`` until DDP's ``finalize_backward`` sets it (or
    leaves it None if unused on every rank); it is not reported, and the caller launches its wave after
    backward has returned (``WaveDispatcher.flush`` from ``step()``), not from an end-of-backward callback
    queued earlier than DDP's.

    Args:
        on_ready: called once per bucket with the indices of its watched params (bucket order), on the thread
            that completes the all-reduce future (a communication thread, not the autograd thread).
        param_index: ``id(param) -> index``; bucket params not in it (e.g. AdamW params) are averaged but not
            reported.
        process_group: DDP's process group (``None``: the default group), used for the all-reduce.

    Returns:
        ``(state, hook)`` for ``DistributedDataParallel.register_comm_hook(state, hook)``.
    """
    state = _DDPReadinessState(on_ready=on_ready, param_index=dict(param_index), process_group=process_group)
    return state, _ddp_readiness_comm_hook
