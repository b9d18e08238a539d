"""The event model: the waves' lane work, run against backward (overlap) or after it, and the plan it runs."""

from __future__ import annotations

import dataclasses
import math
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

from .config import SimConfig
from .exchange import _a2a_s, _exchange_pair_s
from .shapes import _APPLY_BYTES, _EPS, _PACK_BYTES, _WIRE_BYTES



# ----------------------------------------------------------------------------------------------------------
# The event model


@dataclass(frozen=True, slots=True)
class _WaveTimes:
    """One wave of the library's plan (``scheduler.Wave``: its params and homes, as ``plan_waves`` cuts them) with
    the times the model gives its lanes."""

    wave: Any
    ns_work: tuple[float, ...]  # per home, seconds at full speed
    to_home_s: float
    from_home_s: float
    launch_layer: int  # launched once backward has reached (finished) this layer
    first_layer: int
    last_layer: int


@dataclass(slots=True)
class _RunOut:
    end_s: float = 0.0
    wait_s: float = 0.0
    launch: list[float] = dataclasses.field(default_factory=list)
    to_end: list[float] = dataclasses.field(default_factory=list)
    ns_end: list[float] = dataclasses.field(default_factory=list)
    applied: list[float] = dataclasses.field(default_factory=list)


def _lane_work(plans: list[_WaveTimes], num_homes: int) -> list[list[float]]:
    """Per wave, the NS work of each simulated lane: every home with work in some wave, then one idle home (if
    any) for all the others."""
    busy = sorted({r for p in plans for r, w in enumerate(p.ns_work) if w > 0})
    idle = [0.0] if len(busy) < num_homes else []
    return [[p.ns_work[r] for r in busy] + idle for p in plans]


def _run(cfg: SimConfig, plans: list[_WaveTimes], overlap: bool, barrier: bool = False) -> _RunOut:
    """Simulate the last backward and the next forward; see [Note: what the model assumes], items 7-9.

    ``overlap``: waves launch during backward (else after it). ``barrier`` (the runtime's default step): the
    next forward's first layer waits for every wave (on a GPU a stream wait: the compute stream idles, the host
    does not), else each layer waits only for its own waves (``async_step``)."""
    # One main lane and one NS lane per GPU of the ``dp_slots`` replicas that share the NS work (all lock-step).
    # GPUs that home no NS in any wave all run alike: one lane stands for them all (at thousands of ranks,
    # most of them), the results are the same.
    work = _lane_work(plans, cfg.ns_slots)
    L, S, K = len(cfg.layer_shapes), len(work[0]) if work else 1, len(plans)
    tasks = [("backward", l, cfg.layer_backward_s[l]) for l in reversed(range(L))]
    tasks += [("forward", l, cfg.layer_forward_s[l]) for l in range(L)]
    waves_of_layer: list[set[int]] = [set() for _ in range(L)]
    layer_of = [l for l, layer in enumerate(cfg.layer_shapes) for _ in layer]
    for k, p in enumerate(plans):
        for i in p.wave.params:
            waves_of_layer[layer_of[i]].add(k)
    shared = 1.0 / (1.0 + cfg.ns_interference)

    out = _RunOut(launch=[math.nan] * K, to_end=[math.nan] * K, ns_end=[math.nan] * K, applied=[math.nan] * K)
    t = 0.0
    main_i = 0
    main_rem: list[float] | None = None
    blocked_since: float | None = None
    bwd_reached = L  # lowest layer whose backward has finished (L: none yet)
    next_launch = 0
    comm: tuple[str, int, float] | None = None  # (kind, wave, end time); comm items are never slowed
    comm_q: deque[tuple[str, int]] = deque()  # ready items, first-ready-first-served
    ns_q: list[deque[tuple[int, float]]] = [deque() for _ in range(S)]
    ns_cur: list[list[float] | None] = [None] * S  # [wave, remaining work]
    ns_left = [0] * K  # homes still running wave k's NS

    while True:
        # Start everything that can start now.
        while next_launch < K and (
            (overlap and bwd_reached <= plans[next_launch].launch_layer) or (not overlap and main_i >= L)
        ):
            out.launch[next_launch] = t
            comm_q.append(("to", next_launch))
            next_launch += 1
        if comm is None and comm_q:
            kind, k = comm_q.popleft()
            comm = (kind, k, t + (plans[k].to_home_s if kind == "to" else plans[k].from_home_s))
        for r in range(S):
            if ns_cur[r] is None and ns_q[r]:
                k, w = ns_q[r].popleft()
                ns_cur[r] = [k, w]
        if main_rem is None and main_i < len(tasks):
            kind, l, w = tasks[main_i]
            gate = waves_of_layer[l] if overlap and not barrier else range(K)
            if kind == "forward" and any(math.isnan(out.applied[k]) for k in gate):
                if blocked_since is None:
                    blocked_since = t
            else:
                if blocked_since is not None:
                    out.wait_s += t - blocked_since
                    blocked_since = None
                main_rem = [w] * S

        # The next event.
        main_busy = [main_rem is not None and main_rem[r] > _EPS for r in range(S)]
        dt = math.inf
        if main_rem is not None and not any(main_busy):
            dt = 0.0  # a zero-length layer: complete it now
        if comm is not None:
            dt = comm[2] - t
        for r in range(S):
            ns_busy = ns_cur[r] is not None
            if main_busy[r]:
                dt = min(dt, main_rem[r] / (shared if ns_busy else 1.0))
            if ns_busy:
                dt = min(dt, ns_cur[r][1] / (shared if main_busy[r] else 1.0))
        if dt == math.inf:
            if main_i < len(tasks):  # cannot happen with a consistent plan; fail loudly rather than hang
                raise RuntimeError(f"simulation stalled at t={t:.6f}s before task {tasks[main_i]}")
            break
        dt = max(dt, 0.0)

        # Advance.
        t += dt
        for r in range(S):
            ns_busy = ns_cur[r] is not None
            if main_busy[r]:
                main_rem[r] -= dt * (shared if ns_busy else 1.0)
            if ns_busy:
                ns_cur[r][1] -= dt * (shared if main_busy[r] else 1.0)

        # Completions.
        if comm is not None and comm[2] - t <= _EPS:
            kind, k, _ = comm
            comm = None
            if kind == "to":
                out.to_end[k] = t
                for r, w in enumerate(work[k]):
                    if w > 0:
                        ns_q[r].append((k, w))
                        ns_left[k] += 1
                if ns_left[k] == 0:
                    out.ns_end[k] = t
                    comm_q.append(("from", k))
            else:
                out.applied[k] = t
        finished = []
        for r in range(S):
            if ns_cur[r] is not None and ns_cur[r][1] <= _EPS:
                k = int(ns_cur[r][0])
                ns_cur[r] = None
                ns_left[k] -= 1
                if ns_left[k] == 0:
                    finished.append(k)
        for k in sorted(finished):
            out.ns_end[k] = t
            comm_q.append(("from", k))
        if main_rem is not None and all(x <= _EPS for x in main_rem):
            kind, l, _ = tasks[main_i]
            if kind == "backward":
                bwd_reached = l
            main_i += 1
            main_rem = None
            if main_i == len(tasks):
                out.end_s = t
    return out


