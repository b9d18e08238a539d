"""Module forward pre-hooks that wait for a module's optimizer update before its forward reads the weights.

[Note: forward waits under torch.compile] A wait blocks on a lane (a ``concurrent.futures`` future, a CUDA event):
Dynamo cannot trace it (``Condition`` is not a context manager it knows), and a ``torch._dynamo.disable``d hook
inside a traced region is a graph break (an error under ``fullgraph=True``). How FSDP2 does it: its pre/post-forward
hooks are wrapped in ``torch._dynamo.disable`` (``torch/distributed/fsdp/_fully_shard/_fsdp_common.py``
``_dynamo_disable``; torch 2.13 has no ``torch._dynamo.config.skip_fsdp_hooks`` any more), so they run eagerly at
the top of a compiled module (torchtitan compiles each block and ``fully_shard``s the same blocks) and would break
a graph inside one. Ours are built so that neither case adds a graph break (checked on torch 2.13, CPU, backends
``eager`` and ``aot_eager``, per-block ``module.compile()`` / ``torch.compile(block)`` and whole-model compile):

* the hook's code object is skipped by Dynamo's frame evaluation (``torch._dynamo.eval_frame.skip_code``, what
  ``torch._dynamo.skip`` does without also marking the function disabled), so at the top of a compiled module --
  where Dynamo starts a frame for each hook of the module it was asked to compile -- the hook runs eagerly and waits
  through a ``torch._dynamo.disable``d call (the frames a skipped frame calls would be compiled otherwise);
* inside a traced region Dynamo inlines the hook, ``torch.compiler.is_compiling()`` is true there and the hook
  traces to nothing: the wait is moved to the *nearest uncompiled boundary*, the compiled module whose own hook
  runs eagerly (:func:`compile_boundary`) and waits for every param of its subtree. The weights of a compiled block
  are therefore awaited when the block starts (per block, so the next forward still overlaps the later waves);
* at trace time (only then) ``on_traced()`` is called (``torch._dynamo.assume_constant_result`` runs it while
  tracing): the caller checks that a compiled boundary's wait ran eagerly in this forward (tracing starts right
  after the boundary's pre-hooks), and raises otherwise (a region compiled from outside the model, e.g.
  ``torch.compile`` of a function that calls it, runs no hook of ours eagerly: it could read stale weights).
"""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["register_forward_waits", "compile_boundary"]

try:  # private in torch 2.13 (torch/_dynamo/eval_frame.py); without them, compiled regions get no special care
    from torch._dynamo.eval_frame import _is_in_optimized_module, skip_code as _skip_code
except Exception:  # pragma: no cover
    _is_in_optimized_module = None  # type: ignore[assignment]
    _skip_code = None  # type: ignore[assignment]

_ON_TRACED: dict[int, Callable[[], None]] = {}  # token -> the caller's trace-time check (one entry per caller)


def _traced(token: int) -> bool:
    """Called by Dynamo at trace time only (``assume_constant_result``): a hook was inlined into a graph. (Nothing
    about the module is passed: an ``id(module)`` would make Dynamo guard on the module object and compile every
    block's graph anew.)"""
    cb = _ON_TRACED.get(token)
    if cb is not None:
        cb()
    return True


if hasattr(torch, "_dynamo"):
    _traced = torch._dynamo.assume_constant_result(_traced)


def compile_boundary(module: torch.nn.Module) -> bool:
    """True when ``module``'s forward is about to run as compiled code while its forward pre-hooks run eagerly now:
    it was ``module.compile()``d, or it is called through a ``torch.compile`` wrapper (``OptimizedModule``: the
    model itself, or a block a torchtitan-style loop replaced by ``torch.compile(block)``). Its subtree's hooks will
    be traced to nothing ([Note: forward waits under torch.compile]), so its own hook must wait for all of them."""
    if getattr(module, "_compiled_call_impl", None) is not None:
        return True
    return bool(_is_in_optimized_module is not None and _is_in_optimized_module())


def _call_eagerly(wait: Callable[[torch.nn.Module], None], module: torch.nn.Module) -> None:
    wait(module)


if hasattr(torch, "_dynamo"):
    # A skipped frame's callees are still compiled frame by frame; the wait and everything it calls must not be.
    _call_eagerly = torch._dynamo.disable(_call_eagerly, reason="OverlapMuon forward wait (a host/stream wait)")


def _make_pre_hook(wait: Callable[[torch.nn.Module], None], token: int | None) -> Callable:
    def _pre_hook(module: torch.nn.Module, _args: tuple) -> None:
        if torch.compiler.is_compiling():
            if token is not None:
                _traced(token)
            return
        _call_eagerly(wait, module)

    return _pre_hook


if _skip_code is not None:
    _skip_code(_make_pre_hook(lambda m: None, None).__code__)  # one code object for every hook made above


