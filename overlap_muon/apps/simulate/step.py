""":func:`simulate` (one step, overlap on and off) and :func:`plan_question` (N matrices on K slots)."""

from __future__ import annotations

from typing import Any, Sequence

from .config import SimConfig
from .events import _plan, _run
from .exchange import _collectives_per_wave, _exchange_stats
from .results import SimResult, WaveQuestion, WaveTiming
from .shapes import MODEL_PRESETS, _APPLY_BYTES, _CONTENT_BYTES, _CONTENT_SYNC_S, _PACK_BYTES



def simulate(config: SimConfig) -> SimResult:
    """Predict one training step of ``config``'s model with and without the optimizer overlapped.

    See the module's [Note: what the model assumes] for every modelling choice.

    Args:
        config: a :class:`SimConfig`.

    Returns:
        A :class:`SimResult` (seconds, bytes, FLOPs as documented per field).

    Raises:
        TypeError: ``config`` is not a :class:`SimConfig`.
    """
    if not isinstance(config, SimConfig):
        raise TypeError(f"simulate() takes a SimConfig, got {type(config).__name__}")
    cfg = config
    S, H = cfg.domain_size, cfg.ns_slots
    waves, ns_s, plans, sent = _plan(cfg)
    # Per-home NS seconds over the step, from the lane work (with surplus policies a matrix's NS may be spread
    # over several homes, or run on several).
    per_home = [sum(p.ns_work[h] for p in plans) for h in range(H)]
    load_max, load_mean = max(per_home), sum(per_home) / H

    fwd, bwd = sum(cfg.layer_forward_s), sum(cfg.layer_backward_s)
    compute = cfg.grad_accum * (fwd + bwd)
    ovl = _run(cfg, plans, overlap=True)
    bar = _run(cfg, plans, overlap=True, barrier=True)
    no = _run(cfg, plans, overlap=False)
    # Float round-off in the event loop must not show as a negative exposure.
    exposed_ovl = max(0.0, ovl.end_s - (fwd + bwd))
    exposed_bar = max(0.0, bar.end_s - (fwd + bwd))
    exposed_no = max(0.0, no.end_s - (fwd + bwd))
    step_ovl, step_no, step_bar = compute + exposed_ovl, compute + exposed_no, compute + exposed_bar

    shapes = [s for layer in cfg.layer_shapes for s in layer]
    stats = _exchange_stats(cfg, waves, shapes) if cfg.fused_a2a else None
    exchange = 0.0
    elem_bw = cfg.elementwise_bytes_per_s
    for p in plans:
        elems = sum(shapes[i][0] * shapes[i][1] / S for i in p.wave.params)
        pack = elems * _PACK_BYTES / elem_bw if elem_bw else 0.0
        apply = elems * _APPLY_BYTES / elem_bw if elem_bw else 0.0
        exchange += (p.to_home_s - pack) + (p.from_home_s - apply)
    local_elems = sum(sh[0] * sh[1] / S for sh in shapes)
    content = (local_elems * _CONTENT_BYTES / elem_bw if elem_bw else 0.0) + _CONTENT_SYNC_S

    timings = tuple(
        WaveTiming(
            index=k,
            num_params=len(p.wave.params),
            first_layer=p.first_layer,
            last_layer=p.last_layer,
            ns_max_s=max(p.ns_work),
            ns_mean_s=sum(p.ns_work) / H,
            to_home_s=p.to_home_s,
            from_home_s=p.from_home_s,
            launch_at_s=ovl.launch[k],
            to_home_end_s=ovl.to_end[k],
            ns_end_s=ovl.ns_end[k],
            applied_at_s=ovl.applied[k],
        )
        for k, p in enumerate(plans)
    )
    return SimResult(
        name=cfg.name,
        num_gpus=cfg.num_gpus,
        domain_size=S,
        num_layers=len(cfg.layer_shapes),
        num_matrices=len(ns_s),
        num_waves=len(waves),
        wave_sizes=tuple(len(w.params) for w in waves),
        collectives_per_step=len(waves) * _collectives_per_wave(cfg),
        forward_s=fwd,
        backward_s=bwd,
        compute_s=compute,
        ns_flops_per_step=sum(ns_s) * cfg.ns_flops_per_s,
        ns_load_max_s=load_max,
        ns_load_mean_s=load_mean,
        ns_load_max_over_mean=load_max / load_mean if load_mean > 0 else 1.0,
        exchange_bytes_per_rank=sent,
        exchange_s=exchange,
        content_check_s=content,
        content_check_fraction=content / step_ovl if step_ovl > 0 else 0.0,
        exposed_no_overlap_s=exposed_no,
        exposed_overlap_s=exposed_ovl,
        overlap_wait_s=ovl.wait_s,
        overlap_slowdown_s=max(0.0, exposed_ovl - ovl.wait_s),
        step_no_overlap_s=step_no,
        step_overlap_s=step_ovl,
        exposed_barrier_s=exposed_bar,
        step_barrier_s=step_bar,
        exposed_fraction_barrier=exposed_bar / step_bar if step_bar > 0 else 0.0,
        exposed_fraction_no_overlap=exposed_no / step_no if step_no > 0 else 0.0,
        exposed_fraction_overlap=exposed_ovl / step_ovl if step_ovl > 0 else 0.0,
        waves=timings,
        exchange=stats,
    )