def _surplus_cost_model(cfg: SimConfig) -> Any:
    from ..._scheduler.surplus import SurplusCostModel

    return SurplusCostModel(ns_flops_per_s=cfg.ns_flops_per_s, ns_steps=cfg.ns_steps,
                            intra_node_bytes_per_s=cfg.intra_node_bytes_per_s,
                            inter_node_bytes_per_s=cfg.inter_node_bytes_per_s, ranks_per_node=cfg.gpus_per_node,
                            latency_s=cfg.collective_latency_s, team_efficiency=cfg.team_efficiency,
                            dtype_bytes=_WIRE_BYTES)


def _flows_s(cfg: SimConfig, assignments: Sequence[Any], shapes: Sequence[tuple[int, int]]) -> tuple[float, float, float]:
    """Both exchanges of one replica's wave under a surplus plan: ``(to_home_s, from_home_s, bytes sent per rank)``.

    Every flow of [Note: surplus and DP slots in the model] is added to its sender's and receiver's intra- or
    inter-node bytes; a direction takes ``latency + max`` over ranks and directions of ``bytes / bandwidth``.
    """
    from ..._scheduler.surplus import _dup_served, _Nodes

    S = cfg.domain_size
    nodes = _Nodes(S, cfg.gpus_per_node)
    node = [nodes.node(r) for r in range(S)]

    def new() -> list[list[float]]:
        return [[0.0] * S for _ in range(4)]  # send intra, send inter, recv intra, recv inter

    to, back = new(), new()

    def flow(acc: list[list[float]], src: int, dst: int, b: float) -> None:
        same = node[src] == node[dst]
        acc[0 if same else 1][src] += b
        acc[2 if same else 3][dst] += b

    sent = 0.0
    for a, shape in zip(assignments, shapes):
        shard = shape[0] * shape[1] * _WIRE_BYTES / S
        k = len(a.ranks)
        part = shard / k if a.kind == "team" else shard
        for h in a.ranks:
            for r in range(S):
                if r != h:
                    flow(to, r, h, part)
                    sent += part
        if a.kind == "duplicate":
            for h, served in zip(a.ranks, _dup_served(a.ranks, nodes)):
                for r in served:
                    flow(back, h, r, shard)
        else:
            for h in a.ranks:
                for r in range(S):
                    if r != h:
                        flow(back, h, r, part)

    def t(acc: list[list[float]]) -> float:
        worst = 0.0
        for r in range(S):
            worst = max(worst, acc[0][r] / cfg.intra_node_bytes_per_s, acc[1][r] / cfg.inter_node_bytes_per_s,
                        acc[2][r] / cfg.intra_node_bytes_per_s, acc[3][r] / cfg.inter_node_bytes_per_s)
        return cfg.collective_latency_s + worst if worst > 0 else 0.0

    return t(to), t(back), sent / S


