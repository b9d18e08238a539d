"""Each Muon param's NS strategy (home, duplicated or Gram) and the planner's costs that follow from it.

``mode="auto"`` picks per weight ([Note: NS strategy per weight] in ``scheduler/strategy.py``); the other modes
fix it. The picks are a function of the shapes, the domain and the figures alone, the same on every rank (the
plan hash compares the wave plans they lead to). They are logged once (rank 0, INFO, a row per name pattern) and
counted in ``stats`` (``strategy.home``, ``strategy.duplicated``, ``strategy.gram``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ._gram_mode import gram_orientations
from ._placement import MuonParam
from ._scheduler.strategy import pick_strategies
from ._sorting import _pattern

logger = logging.getLogger("overlap_muon")

__all__ = ["Strategies", "ns_strategies"]


@dataclass
class Strategies:
    """What the planner needs of the picks.

    Attributes:
        gram: params NS'd in Gram space, each with whether its rows are split (``_gram_mode.gram_orientations``);
            ``None`` where no param may be.
        duplicated: params every rank of the domain gathers and NS's (``mode="auto"`` only).
        picks: per Muon param, its strategy.
    """

    gram: dict[int, bool] | None
    duplicated: frozenset[int] = frozenset()
    picks: list[str] = field(default_factory=list)


def ns_strategies(muon: list[MuonParam], config: Any, dom: Any, cost_model: Any, stats: dict[str, int]
                  ) -> Strategies:
    """The picks for ``config.mode`` over the dense domain ``dom`` (its ``remat_size`` and ``tp_size``), by
    ``cost_model``'s figures (``mode="auto"``; Gram only with ``allow_inexact``). Expert, replicated, transposed
    and split params stay at their home."""
    R, T = dom.remat_size, dom.tp_size
    grams = config.mode == "gram" or (config.mode == "auto" and config.allow_inexact)
    gram_ok = gram_orientations(muon, R, T) if grams else None
    if config.mode != "auto":
        picks = ["gram" if gram_ok and m.index in gram_ok else
                 "duplicated" if config.mode == "duplicated" else "home" for m in muon]
        return Strategies(gram_ok, picks=picks)
    dense = [m for m in muon if not (m.domain or m.replicated or m.transposed or m.parts is not None)]
    got = pick_strategies([m.full_shape for m in dense], R * T, cost_model, restart_every=config.gram_restart_every,
                          gram_ok={j: True for j, m in enumerate(dense) if gram_ok and m.index in gram_ok})
    picks = ["home"] * len(muon)
    for m, k in zip(dense, got):
        picks[m.index] = k
    for k in ("home", "duplicated", "gram"):
        stats[f"strategy.{k}"] = picks.count(k)
    _log(muon, picks)
    return Strategies({i: t for i, t in (gram_ok or {}).items() if picks[i] == "gram"} if grams else None,
                      frozenset(i for i, k in enumerate(picks) if k == "duplicated"), picks)


def _log(muon: list[MuonParam], picks: list[str]) -> None:
    if not logger.isEnabledFor(logging.INFO) or (dist.is_initialized() and dist.get_rank() != 0):
        return
    rows: dict[tuple[str, tuple[int, int], str], int] = {}
    for m, k in zip(muon, picks):
        key = (_pattern(m.name), tuple(m.full_shape), k)
        rows[key] = rows.get(key, 0) + 1
    w = max([len(k[0]) for k in rows] + [4])
    logger.info("OverlapMuon mode='auto' (name, count, full shape, NS strategy):\n%s",
                "\n".join(f"  {name:<{w}} x{n:<4} {shape} {k}" for (name, shape, k), n in rows.items()))