def plan_question(
    num_matrices: int,
    slots: int,
    *,
    shapes: Sequence[tuple[int, int]] | None = None,
    num_ranks: int | None = None,
    taper: bool = False,
    balance: str = "lpt",
    ns_steps: int = 5,
    ns_flops_per_s: float = 700e12,
    surplus: str = "idle",
    cost_model: Any = None,
) -> WaveQuestion:
    """Answer "``num_matrices`` matrices on ``slots`` slots": waves and per-wave NS load per home.

    Args:
        num_matrices: N, >= 1.
        slots: K, the wave size cap (the GPUs of the domain, one matrix per GPU per wave), >= 1.
        shapes: matrix shapes, cycled to N matrices (readiness order); default: the 70B preset's layer.
        num_ranks: homes; default ``slots``.
        taper: shrink the last two waves as :func:`scheduler.plan_waves` does (False: ``ceil(N / K)`` waves).
        balance: ``"lpt"`` or ``"round_robin"``.
        ns_steps: Newton-Schulz iterations.
        ns_flops_per_s: NS rate per home, FLOP/s.
        surplus: policy for the last wave's idle homes (``scheduler.surplus.POLICIES``).
        cost_model: a :class:`scheduler.surplus.SurplusCostModel` for :attr:`WaveQuestion.last_wave_s`; default:
            its defaults with ``ns_flops_per_s`` and ``ns_steps`` from here.

    Raises:
        ValueError: N, K or ``num_ranks`` < 1, an invalid shape, or an unknown policy.
    """
    from ..._scheduler.cost import ns_flops
    from ..._scheduler.homes import load_report
    from ..._scheduler.waves import plan_waves

    for fname, v in (("num_matrices", num_matrices), ("slots", slots)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{fname} must be an int >= 1, got {v!r}")
    num_ranks = slots if num_ranks is None else num_ranks
    if isinstance(num_ranks, bool) or not isinstance(num_ranks, int) or num_ranks < 1:
        raise ValueError(f"num_ranks must be an int >= 1, got {num_ranks!r}")
    if isinstance(ns_flops_per_s, bool) or not isinstance(ns_flops_per_s, (int, float)) or not ns_flops_per_s > 0:
        raise ValueError(f"ns_flops_per_s must be > 0, got {ns_flops_per_s!r}")
    if shapes is None:
        shapes = [s for _, s in MODEL_PRESETS["llama3-70b"].layer_matrices()]
    shapes = list(shapes)
    if not shapes:
        raise ValueError("shapes is empty; expected at least one (P, Q)")
    ns_s = [ns_flops(tuple(shapes[i % len(shapes)]), ns_steps) / ns_flops_per_s for i in range(num_matrices)]
    order = list(range(num_matrices - 1, -1, -1))
    waves = plan_waves(order, ns_s, num_ranks, wave_slots=slots, balance=balance, taper=taper)
    wmax, wmean = [], []
    homes = [0] * num_matrices
    for w in waves:
        per = [0.0] * num_ranks
        for i in w.params:
            per[w.homes[i]] += ns_s[i]
            homes[i] = w.homes[i]
        wmax.append(max(per))
        wmean.append(sum(per) / num_ranks)
    load = load_report(ns_s, homes, num_ranks)
    from ..._scheduler.surplus import SurplusCostModel, plan_surplus

    cm = cost_model or SurplusCostModel(ns_flops_per_s=ns_flops_per_s, ns_steps=ns_steps)
    all_shapes = [tuple(shapes[i % len(shapes)]) for i in range(num_matrices)]
    busy = [0.0] * num_ranks
    if len(waves) > 1:
        for i in waves[-2].params:
            busy[waves[-2].homes[i]] += ns_s[i]
    last = waves[-1]
    plan = plan_surplus(last.params, last.homes, all_shapes, num_ranks, surplus, cm, busy_s=busy)
    last_s = max(a.estimate_s for a in plan.assignments.values())
    return WaveQuestion(
        num_matrices=num_matrices,
        slots=slots,
        num_ranks=num_ranks,
        taper=taper,
        num_waves=len(waves),
        wave_sizes=tuple(len(w.params) for w in waves),
        wave_ns_max_s=tuple(wmax),
        wave_ns_mean_s=tuple(wmean),
        load_max_s=load.max,
        load_mean_s=load.mean,
        load_max_over_mean=load.max_over_mean,
        surplus=surplus,
        last_wave_policy=plan.policy,
        last_wave_s=last_s,
    )