def _plan(cfg: SimConfig) -> tuple[list[Any], list[float], list[_WaveTimes], float]:
    """Waves, per-matrix NS seconds, per-wave lane items, and the bf16 bytes a rank sends to homes per step."""
    from ..._scheduler.cost import ns_flops
    from ..._scheduler.surplus import _estimate_parts, _Nodes, plan_surplus
    from ..._scheduler.waves import plan_waves

    shapes = [s for layer in cfg.layer_shapes for s in layer]
    layer_of = [l for l, layer in enumerate(cfg.layer_shapes) for _ in layer]
    S, D = cfg.domain_size, cfg.dp_slots
    H = S * D
    ns_s = [ns_flops(s, cfg.ns_steps) / cfg.ns_flops_per_s for s in shapes]
    # Backward makes gradients last-layer-first; inside a layer, reverse registration order.
    order = list(range(len(shapes) - 1, -1, -1))
    # DP slots add homes, not wave size: a wave still holds at most S matrices by default.
    node_size = cfg.ranks_per_node if cfg.uses_node_homes else None
    waves = plan_waves(order, ns_s, H, wave_slots=cfg.wave_slots or S, balance=cfg.balance, taper=cfg.taper,
                       node_size=node_size)
    cm = _surplus_cost_model(cfg)
    prev_work = [0.0] * H
    nodes = _Nodes(S, cfg.gpus_per_node)
    plans = []
    sent_total = 0.0
    for w in waves:
        work = [0.0] * H
        ex_to = ex_back = 0.0
        own = [0.0] * D  # per replica: shard bytes of the matrices it orthogonalizes
        for d in range(D):
            params = [i for i in w.params if w.homes[i] // S == d]
            homes = {i: w.homes[i] % S for i in params}
            shard_bytes = [shapes[i][0] * shapes[i][1] * _WIRE_BYTES / S for i in params]
            own[d] = sum(shard_bytes)
            if cfg.surplus == "idle" or not params:
                for i in params:
                    work[d * S + homes[i]] += ns_s[i]
                if params:
                    to_s, back_s = _exchange_pair_s(cfg, shard_bytes, [homes[i] for i in params])
                    ex_to, ex_back = max(ex_to, to_s), max(ex_back, back_s)
                sent_total += sum(b * (1 - 1 / S) for b in shard_bytes) / D
                continue
            # The previous wave's NS may still run on this wave's surplus ranks: plan around it.
            plan = plan_surplus(params, homes, shapes, S, cfg.surplus, cm, busy_s=prev_work[d * S : (d + 1) * S])
            assignments = [plan.assignments[i] for i in params]
            for i, a in zip(params, assignments):
                for h, (_, lane, _) in zip(a.ranks, _estimate_parts(shapes[i], a.kind, a.ranks, nodes, cm)):
                    work[d * S + h] += lane
            t_to, t_back, sent = _flows_s(cfg, assignments, [shapes[i] for i in params])
            ex_to, ex_back = max(ex_to, t_to), max(ex_back, t_back)
            sent_total += sent / D
        prev_work = work
        dp_gather = 0.0
        if D > 1:
            # Each rank fetches its shard of the results the other replicas computed, and sends its own to them.
            total = sum(own)
            busiest = max(max(total - o for o in own), max((D - 1) * o for o in own))
            dp_gather = _a2a_s(cfg, busiest, D, S)
        shard_elems = [shapes[i][0] * shapes[i][1] / S for i in w.params]
        check = _a2a_s(cfg, float(len(w.params) * (S - 1)), S, 1) if cfg.grad_presence_check else 0.0
        elems = sum(shard_elems)
        pack = apply = 0.0
        if cfg.elementwise_bytes_per_s is not None:
            pack = elems * _PACK_BYTES / cfg.elementwise_bytes_per_s
            apply = elems * _APPLY_BYTES / cfg.elementwise_bytes_per_s
        layers = [layer_of[i] for i in w.params]
        plans.append(
            _WaveTimes(
                wave=w,
                ns_work=tuple(work),
                to_home_s=check + pack + ex_to,
                from_home_s=ex_back + dp_gather + apply,
                launch_layer=min(layers),
                first_layer=min(layers),
                last_layer=max(layers),
            )
        )
    return waves, ns_s, plans, sent_total
