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
