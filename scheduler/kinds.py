"""Wave plans: each wave with everything about how it runs, decided once, at construction (pure planning).

A :class:`WavePlan` is frozen data: the wave (params, homes, domain), its exchange kind and the kind's settings.
The runtime builds one exchange per plan (``overlap_muon._exchanges``) and never decides a wave's kind later; every
rank computes the same plans from the same inputs, and the construction check hashes them
(:meth:`WavePlan.describe`).
"""

from __future__ import annotations

from collections.abc import Sequence
import dataclasses
from dataclasses import dataclass

from .surplus import SurplusCostModel, duplicate_homes, every_rank_kinds, team_splits_poly
from .waves import Wave

__all__ = ["WavePlan", "KINDS", "plan_kinds"]

#: The exchange kinds a plan can name (``overlap_muon._exchanges`` has one class per kind).
KINDS = ("routed", "gathered", "team", "dp_shared")


@dataclass(frozen=True)
class WavePlan:
    """How one wave runs. Replicated params of any wave are NS'd where they are (the ``local`` exchange)."""

    wave: Wave
    kind: str
    """One of :data:`KINDS`."""
    dup: tuple[tuple[int, tuple[int, ...], tuple[int, ...]], ...] = ()
    """``routed``: the params with several homes, ``(param, homes, serving home of each domain rank)``."""
    split_poly: tuple[tuple[int, bool], ...] = ()
    """``team``: per param, whether the team also splits ``b*A + c*A@A`` by rows."""
    dp_size: int = 1
    """``dp_shared``: the number of replicas sharing the wave (a param's replica is ``home % dp_size``, its home in
    that replica's domain ``home // dp_size``)."""
    gram_tall: tuple[tuple[int, bool], ...] = ()
    """``mode="gram"`` (or ``auto``'s Gram picks): the wave's params NS'd in Gram space over their blocks, each with
    whether its rows are split (its Gram is over its columns); the pipeline gives them a leg of their own
    (``_exchanges.Gram``)."""
    gathered: tuple[int, ...] = ()
    """``mode="auto"``'s duplicated picks in a ``routed`` wave: every rank gathers them and runs their NS (a leg of
    their own, ``_exchanges.Gathered``)."""

    def describe(self) -> tuple:
        """Everything about the plan as plain values, for the cross-rank hash."""
        w = self.wave
        return (w.index, w.domain, w.params, tuple(sorted(w.homes.items())), self.kind, self.dup, self.split_poly,
                self.dp_size, self.gram_tall, self.gathered)


def plan_kinds(
    waves: Sequence[Wave], shapes: Sequence[tuple[int, int]], domain_sizes: Sequence[int], *, mode: str,
    surplus: str, fused: bool, dp_size: int, no_team: set[int] | frozenset[int],
    cost_model: SurplusCostModel | None = None, gram_ok: dict[int, bool] | None = None,
    duplicated: frozenset[int] = frozenset(),
) -> list[WavePlan]:
    """One :class:`WavePlan` per wave.

    Args:
        waves: the waves (:func:`plan_waves` / :func:`plan_by_domain`).
        shapes: each Muon param's full ``(P, Q)``.
        domain_sizes: ``[dense S, expert S]``.
        mode: ``layer_sharded`` or ``duplicated`` (every wave ``gathered``).
        surplus: ``idle``, ``duplicate``, ``team`` or ``auto`` (``scheduler.surplus``): the waves whose surplus plan
            gives every matrix every rank of its domain are ``gathered`` (duplicate) or ``team``; with fused
            exchanges ``duplicate`` and ``auto`` also give some matrices several homes (``dup``).
        fused: fused exchanges (duplicate homes need them).
        dp_size: replicas sharing the dense domain's NS work (``dp_slots``; 1: none). Not combined with surplus.
        no_team: params that are never teamed (transposed or split matrices): a wave holding one is ``gathered``.
        cost_model: the machine figures of the surplus plan (``None``: ``SurplusCostModel()``'s).
        gram_ok: ``mode="gram"``: the params whose shards split only their long side, each with whether its rows
            are split: in a dense wave they are NS'd over their blocks (``gram_tall``), beside the wave's other
            params, which are planned as in ``layer_sharded``. ``mode="auto"``: its Gram picks.
        duplicated: ``mode="auto"``: its duplicated picks (``gathered`` in their dense waves).
    """
    if mode in ("gram", "auto"):
        plans = plan_kinds(waves, shapes, domain_sizes, mode="layer_sharded", surplus=surplus, fused=fused,
                           dp_size=dp_size, no_team=no_team, cost_model=cost_model)
        ok = gram_ok or {}
        return [dataclasses.replace(p, gram_tall=tuple((i, ok[i]) for i in p.wave.params if i in ok),
                                    gathered=tuple(i for i in p.wave.params if i in duplicated))
                if p.wave.domain == 0 else p for p in plans]
    if mode == "duplicated":
        return [WavePlan(w, "gathered") for w in waves]
    if dp_size > 1:
        return [WavePlan(w, "dp_shared", dp_size=dp_size) if w.domain == 0 else WavePlan(w, "routed") for w in waves]
    if surplus == "idle":
        return [WavePlan(w, "routed") for w in waves]
    dense, expert = domain_sizes
    kinds = every_rank_kinds(waves, shapes, [dense, 1], surplus, cost_model)
    if surplus != "team":  # expert waves are duplicated at most (they have no team group)
        kinds |= every_rank_kinds(waves, shapes, [1, expert], "duplicate", cost_model)
    dup = duplicate_homes(waves, shapes, [dense, expert], cost_model, skip=set(kinds)) \
        if surplus in ("duplicate", "auto") and fused else {}
    out = []
    for w in waves:
        if kinds.get(w.index) == "team" and not set(w.params) & set(no_team):
            split = tuple((i, team_splits_poly(tuple(shapes[i]), dense, cost_model)) for i in w.params)
            out.append(WavePlan(w, "team", split_poly=split))
        elif w.index in kinds:
            out.append(WavePlan(w, "gathered"))
        else:
            d = dup.get(w.index, {})
            out.append(WavePlan(w, "routed", dup=tuple((i, *d[i]) for i in sorted(d))))
    return out
