"""Waves: which Muon matrices are exchanged and orthogonalized together.

Planning (:func:`plan_waves`, by count, or :func:`plan_waves_by_cost`) is a pure function, identical on every rank.
Dispatch, the per-step state machine that launches the planned waves in order (:class:`WaveDispatcher`), and the
recorder of the gradient-ready order the plan is built from (:class:`ReadinessRecorder`) are in
``scheduler/dispatch.py``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

from .homes import _check_costs, _check_num_ranks, lpt_homes

__all__ = ["Wave", "plan_waves", "plan_by_domain", "WaveCostModel", "plan_waves_by_cost"]

_BALANCES = ("lpt", "round_robin")


@dataclass(frozen=True, slots=True)
class Wave:
    """One group of Muon matrices launched together (one exchange to homes, NS, one exchange back)."""

    index: int
    """Position in the step's launch order, 0-based."""
    params: tuple[int, ...]
    """Param indices in gradient-readiness order."""
    homes: dict[int, int]
    """Param index -> NS home rank in ``[0, num_ranks)``; keys are exactly ``params``."""
    domain: int = 0
    """Which domain's ranks the homes index: 0 the dense domain, 1 the expert domain (one wave, one domain)."""

    def __post_init__(self) -> None:
        if set(self.homes) != set(self.params) or len(set(self.params)) != len(self.params):
            raise ValueError(
                f"wave {self.index}: params {self.params} must be distinct and match the homes' keys "
                f"{sorted(self.homes)}"
            )


