"""Optimizer state that ``OverlapMuon`` keeps the way torch does, and the checks a checkpoint must pass before
:meth:`OverlapMuon.load_state_dict` touches anything.

[Note: lazy state] As in torch, a param gets its state at its first gradient: Muon momentum when ``step()``
commits its first update (``_pipeline.WavePipeline.commit``), AdamW moments in the inner ``torch.optim.AdamW``'s own
``step()``. A frozen param (LoRA's base weights) costs no optimizer memory. DCP needs the same state keys on every
rank: Muon params agree by construction (a param with a gradient on some ranks of its domain and not on others is
a ``ValueError``), and an AdamW param that has a gradient on another rank but not here gets here the zero state
AdamW would create for it (:func:`init_adamw_state`), decided by the step's agreement on the runtime's gloo group
(``_agreement.Agreement.adamw_elsewhere``). A param with no gradient on any rank has no state anywhere.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import torch
from torch import Tensor

from ._placement import MuonParam

__all__ = ["init_adamw_state", "checkpoint_meta", "checkpoint_errors"]


def init_adamw_state(groups: Sequence[dict[str, Any]], state: dict, only: Collection[int]) -> None:
    """Create, for the params of ``groups`` whose ``id`` is in ``only`` and that have no state yet, the state
    ``torch.optim.AdamW._init_group`` creates at a param's first step (zero moments, ``step`` 0): the values a
    later first step starts from either way, so the update is unchanged ([Note: lazy state])."""
    if not only:
        return
    for group in groups:
        for p in group["params"]:
            if id(p) not in only or state.get(p):
                continue
            st = state[p]
            on_dev = group["capturable"] or group["fused"]
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device if on_dev else None)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def checkpoint_meta(muon: Sequence[MuonParam], adamw_groups: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The ``"overlap_muon"`` entry of a state dict: Muon param names, full shapes, partition dims."""
    return {
        "muon_params": [(m.name, list(m.full_shape), m.partition_dim) for m in muon],
        "num_adamw_params": sum(len(g["params"]) for g in adamw_groups),
    }


def checkpoint_errors(
    state_dict: dict[str, Any], muon: Sequence[MuonParam], groups: Sequence[dict[str, Any]], names: dict[int, str]
) -> list[str]:
    """Why ``state_dict`` does not fit an optimizer with Muon params ``muon`` and param ``groups`` (empty: it fits).

    Checked, by position as torch matches a checkpoint's params: the Muon params' full shapes and partition dims
    (when the checkpoint records them; names may differ, e.g. ``weight`` saved before pruning and ``weight_orig``
    after it, and are only reported), the number of groups and of params per group, and that every per-element
    state tensor has its param's shape.
    """
    errors = []
    meta = state_dict.get("overlap_muon")
    if meta is not None:
        mine = [(m.name, list(m.full_shape), m.partition_dim) for m in muon]
        theirs = [(n, list(s), d) for n, s, d in meta["muon_params"]]
        diff = [f"Muon param {i}: {a[0]!r} {tuple(a[1])} partition dim {a[2]} in the checkpoint, {b[0]!r} "
                f"{tuple(b[1])} partition dim {b[2]} here" for i, (a, b) in enumerate(zip(theirs, mine))
                if a[1:] != b[1:]]
        if len(theirs) != len(mine) or diff:
            errors.append(f"checkpoint has {len(theirs)} Muon params, this optimizer {len(mine)}; first differences: "
                          f"{diff[:3] or 'lengths differ'}")
    saved = state_dict.get("param_groups", [])
    if len(saved) != len(groups):
        return errors + [f"checkpoint has {len(saved)} param groups, this optimizer {len(groups)}"]
    errors += [f"param group {gi} has {len(a['params'])} params in the checkpoint, {len(b['params'])} here"
               for gi, (a, b) in enumerate(zip(saved, groups)) if len(a["params"]) != len(b["params"])]
    if errors:
        return errors
    by_id = dict(zip([i for g in saved for i in g["params"]], [p for g in groups for p in g["params"]]))
    for pid, st in state_dict.get("state", {}).items():
        p = by_id.get(pid)
        for key, v in (st.items() if p is not None and isinstance(st, dict) else ()):
            # every per-element entry (momentum_buffer, exp_avg, exp_avg_sq, ...) has its param's shape
            if isinstance(v, Tensor) and v.ndim > 0 and tuple(v.shape) != tuple(p.shape):
                what = "momentum of Muon param" if key == "momentum_buffer" else f"{key} of AdamW param"
                errors.append(f"{what} {names.get(id(p), pid)!r} has shape {tuple(v.shape)} in the checkpoint, "
                              f"expected {tuple(p.shape)}")
    return errors