def register_forward_waits(
    modules: Iterable[torch.nn.Module],
    wait: Callable[[torch.nn.Module], None],
    on_traced: Callable[[], None] | None = None,
) -> list[RemovableHandle]:
    """Register ``wait(module)`` to run before each module's forward, ahead of every other pre-hook.

    Hooks are registered with ``prepend=True``: FSDP2 all-gathers a module's sharded params in its own
    forward pre-hook, so the wait must run first or the forward would gather stale shards ([Note: FSDP2 and hook
    order] in docs/design.md). A prepended hook registered after ``fully_shard`` sees the sharded DTensor params.
    ``wait`` returns nothing; it blocks (or enqueues a stream wait) until the module's update has landed. A module
    listed twice is hooked once.

    Under ``torch.compile`` see [Note: forward waits under torch.compile]: the hook runs eagerly at the top of a
    compiled module and traces to nothing inside one.

    Args:
        modules: the modules whose forward must wait.
        wait: called with the module, on the thread running its forward (never while Dynamo traces).
        on_traced: called (no arguments) when Dynamo inlines one of these hooks into a graph (at trace time, once
            per trace), e.g. to check that an eager boundary covers the region and raise otherwise.

    Returns:
        One handle per hooked module, plus one for ``on_traced`` when given; ``handle.remove()`` unregisters it.

    Raises:
        TypeError: an entry is not a ``torch.nn.Module``.
    """
    mods: list[torch.nn.Module] = []
    seen: set[int] = set()
    for k, m in enumerate(modules):
        if not isinstance(m, torch.nn.Module):
            raise TypeError(f"modules[{k}] is a {type(m).__name__}, expected a torch.nn.Module")
        if id(m) not in seen:
            seen.add(id(m))
            mods.append(m)

    token = None
    extra: list = []
    if on_traced is not None:
        token = id(on_traced)
        _ON_TRACED[token] = on_traced
        extra.append(_TokenHandle(token))
    hook = _make_pre_hook(wait, token)
    return [m.register_forward_pre_hook(hook, prepend=True) for m in mods] + extra


class _TokenHandle:
    """Removes a trace-time callback from the registry (returned beside the hook handles)."""

    def __init__(self, token: int) -> None:
        self.token = token

    def remove(self) -> None:
        _ON_TRACED.pop(self.token, None)


def fsdp_param_streams(module: torch.nn.Module) -> list:
    """The CUDA streams on which FSDP2 reads ``module``'s sharded params, to make them wait for an update.

    FSDP2 copies the sharded params into its all-gather buffer on ``all_gather_copy_in_stream`` and all-gathers
    on ``all_gather_stream``; the root's pre-forward makes both wait on the current stream once per iteration,
    *before* the per-module pre-hooks run, so a wait enqueued later on the current stream does not reach them.
    [Note: FSDP2 streams] Private: ``module._get_fsdp_state()._comm_ctx`` (torch 2.13,
    ``torch/distributed/fsdp/_fully_shard/_fsdp_state.py`` and ``_fsdp_param_group.py``; checked against
    2.13.0). FSDP2's public ``set_post_optim_event`` would make every all-gather of the next forward wait for
    the LAST update, which would serialize the forward behind the whole optimizer step.

    Returns:
        ``[copy_in_stream, all_gather_stream]`` when ``module`` is an FSDP2 module with CUDA streams, else ``[]``.
    """
    get_state = getattr(module, "_get_fsdp_state", None)
    if get_state is None:
        return []
    ctx = getattr(get_state(), "_comm_ctx", None)
    streams = [getattr(ctx, "all_gather_copy_in_stream", None), getattr(ctx, "all_gather_stream", None)]
    return [s for s in streams if s is not None and hasattr(s, "wait_event")]


def params_read_by_module(model: torch.nn.Module, index: dict[int, int]) -> dict[torch.nn.Module, set[int]]:
    """For each module whose forward reads some of the params in ``index`` (``id(param) -> i``), those ``i``.

    A module reads the params it owns directly; an FSDP2 module also reads the params it manages (its subtree minus
    nested FSDP2 modules), since it all-gathers them in its own pre-forward.
    """
    try:
        from torch.distributed.fsdp import FSDPModule
    except Exception:  # pragma: no cover
        FSDPModule = ()  # type: ignore[assignment]

    def own(mod: torch.nn.Module) -> set[int]:
        return {index[id(p)] for p in mod.parameters(recurse=False) if id(p) in index}

    def managed(mod: torch.nn.Module) -> set[int]:
        out = own(mod)
        for child in mod.children():
            if not isinstance(child, FSDPModule):
                out |= managed(child)
        return out

    reads = {mod: (managed(mod) if isinstance(mod, FSDPModule) else own(mod)) for mod in model.modules()}
    return {mod: s for mod, s in reads.items() if s}