def _wave_sizes(n: int, slots: int, taper: bool) -> list[int]:
    """Sizes of consecutive waves over ``n`` params; see [Note: wave taper]."""
    if not taper:
        return [min(slots, n - s) for s in range(0, n, slots)]
    rev: list[int] = []
    left = n
    for cap in (max(1, slots // 4), max(1, slots // 2)):
        if left == 0:
            break
        rev.append(min(cap, left))
        left -= rev[-1]
    while left > 0:
        rev.append(min(slots, left))
        left -= rev[-1]
    return rev[::-1]


def plan_waves(
    order: Sequence[int],
    costs: Sequence[float],
    num_ranks: int,
    wave_slots: int | None = None,
    balance: str = "lpt",
    taper: bool = True,
    node_size: int | None = None,
) -> list[Wave]:
    """Cut the params, in gradient-ready order, into waves and give each param an NS home.

    [Note: wave taper] Backward makes gradients last-layer-first and the next forward needs the first layers
    first, so the last wave launched (the first layers) is awaited first and its exchange + NS + exchange is
    the one piece of optimizer time that cannot hide ([Note: the critical path] in docs/design.md). With
    ``taper=True`` the waves are cut from the END of ``order``: the last wave holds at most
    ``max(1, wave_slots // 4)`` params, the one before at most ``max(1, wave_slots // 2)``, every earlier wave
    ``wave_slots``; the first wave (launched earliest, with the most backward left to hide in) takes the
    remainder. E.g. 19 params, 8 slots: sizes ``[5, 8, 4, 2]``. With ``taper=False`` the cuts are plain:
    ``wave_slots`` each from the front, the last wave takes the remainder (``[8, 8, 3]``).

    Homes: ``balance="lpt"`` runs :func:`scheduler.homes.lpt_homes` inside each wave, starting from the
    per-rank loads of all earlier waves, so the step's total NS work is balanced as well as each wave's.
    ``balance="round_robin"`` gives the k-th param of ``order`` home ``k % num_ranks`` (continuing across
    waves).

    Args:
        order: a permutation of ``range(len(costs))``, first-ready first (for backward without DDP buckets
            usually reverse registration order; the caller decides, e.g. from a
            :class:`ReadinessRecorder` broadcast from rank 0).
        costs: per-param NS cost (e.g. FLOPs from :func:`scheduler.cost.ns_flops`), finite, >= 0.
        num_ranks: number of NS home ranks (the weight-shard domain size), >= 1.
        wave_slots: max params per wave, >= 1; ``None`` means ``num_ranks``.
        balance: ``"lpt"`` or ``"round_robin"``.
        taper: shrink the last two waves, see above.
        node_size: LPT's ties go to the least-loaded node ([Note: homes that know nodes] in ``homes.py``).

    Returns:
        The waves in launch order; ``waves[k].index == k``. Empty when there are no params.

    Raises:
        ValueError: ``order`` is not a permutation of ``range(len(costs))``, a cost is negative or not
            finite, ``num_ranks < 1``, ``wave_slots < 1`` or ``balance`` is unknown.
    """
    _check_num_ranks(num_ranks)
    costs = _check_costs(costs)
    if wave_slots is None:
        wave_slots = num_ranks
    if not isinstance(wave_slots, int) or isinstance(wave_slots, bool) or wave_slots < 1:
        raise ValueError(f"wave_slots must be an int >= 1, got {wave_slots!r}")
    if balance not in _BALANCES:
        raise ValueError(f"balance must be one of {_BALANCES}, got {balance!r}")
    order = list(order)
    if sorted(order) != list(range(len(costs))):
        raise ValueError(
            f"order must be a permutation of range({len(costs)}) (one entry per param), got {len(order)} "
            f"entries {order[:16]}{'...' if len(order) > 16 else ''}"
        )

    return _assign_homes(order, _wave_sizes(len(order), wave_slots, taper), costs, num_ranks, balance, node_size)


def _assign_homes(order: list[int], sizes: Sequence[int], costs: Sequence[float], num_ranks: int,
                  balance: str, node_size: int | None = None) -> list[Wave]:
    """Cut ``order`` into consecutive waves of ``sizes`` and give homes (see :func:`plan_waves`, "Homes")."""
    waves: list[Wave] = []
    loads = [0.0] * num_ranks
    pos = 0
    for k, size in enumerate(sizes):
        params = tuple(order[pos : pos + size])
        if balance == "lpt":
            local = lpt_homes([costs[i] for i in params], num_ranks, initial_loads=loads, node_size=node_size)
        else:
            local = [(pos + j) % num_ranks for j in range(size)]
        for i, h in zip(params, local):
            loads[h] += costs[i]
        waves.append(Wave(index=k, params=params, homes=dict(zip(params, local))))
        pos += size
    return waves


def plan_by_domain(
    order: Sequence[int],
    domain_of: Sequence[int],
    plan_one: Callable[[list[int], list[int], int], list[Wave]],
) -> list[Wave]:
    """One launch order for params routed on several domains (dense and expert: [Note: two domains] in
    ``overlap_muon/_discovery.py``).

    Each domain's params are planned on their own by ``plan_one(sub_order, members, domain)``, where ``members``
    lists the domain's param indices (ascending) and ``sub_order`` is their readiness order as positions in
    ``members``; it returns waves over those positions (homes in that domain's ranks). The waves are mapped back to
    param indices, tagged with their domain and merged by readiness: a wave goes where its last param becomes
    ready in ``order`` (ties: lower domain first), which keeps each domain's own order. Deterministic, so every
    rank merges the same way.

    Returns:
        The merged waves, re-indexed ``0 .. n-1`` in launch order.
    """
    pos = {i: k for k, i in enumerate(order)}
    merged: list[tuple[tuple[int, int, int], Wave]] = []
    for d in sorted(set(domain_of)):
        members = [i for i in range(len(domain_of)) if domain_of[i] == d]
        local = {i: k for k, i in enumerate(members)}
        for k, w in enumerate(plan_one([local[i] for i in order if domain_of[i] == d], members, d)):
            params = tuple(members[j] for j in w.params)
            wave = Wave(index=0, params=params, homes={members[j]: h for j, h in w.homes.items()}, domain=d)
            merged.append(((max(pos[i] for i in params), d, k), wave))
    merged.sort(key=lambda kw: kw[0])
    return [Wave(index=k, params=w.params, homes=w.homes, domain=w.domain) for k, (_, w) in enumerate(merged)]


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveCostModel:
    """What one wave costs on the lanes, for :func:`plan_waves_by_cost`. See [Note: planning waves by cost].

    The defaults are figures of one CPU core of the machine this was written on (torch 2.13, 1 intra-op thread,
    bf16 NS: ``(256, 256)`` at ~400 GFLOP/s unbatched, ~500 batched; a small zeropower call ~0.1-0.5 ms; a
    gloo all_to_all on loopback ~0.1-0.2 ms). Pass measured figures for other hardware.
    """

    ns_flops_per_s: float = 4e11
    """NS FLOP rate of one home (FLOP/s), the ``scheduler.cost.ns_flops`` count over seconds."""
    ns_call_s: float = 3e-4
    """Fixed seconds of one zeropower call on a home, whatever its batch size (host dispatch, ~20 kernel
    launches, the per-call part of small-matrix inefficiency): what batching same-shape matrices saves."""
    wave_s: float = 5e-4
    """Fixed seconds of one wave (hand-offs between the three lanes, the latency of its exchanges and of the
    gradient-presence check): what fewer waves save."""
    link_bytes_per_s: float = 1e10
    """Bytes per second leaving one rank in an all_to_all (ignored on a one-rank domain)."""
    backward_s: float | None = None
    """Seconds of backward over the Muon matrices, used only when :func:`plan_waves_by_cost` gets no
    ``ready_s``: gradients are then taken to arrive in ``order`` at times proportional to the cumulative matrix
    size (a linear layer's backward FLOPs are ``4 * tokens * P * Q``). ``None``: twice the step's unbatched NS
    work per home (``2 * sum(ns time) / num_ranks``), a guess: the optimizer a third of forward + backward +
    optimizer, as in the bench's ``overlap`` case at world 1 (forward + backward 306 ms, optimizer 152 ms).
    Measured ready times (``ready_s``) are better."""

    def __post_init__(self) -> None:
        for name in ("ns_flops_per_s", "link_bytes_per_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v > 0):
                raise ValueError(f"WaveCostModel.{name} must be > 0, got {v!r}")
        for name in ("ns_call_s", "wave_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"WaveCostModel.{name} must be a finite number >= 0 seconds, got {v!r}")
        if self.backward_s is not None and not (
            isinstance(self.backward_s, (int, float)) and math.isfinite(self.backward_s) and self.backward_s >= 0
        ):
            raise ValueError(f"WaveCostModel.backward_s must be None or >= 0 seconds, got {self.backward_s!r}")


class _Segment:
    """Running figures of a wave grown one param at a time (its first param moving earlier in ``order``)."""

    __slots__ = ("flops", "max_flops", "nbytes", "counts", "spread", "size")

    def __init__(self) -> None:
        self.flops = self.max_flops = 0.0
        self.nbytes = 0
        self.counts: dict[tuple[int, int], int] = {}
        self.spread = 0  # sum over shapes of min(count, num_ranks): homes x shapes holding a batch
        self.size = 0

    def add(self, cost: float, shape: tuple[int, int], num_ranks: int) -> None:
        self.flops += cost
        self.max_flops = max(self.max_flops, cost)
        self.nbytes += 2 * shape[0] * shape[1]
        c = self.counts.get(shape, 0) + 1
        self.counts[shape] = c
        if c <= num_ranks:
            self.spread += 1
        self.size += 1

    def seconds(self, m: WaveCostModel, num_ranks: int) -> float:
        """Estimated lane seconds of this wave: ``wave_s`` + the busiest home's NS + the exchange."""
        S = num_ranks
        calls = -(-self.spread // S)  # the busiest home's zeropower calls, one per shape it holds
        ns = max(self.max_flops / m.ns_flops_per_s + m.ns_call_s,
                 self.flops / (S * m.ns_flops_per_s) + calls * m.ns_call_s)
        # Each rank's shards (1/S of the wave's bf16 bytes) leave once and come back once: 2 (1 - 1/S) shard.
        exch = 0.0 if S == 1 else 2 * (1 - 1 / S) * self.nbytes / S / m.link_bytes_per_s
        return m.wave_s + ns + exch


def _finish(sizes: Sequence[int], work: Sequence[float], ready_end: Sequence[float]) -> float:
    """Finish time of the last wave: waves run one after another on the lanes, each starting when its last
    gradient is ready (``ready_end[k]``) and the previous wave is done."""
    t = 0.0
    for w, r in zip(work, ready_end):
        t = max(t, r) + w
    return t


def plan_waves_by_cost(
    order: Sequence[int],
    costs: Sequence[float],
    shapes: Sequence[tuple[int, int]],
    num_ranks: int,
    model: WaveCostModel | None = None,
    *,
    ready_s: Sequence[float] | None = None,
    balance: str = "lpt",
    max_wave_params: int | None = None,
    node_size: int | None = None,
) -> list[Wave]:
    """Cut the params, in gradient-ready order, into waves sized by cost (not by count) and give each an NS home.

    [Note: planning waves by cost] :func:`plan_waves` cuts ``wave_slots`` params per wave. In overlap mode the
    default is one param per home, so on one rank every matrix is its own wave: nothing batches, and each wave
    pays its fixed cost. Here a wave is a run of consecutive params of ``order`` whose estimated lane time
    (:class:`WaveCostModel`: ``wave_s`` + the busiest home's NS, ``ns_call_s`` per zeropower call with
    same-shape matrices of a home batched into one call, + the exchange) is weighed against its later launch (a
    wave starts when its last gradient is ready). Waves run one after another on the lanes, so the last wave,
    the one holding the first layers, which the next forward awaits first, finishes at
    ``F = max(ready, F_prev) + work``. The plan is:

    1. the cut that minimizes that finish time ``F`` (dynamic programming over cut points, each wave at most
       ``max_wave_params`` params), then
    2. from the front, adjacent waves merged while the merge does not delay ``F`` and the merged wave still
       finishes before the last gradient is ready (fewer waves and NS calls for the same critical path: a wave
       with slack inside backward batches for free; work is never moved past the end of backward).

    Taper ([Note: wave taper]) is a consequence, not a rule: the last wave starts at the end of backward and all
    its time is exposed, so step 1 keeps it as small as its fixed costs allow, while early waves, which have
    backward left to hide in, grow until the batching gain is used up. With a negligible per-call and per-wave
    cost the plan is one matrix per wave; with a large one it is a few large waves.

    What the model leaves out: it runs waves strictly one after another (exchange, NS, exchange summed),
    whereas the runtime's lanes pipeline them (wave k+1's exchange to the homes overlaps wave k's NS). It is
    therefore pessimistic about many waves, most where a wave's NS is one matrix per home (domains at least as
    large as the waves): there it prefers a few large waves (e.g. 560 Llama-3-70B matrices on 512 homes: two
    waves). ``overlap_muon.apps.simulate`` has the finer lane model; planning against it is the next step.

    Homes are then given exactly as :func:`plan_waves` does (LPT inside each wave with loads carried across
    waves, or round robin). The estimate of a wave's NS time assumes LPT spreads each shape over
    ``min(count, num_ranks)`` homes; the actual homes come from that assignment.

    Args:
        order: a permutation of ``range(len(costs))``, first-ready first (as for :func:`plan_waves`).
        costs: per-param NS FLOPs (:func:`scheduler.cost.ns_flops` of the full shape), finite, >= 0.
        shapes: per-param full logical ``(P, Q)`` shape (same-shape params of a home batch into one NS call;
            the bytes of the exchange are ``2 * P * Q``, bf16).
        num_ranks: number of NS home ranks (the weight-shard domain size), >= 1.
        model: the cost figures; ``None`` takes :class:`WaveCostModel`'s defaults.
        ready_s: per-param seconds from the start of backward at which its gradient is ready (indexed by param,
            like ``costs``), finite and >= 0; ``None`` derives them from ``model.backward_s`` (see there).
        balance: ``"lpt"`` or ``"round_robin"`` (homes, as in :func:`plan_waves`).
        max_wave_params: at most this many params per wave, >= 1; ``None`` means ``max(64, 8 * num_ranks)``
            (bounds the planning time: ``O(len(order) * max_wave_params)``).
        node_size: as for :func:`plan_waves`.

    Returns:
        The waves in launch order; ``waves[k].index == k``; their params, concatenated, are ``order``. Empty
        when there are no params. Deterministic: every rank computes the same plan from the same inputs.

    Raises:
        ValueError: ``order`` is not a permutation of ``range(len(costs))``, ``shapes`` or ``ready_s`` has the
            wrong length or a bad entry, a cost is negative or not finite, ``num_ranks < 1``,
            ``max_wave_params < 1`` or ``balance`` is unknown.
    """
    _check_num_ranks(num_ranks)
    costs = _check_costs(costs)
    n = len(costs)
    if balance not in _BALANCES:
        raise ValueError(f"balance must be one of {_BALANCES}, got {balance!r}")
    order = list(order)
    if sorted(order) != list(range(n)):
        raise ValueError(
            f"order must be a permutation of range({n}) (one entry per param), got {len(order)} entries "
            f"{order[:16]}{'...' if len(order) > 16 else ''}"
        )
    if len(shapes) != n:
        raise ValueError(f"shapes has {len(shapes)} entries, expected one per param ({n})")
    shp: list[tuple[int, int]] = []
    for i, sh in enumerate(shapes):
        if (len(sh) != 2 or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in sh)):
            raise ValueError(f"shape of param {i} is {sh!r}; expected a (P, Q) pair of ints >= 0")
        shp.append((int(sh[0]), int(sh[1])))
    if max_wave_params is None:
        max_wave_params = max(64, 8 * num_ranks)
    if not isinstance(max_wave_params, int) or isinstance(max_wave_params, bool) or max_wave_params < 1:
        raise ValueError(f"max_wave_params must be an int >= 1, got {max_wave_params!r}")
    m = model if model is not None else WaveCostModel()
    if n == 0:
        return []

    if ready_s is not None:
        if len(ready_s) != n:
            raise ValueError(f"ready_s has {len(ready_s)} entries, expected one per param ({n})")
        for i, r in enumerate(ready_s):
            if isinstance(r, bool) or not isinstance(r, (int, float)) or not math.isfinite(r) or r < 0:
                raise ValueError(f"ready_s of param {i} is {r!r}; expected finite seconds >= 0")
        ready = [float(ready_s[i]) for i in order]
    else:
        bwd = m.backward_s
        if bwd is None:
            bwd = 2 * sum(c / m.ns_flops_per_s + m.ns_call_s for c in costs) / num_ranks
        sizes = [shp[i][0] * shp[i][1] for i in order]
        total = sum(sizes) or 1
        ready, acc = [], 0
        for z in sizes:
            acc += z
            ready.append(bwd * acc / total)
    # A wave launches once all its gradients are ready: the running max over the order.
    for k in range(1, n):
        ready[k] = max(ready[k], ready[k - 1])

    # 1. best[j]: the earliest finish of the first j params of `order` cut into waves.
    cap = max_wave_params
    best = [0.0] + [math.inf] * n
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        seg = _Segment()
        for i in range(j - 1, max(0, j - cap) - 1, -1):
            p = order[i]
            seg.add(costs[p], shp[p], num_ranks)
            f = max(ready[j - 1], best[i]) + seg.seconds(m, num_ranks)
            if f < best[j]:  # strict: among equal finishes the shortest last wave (taper) wins
                best[j], cut[j] = f, i
    bounds = [n]
    while bounds[-1] > 0:
        bounds.append(cut[bounds[-1]])
    bounds.reverse()  # 0 = b0 < b1 < ... < bW = n

    def work_of(lo: int, hi: int) -> float:
        seg = _Segment()
        for q in range(lo, hi):
            seg.add(costs[order[q]], shp[order[q]], num_ranks)
        return seg.seconds(m, num_ranks)

    # 2. Merge adjacent waves, front to back, while the last wave's finish does not move and the merged wave
    #    still ends within backward (before the last gradient is ready): its batching is then free. A merge that
    #    pushes work past the end of backward is refused even when the model's finish does not move, so the
    #    model's ties never turn into a large last wave.
    target = best[n] * (1 + 1e-9)
    end_of_backward = ready[n - 1]
    k = 0
    while k + 2 < len(bounds):
        lo, hi = bounds[k], bounds[k + 2]
        if hi - lo <= cap:
            trial = bounds[: k + 1] + bounds[k + 2 :]
            works = [work_of(a, b) for a, b in zip(trial, trial[1:])]
            ends = [ready[b - 1] for b in trial[1:]]
            t = 0.0
            merged_finish = math.inf
            for w_idx, (w, r) in enumerate(zip(works, ends)):
                t = max(t, r) + w
                if w_idx == k:
                    merged_finish = t
            if t <= target and merged_finish <= end_of_backward:
                bounds = trial
                continue
        k += 1
    sizes_out = [b - a for a, b in zip(bounds, bounds[1:])]
    return _assign_homes(order, sizes_out, costs, num_ranks, balance, node_size)
