"""DDP's averaged gradients as readiness: a comm hook that reports each bucket's params once its all-reduce has
completed, and the watch that finds a DDP wrapped around a model after its optimizer was built.
"""

# No `from __future__ import annotations` here: DDP.register_comm_hook checks the hook's annotations as
# objects (dist.GradBucket, torch.futures.Future[torch.Tensor]) and rejects strings.

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from .grad_ready import EndOfBackward

__all__ = ["ddp_readiness_hook", "attach_ddp_readiness", "watch_for_ddp"]


@dataclass
class _DDPReadinessState:
    on_ready: Callable[[list[int]], None]
    param_index: dict[int, int]
    process_group: dist.ProcessGroup | None
    on_bucket: Callable[[], None] | None = None
    """Called as each bucket's hook starts, on the autograd thread (:meth:`EndOfBackward.arm`)."""
    copy: bool = False
    """``gradient_as_bucket_view=False``: the hook copies each averaged gradient into ``.grad`` itself ([Note: DDP
    readiness])."""
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
    views = bucket.gradients()  # views of the bucket, in params order
    watched: list[tuple[torch.Tensor, int, torch.Tensor]] = []  # (param, index, its view of the bucket)
    for p, v in zip(params, views):
        if p.grad is not None and not state.copy and not _shares_storage(p.grad, buf):
            # Raised on every rank alike (same DDP config), before the all-reduce.
            raise ValueError(
                f"ddp_readiness_hook: a param of shape {tuple(p.shape)} has a .grad that is not a view of its DDP "
                f"bucket; construct DistributedDataParallel with gradient_as_bucket_view=True "
                f"(see [Note: DDP readiness])"
            )
        idx = state.param_index.get(id(p))
        if idx is not None:
            watched.append((p, idx, v))
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
        if state.copy:  # DDP copies the same bytes again in finalize_backward
            same = _shares_storage(out, buf)
            with torch.no_grad():
                for p, _, v in watched:
                    if p.grad is not None:  # the view's own layout (DDP lays a bucket view out as its grad)
                        p.grad.copy_(v if same else out.as_strided(
                            v.size(), v.stride(), out.storage_offset() + v.storage_offset() - buf.storage_offset()))
            ready = [idx for p, idx, _ in watched if p.grad is not None]
        else:
            # A result in the bucket itself is in .grad now; any other one DDP copies there at the end of
            # backward, so those params are left to the step (WaveDispatcher.flush).
            ready = [idx for p, idx, _ in watched if p.grad is not None] if _shares_storage(out, buf) else []
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
    copy = not getattr(ddp_model, "gradient_as_bucket_view", True)
    prior = getattr(ddp_model.__dict__.get("register_comm_hook"), "readiness", None)
    if prior is not None:
        prior.on_ready, prior.param_index, prior.on_bucket = on_ready, dict(param_index), arm
        return True
    state, hook = ddp_readiness_hook(on_ready, param_index, process_group=ddp_model.process_group)
    state.on_bucket, state.copy = arm, copy
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
    on a model built with ``DistributedDataParallel(..., gradient_as_bucket_view=True)`` (or through
    :func:`attach_ddp_readiness`, which also takes ``gradient_as_bucket_view=False``).

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

    So with ``gradient_as_bucket_view=True`` the hook checks that every bucket param's ``.grad`` lives in the
    bucket's storage and raises ``ValueError`` otherwise (on every rank, before the all-reduce); for each
    reported index ``param.grad`` is a view of the averaged buffer, so it holds the averaged gradient and DDP
    will not write it again this step. With ``gradient_as_bucket_view=False`` (Hugging Face's Trainer and
    Lightning build DDP so; :func:`attach_ddp_readiness` sets ``copy``), the hook copies each watched param's
    averaged slice into its ``.grad`` once the all-reduce has completed, then reports it; DDP's
    ``finalize_backward`` later copies the same bytes again, which moves the gradients' version counters and
    nothing else (the caller re-takes its records after it: ``on_backward_end`` runs after DDP's callback). Either
    way ``on_ready(indices)`` runs after the bucket's all-reduce completed, with the average in ``.grad``.

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


def watch_for_ddp(model: torch.nn.Module, on_found: Callable[[torch.nn.Module], None]) -> Any:
    """Call ``on_found(ddp)`` when a ``DistributedDataParallel`` holding ``model`` (itself or a submodule of the
    module it wraps: Lightning wraps its own wrapper) runs its forward before ``model``'s first forward: a DDP
    wrapped around the model after its optimizer was built (Hugging Face's Trainer, Lightning). A global forward
    pre-hook (``torch.nn.modules.module.register_module_forward_pre_hook``) that removes itself at ``model``'s
    first forward, or once it found one.

    Returns:
        A handle whose ``remove()`` removes the watch (idempotent).
    """
    from torch.nn.modules.module import register_module_forward_pre_hook
    from torch.nn.parallel import DistributedDataParallel

    handle: list[Any] = []

    def pre_hook(module: torch.nn.Module, _args: Any) -> None:
        if torch.compiler.is_compiling():  # traced to nothing inside a compiled region (no graph break)
            return
        if module is model:
            handle[0].remove()
        elif isinstance(module, DistributedDataParallel) and (
                module.module is model or any(m is model for m in module.module.modules())):
            handle[0].remove()
            on_found(module)

    handle.append(register_module_forward_pre_hook(pre_hook))
    return handle[0]

