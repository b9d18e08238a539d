"""One live owner per param: two optimizers driving the same params would apply every update twice.

Hooks hold their owner weakly (``grad_ready.weak_callback``), so a dropped owner's hooks fall silent; a live one
keeps its claim.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["ParamOwners"]


class ParamOwners:
    """Which live object drives each param: ``claim`` refuses params another live, unreleased owner holds.

    Nothing here refers to a param: ``torch.utils.swap_tensors`` (``model.to()`` / ``to_empty()`` with
    ``torch.__future__.set_swap_module_params_on_conversion(True)``, and DTensor params moved by ``Trainer``)
    refuses a tensor that something holds a weak reference to. A claim tags each param with a plain int (so
    ``torch.save`` of a param or model still pickles it) naming an entry here: the owner (held weakly) and the ids
    of the params it claimed; an id is only trusted while that owner is live, which keeps its params, and so their
    ids, alive. Owners count as live while ``is_live(owner)`` is true.
    """

    _ATTR = "_overlap_muon_owner"

    def __init__(self, is_live: Callable[[Any], bool]) -> None:
        self._is_live = is_live
        self._claims: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        self._next = 0

    def _owner(self, p: torch.Tensor) -> Any:
        entry = self._claims.get(getattr(p, self._ATTR, -1))
        return entry[0]() if entry is not None and id(p) in entry[1] else None

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
        self._claims = {k: v for k, v in self._claims.items() if v[0]() is not None}  # drop dead owners' claims
        self._next += 1
        self._claims[self._next] = (weakref.ref(owner), frozenset(id(p) for p in params))
        for p in params:
            setattr(p, self._ATTR, self._next)
