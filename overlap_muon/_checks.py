"""Collective checks at construction: bad input and mismatched plans are a clear error on every rank, before any
rank enters an exchange (docs/design.md, invariant 3)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch.distributed as dist

from ._scheduler import first_plan_difference, param_fingerprints, plan_hash
from ._scheduler.waves import Wave

from .config import ENV_VARS, OverlapMuonConfig
from ._placement import MuonParam

__all__ = ["raise_everywhere", "check_plan_everywhere", "differs_across_ranks", "option_errors"]



def raise_everywhere(errors: list[str]) -> None:
    """Raise on every rank if any rank found bad input (invariant 6), before any exchange.

    The constructor calls it first with the mesh/domain error alone (it makes every param check meaningless),
    then with the params' errors. A message several ranks share is shown once; after 8 messages the rest are
    counted."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, errors)
        errors = list(errors) + [f"(rank {r}) {e}" for r, errs in enumerate(gathered) if r != dist.get_rank()
                                 for e in errs if e not in errors]  # the same message once
    if errors:
        msgs = list(dict.fromkeys(errors))
        more = f"; and {len(msgs) - 8} more" if len(msgs) > 8 else ""
        raise ValueError("OverlapMuon: " + "; ".join(msgs[:8]) + more)


def differs_across_ranks(value: Any, among: Sequence[int] | None = None) -> list[Any] | None:
    """The ``value`` (picklable) of every rank of ``among`` (default: every rank), in that order, when they are not
    all equal, else ``None``. Collective over the default group (``all_gather_object``, every rank whatever
    ``among``); ``None`` in one process."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return None
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    values = [values[r] for r in among] if among is not None else values
    return None if all(v == values[0] for v in values) else values


def option_errors(config: OverlapMuonConfig) -> list[str]:
    """Collective, before the runtime creates its groups (which options decide): a message naming each option the
    ranks were given differently, with its values and the ranks of each, else nothing."""
    values = {f: repr(getattr(config, f)) for f in ENV_VARS}
    per_rank = differs_across_ranks(values)
    if per_rank is None:
        return []
    parts = []
    for f, var in ENV_VARS.items():
        by_value: dict[str, list[int]] = {}
        for r, v in enumerate(per_rank):
            by_value.setdefault(v[f], []).append(r)
        if len(by_value) > 1:
            parts.append(f"{f} ({var}): " + ", ".join(f"{v} on ranks {_ranks(rs)}" for v, rs in by_value.items()))
    return [f"the ranks were given different options: {'; '.join(parts)}; every rank must pass the same arguments "
            "and environment"]


def _ranks(rs: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``0-2, 5``."""
    runs: list[list[int]] = []
    for r in rs:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    return ", ".join(f"{a[0]}-{a[-1]}" if len(a) > 2 else ", ".join(map(str, a)) for a in runs)


def check_plan_everywhere(muon: Sequence[MuonParam], waves: Sequence[Wave], plans: Sequence[Any] = (),
                          stages: Sequence[Sequence[int]] | None = None) -> None:
    """Every rank of a stage must plan the same waves, or the exchanges would pair up wrongly: compare a hash of
    the plan (``scheduler.plan_hash``, over the params' places and ``plans``: each wave plan's ``describe()``)
    across the ranks of each of ``stages`` (default: one stage, every rank; [Note: pipeline stages] in
    ``_discovery.py``), once, at construction (the options were compared before the groups were made,
    :func:`option_errors`).

    Raises:
        ValueError: on every rank of every stage, naming the first param whose place in the plan differs.
    """
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return
    stages = stages or [list(range(dist.get_world_size()))]
    names = [m.name for m in muon]
    fps = param_fingerprints(names, [m.full_shape for m in muon], [m.partition_dim for m in muon],
                             waves)
    hashes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(hashes, plan_hash(fps, tuple(plans)))
    odd = next((s for s in stages if len({hashes[r] for r in s}) > 1), None)
    if odd is None:
        return
    both: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(both, (fps, names))
    diff = first_plan_difference([both[r][0] for r in odd], [both[r][1] for r in odd])
    msg = diff.message() if diff is not None else "OverlapMuon: the ranks planned different waves"
    if len(stages) > 1:
        msg = f"pipeline stage {list(stages).index(odd)} (global ranks {list(odd)}, numbered 0.. below): {msg}"
    raise ValueError(msg)
