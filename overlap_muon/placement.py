"""Each Muon param's place: which domain routes it, its full shape and TP split, and how its rows are split into
separately orthogonalized parts (``overlap_muon.split``); the constructor's per-param checks, run on every rank."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from torch import Tensor

from .domain import MuonParam, block, describe_expert_param, describe_param
from .split import SplitArg, apply_runs, resolve_split, strided_parts

__all__ = ["place_params"]


def place_params(
    muon_named: Sequence[tuple[str, Tensor]],
    expert_ids: set[int],
    conv1d: set[int],
    split: SplitArg,
    dense: tuple[Any, Any, int, int, int, int],
    experts: tuple[Any, str, str, int, int],
) -> tuple[list[MuonParam], list[str]]:
    """The :class:`MuonParam` s of ``muon_named``, indexed ``0 .. n-1`` (a grouped expert weight gives one per
    matrix), with their transposition (HF ``Conv1D``: ``id`` in ``conv1d``), split parts (a strided expert shard's
    rows put in place, ``overlap_muon.split.strided_parts``) and apply runs.

    Args:
        dense: ``(device_mesh, (remat_dim, tp_dim), R, T, g, t)`` of the dense domain.
        experts: ``(expert_mesh, ep_dim, etp_dim, ETP, et)`` of the expert domain.

    Returns:
        ``(params, errors)``: every message names the param, its shape and the expectation.
    """
    mesh, dims, R, T, g, t = dense
    emesh, ep_dim, etp_dim, ET, et = experts
    muon: list[MuonParam] = []
    errors: list[str] = []
    for n, p in muon_named:
        if id(p) in expert_ids:
            mps, err = describe_expert_param(0, n, p, emesh, ET, et, ep_dim, etp_dim)
        else:
            mp, err = describe_param(0, n, p, mesh, R, T, g, t, dims=dims)
            mps = [mp] if mp is not None else []
        muon += mps
        errors += [err] if err else []
    for i, mp in enumerate(muon):
        mp.index = i
        mp.transposed = id(mp.param) in conv1d
        mp.parts, err = resolve_split(split, mp.name, mp.param, mp.ns_shape)
        if mp.split_factor > 1:  # rows of a strided expert shard, in place ([Note: strided expert rows])
            mp.parts = strided_parts(mp.parts, mp.full_shape, mp.split_factor, ET)
        if mp.parts is not None and mp.transposed:
            err = f"split of Muon param {mp.name!r}: a transposed (Conv1D) weight cannot be split yet"
        shard = (0, mp.full_shape[0], 0, mp.full_shape[1]) if mp.replicated else block(
            mp.full_shape, mp.partition_dim, *((1, ET, 0, et) if mp.domain else (R, T, g, t)))
        mp.runs = apply_runs(mp.parts, mp.ns_shape, (shard[2], shard[3], shard[0], shard[1]) if mp.transposed
                             else shard)
        errors += [err] if err else []
    return muon, errors
