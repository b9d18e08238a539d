"""Hooks that do not keep their owner alive, and one live owner per param.

A training-loop hook registered on a model outlives the object that registered it unless it holds that object
weakly: a dropped optimizer whose hooks still fire would apply every update twice next to its replacement.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["weak_callback", "ParamOwners"]


def weak_callback(method: Callable) -> Callable:
    """``method`` (a bound method) as a callback that holds its object weakly; a no-op once it is collected."""
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        m = ref()
        return None if m is None else m(*args)

    return call


class ParamOwners:
    """Which live object drives each param: ``claim`` refuses params another live, unreleased owner holds.

    The owner is recorded on the param itself (an attribute holding a weak reference to the owner), never as a
    reference to the param: ``torch.utils.swap_tensors`` (``model.to()`` / ``to_empty()`` with
    ``torch.__future__.set_swap_module_params_on_conversion(True)``, and DTensor params moved by ``Trainer``)
    refuses a tensor that something holds a weak reference to. The attribute moves with the tensor's contents, so a
    recycled ``id`` cannot be mistaken for it. Owners are held weakly and count as live while ``is_live(owner)``.
    """

    _ATTR = "_overlap_muon_owner"

    def __init__(self, is_live: Callable[[Any], bool]) -> None:
        self._is_live = is_live

    def _owner(self, p: torch.Tensor) -> Any:
        ref = getattr(p, self._ATTR, None)
        return ref() if ref is not None else None

    def claim(self, params: Iterable[torch.Tensor], owner: Any, message: str) -> None:
        """Record ``owner`` as the driver of ``params``.

        Raises:
            RuntimeError(message): another live owner holds one of them (after a cycle collection, since a
                dropped owner may only wait for the collector).
        """
        params = list(params)
        if any(self._owner(p) is not None for p in params):
            gc.collect()
        if any(o is not None and o is not owner and self._is_live(o) for o in map(self._owner, params)):
            raise RuntimeError(message)
        for p in params:
            setattr(p, self._ATTR, weakref.ref(owner))
