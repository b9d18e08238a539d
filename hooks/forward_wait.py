"""Module forward pre-hooks that wait for a module's optimizer update before its forward reads the weights."""

from __future__ import annotations

from typing import Callable, Iterable

import torch
from torch.utils.hooks import RemovableHandle

__all__ = ["register_forward_waits"]


def register_forward_waits(
    modules: Iterable[torch.nn.Module],
    wait: Callable[[torch.nn.Module], None],
) -> list[RemovableHandle]:
    """Register ``wait(module)`` to run before each module's forward, ahead of every other pre-hook.

    Hooks are registered with ``prepend=True``: FSDP2 all-gathers a module's sharded params in its own
    forward pre-hook, so the wait must run first or the forward would gather stale shards (DESIGN.md
    "[Note: FSDP2 and hook order]"). A prepended hook registered after ``fully_shard`` sees the sharded
    DTensor params. ``wait`` returns nothing; it blocks (or enqueues a stream wait) until the module's
    update has landed. A module listed twice is hooked once.

    Args:
        modules: the modules whose forward must wait.
        wait: called with the module, on the thread running its forward.

    Returns:
        One handle per hooked module; ``handle.remove()`` unregisters it.

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

    def _pre_hook(module: torch.nn.Module, _args: tuple) -> None:
        wait(module)

    return [m.register_forward_pre_hook(_pre_hook, prepend=True) for m in mods]


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
