"""A deterministic hash of the wave plan, to check at construction that every rank planned the same exchanges.

Every rank computes its plan locally (:func:`scheduler.plan_waves`); ranks that disagree (a different model, a
param missing on one rank, a different order or option) would post mismatched all_to_alls and wait until the
timeout. [Note: checking the plan across ranks] The check has two parts, both pure here; the runtime adds the
collectives:

1. :func:`param_fingerprints` gives one 63-bit integer per Muon param from what the exchanges depend on: its
   name, full logical shape, TP ``partition_dim``, wave, position in the wave and NS home. :func:`plan_hash`
   folds them (and any ``extra`` settings) into one 63-bit integer. Ranks all-gather that one int64 (one
   small collective at construction); equal hashes end the check.
2. Only when they differ: ranks all-gather their fingerprint lists (``all_gather_object``: the lists may
   differ in length) and :func:`first_plan_difference` names the first param whose fingerprint differs and the
   ranks that differ from rank 0, so every rank raises the same clear error.

Hashes use SHA-256 of a canonical text (Python's ``hash()`` of a str is salted per process, so it differs
across ranks by design and cannot be used). torchtitan's FlexShard does step 1 per bucket
(``_validate_bucket_plans_across_ranks``) but reports only that the plans differ; step 2 is what names the
param.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

from .waves import Wave

__all__ = ["param_fingerprints", "plan_hash", "first_plan_difference", "PlanDifference"]

_MASK63 = (1 << 63) - 1


def _digest63(text: str) -> int:
    """The first 8 bytes of SHA-256 of ``text`` (UTF-8), little-endian, top bit cleared: an int in
    ``[0, 2**63)`` that fits a non-negative int64."""
    return int.from_bytes(hashlib.sha256(text.encode("utf-8")).digest()[:8], "little") & _MASK63


def param_fingerprints(
    names: Sequence[str],
    shapes: Sequence[Sequence[int]],
    partition_dims: Sequence[int | None],
    waves: Sequence[Wave],
) -> list[int]:
    """One 63-bit fingerprint per Muon param (indexed like ``names``).

    Each is :func:`_digest63` of ``repr((name, (P, Q), partition_dim, wave index, position in the wave,
    home))``: equal on two ranks exactly when those agree (up to SHA-256 collisions).

    Args:
        names: per-param name (e.g. the FQN from ``named_parameters()``).
        shapes: per-param full logical ``(P, Q)`` shape (ints).
        partition_dims: per-param TP ``partition_dim``: ``0``, ``1`` or ``None``.
        waves: the plan; every param index ``0 .. len(names)-1`` in exactly one wave.

    Returns:
        ``len(names)`` ints in ``[0, 2**63)``.

    Raises:
        ValueError: the lengths of ``names``, ``shapes`` and ``partition_dims`` differ, a shape is not two
            non-negative ints, a ``partition_dim`` is not 0, 1 or None, or the waves do not hold every param
            exactly once.
    """
    n = len(names)
    if len(shapes) != n or len(partition_dims) != n:
        raise ValueError(
            f"names, shapes and partition_dims must have one entry per param; got {n}, {len(shapes)}, "
            f"{len(partition_dims)}"
        )
    where: dict[int, tuple[int, int, int]] = {}
    for w in waves:
        for pos, i in enumerate(w.params):
            if not (isinstance(i, int) and 0 <= i < n):
                raise ValueError(f"wave {w.index} holds param {i!r}, not in [0, {n})")
            if i in where:
                raise ValueError(f"param {i} ({names[i]!r}) is in wave {where[i][0]} and wave {w.index}")
            where[i] = (w.index, pos, w.homes[i])
    missing = [names[i] for i in range(n) if i not in where]
    if missing:
        raise ValueError(f"params {missing[:8]} are in no wave")
    out = []
    for i in range(n):
        shape = tuple(shapes[i])
        if len(shape) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise ValueError(f"param {names[i]!r} has shape {shape!r}; expected a full (P, Q) pair of ints >= 0")
        pd = partition_dims[i]
        if pd not in (0, 1, None) or isinstance(pd, bool):
            raise ValueError(f"param {names[i]!r} has partition_dim={pd!r}; expected 0, 1 or None")
        wave, pos, home = where[i]
        out.append(_digest63(repr((str(names[i]), shape, pd, wave, pos, home))))
    return out


def plan_hash(fingerprints: Sequence[int], extra: Sequence[Any] = ()) -> int:
    """One 63-bit hash of a whole plan: the param count, every fingerprint in order, and ``extra``.

    Args:
        fingerprints: from :func:`param_fingerprints`.
        extra: settings every rank must share that the per-param fingerprints do not cover (e.g. the domain
            size ``(R, T)``, ``mode``, ``fused_a2a``, ``ns_steps``); their ``repr`` must be deterministic across
            processes (ints, floats, strs, bools, None and tuples of those are).

    Returns:
        An int in ``[0, 2**63)``, ready for an int64 tensor.
    """
    return _digest63(repr((len(fingerprints), tuple(int(f) for f in fingerprints), tuple(extra))))


class PlanDifference(tuple):
    """``(index, name, ranks)``: the first param index whose fingerprint differs, its name (rank 0's, or where
    rank 0 has no param at that index, the first differing rank's), and the ranks that differ from rank 0 there.
    """

    __slots__ = ()

    @property
    def index(self) -> int:
        return self[0]

    @property
    def name(self) -> str:
        return self[1]

    @property
    def ranks(self) -> tuple[int, ...]:
        return self[2]

    def message(self, what: str = "OverlapMuon") -> str:
        """The error text every rank raises."""
        return (
            f"{what}: the wave plan differs across ranks, first at Muon param #{self.index} {self.name!r} "
            f"(ranks {list(self.ranks)} differ from rank 0 there: name, full shape, partition_dim, wave or "
            "home). Every rank must build the same model (same Muon params, names and shapes, in the same "
            "order) and pass the same optimizer settings; under pipeline parallelism every rank of a stage "
            "(pass pp_group=, or a device_mesh with a 'pp' dim, so that each stage is checked on its own)."
        )


def first_plan_difference(
    fingerprints_by_rank: Sequence[Sequence[int]],
    names_by_rank: Sequence[Sequence[str]],
) -> PlanDifference | None:
    """The first param at which some rank's plan differs from rank 0's, or ``None`` when all agree.

    Args:
        fingerprints_by_rank: every rank's :func:`param_fingerprints`, indexed by rank (lists may differ in
            length: a rank with fewer params differs at the first index it lacks).
        names_by_rank: every rank's param names, same shape as ``fingerprints_by_rank`` (the name reported is
            rank 0's at the index, or, where rank 0 has none, the first differing rank's).

    Returns:
        A :class:`PlanDifference`, or ``None``.

    Raises:
        ValueError: no ranks, or a rank's names and fingerprints differ in length.
    """
    if not fingerprints_by_rank or len(fingerprints_by_rank) != len(names_by_rank):
        raise ValueError(
            f"need one fingerprint list and one name list per rank; got {len(fingerprints_by_rank)} and "
            f"{len(names_by_rank)}"
        )
    for r, (f, nm) in enumerate(zip(fingerprints_by_rank, names_by_rank)):
        if len(f) != len(nm):
            raise ValueError(f"rank {r} has {len(f)} fingerprints but {len(nm)} names")
    ref = fingerprints_by_rank[0]
    longest = max(len(f) for f in fingerprints_by_rank)
    for i in range(longest):
        mine = ref[i] if i < len(ref) else None
        ranks = tuple(r for r, f in enumerate(fingerprints_by_rank) if (f[i] if i < len(f) else None) != mine)
        if ranks:
            if i < len(names_by_rank[0]):
                name = names_by_rank[0][i]
            else:
                name = names_by_rank[ranks[0]][i]
            return PlanDifference((i, name, ranks))
    return None
