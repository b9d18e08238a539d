"""The simulator's command line: ``python -m overlap_muon.apps.simulate``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

from .config import SimConfig
from .results import SimResult, WaveQuestion
from .shapes import MODEL_PRESETS
from .step import plan_question, simulate



# ----------------------------------------------------------------------------------------------------------
# CLI


def _parse_shape(text: str) -> tuple[int, int]:
    try:
        p, q = text.lower().split("x")
        return int(p), int(q)
    except ValueError:
        raise ValueError(f"shape {text!r} is not PxQ (e.g. 8192x28672)") from None


def _parse_shapes(spec: str, layers: int) -> tuple[tuple[tuple[int, int], ...], ...]:
    """``--shapes``: a JSON file (list of layers, each a list of [P, Q]) or inline ``PxQ,PxQ`` for one layer."""
    if os.path.exists(spec):
        with open(spec) as f:
            doc = json.load(f)
        if not isinstance(doc, list) or not all(isinstance(layer, list) for layer in doc):
            raise ValueError(f"--shapes file {spec!r} must hold a JSON list of layers, each a list of [P, Q]")
        return tuple(tuple((int(s[0]), int(s[1])) for s in layer) for layer in doc)
    one = tuple(_parse_shape(s) for s in spec.split(",") if s.strip())
    return (one,) * layers


def _ms(x: float) -> str:
    return f"{1e3 * x:10.2f} ms"


def _gram_line(cfg: SimConfig) -> str:
    """What ``gram_ns`` would save on this model: Gram NS FLOPs (``scheduler.cost.gram_ns_flops``) on the matrices
    the per-shape rule gives it, plain NS elsewhere."""
    from ..._layout import gram_wins
    from ..._scheduler.cost import gram_ns_flops, ns_cost, ns_flops

    shapes = [s for layer in cfg.layer_shapes for s in layer]
    plain = sum(ns_flops(s, cfg.ns_steps) for s in shapes)
    gram = sum(ns_cost(s, cfg.ns_steps, gram=True) for s in shapes)
    n = sum(gram_wins(s) for s in shapes)
    cheaper = sum(min(ns_flops(s, cfg.ns_steps), gram_ns_flops(s, cfg.ns_steps)) for s in shapes)
    less = (lambda x: 100 * (1 - x / plain) if plain else 0.0)  # noqa: E731
    return (f"gram_ns: Gram NS on {n} of {len(shapes)} matrices (long side >= 4x the short), NS FLOPs per domain "
            f"{plain:.3g} -> {gram:.3g} ({less(gram):.1f}% less; on every matrix it has fewer FLOPs for, long side "
            f"> 1.5x: {less(cheaper):.1f}% less)")


def _format_result(cfg: SimConfig, r: SimResult, max_wave_rows: int = 12) -> str:
    lines = [
        f"model {r.name}: {r.num_layers} layers, {r.num_matrices} Muon matrices; {r.num_gpus} GPUs = "
        f"TP {cfg.tp_size} x remat {cfg.remat_size} x DP {cfg.dp_size}; domain S = {r.domain_size}",
        f"assumed: NS {cfg.ns_flops_per_s:.3g} FLOP/s/GPU, links intra {cfg.intra_node_bytes_per_s:.3g} / inter "
        f"{cfg.inter_node_bytes_per_s:.3g} B/s/GPU ({cfg.gpus_per_node} GPUs/node), latency "
        f"{cfg.collective_latency_s * 1e6:.0f} us, elementwise {cfg.elementwise_bytes_per_s or 0:.3g} B/s, "
        f"{_exchange_label(cfg)} all_to_all, ns_interference {cfg.ns_interference:g}, "
        f"surplus {cfg.surplus}, dp_slots {cfg.dp_slots}",
        f"waves: {r.num_waves} (sizes {list(r.wave_sizes)}), {r.collectives_per_step} all_to_all per step; "
        f"wave_slots {cfg.wave_slots or r.domain_size}, balance {cfg.balance}"
        f"{' (node tie-break)' if cfg.uses_node_homes and cfg.balance == 'lpt' else ''}, taper {cfg.taper}",
        f"NS per home per step: max {_ms(r.ns_load_max_s).strip()}, mean {_ms(r.ns_load_mean_s).strip()}, "
        f"max/mean {r.ns_load_max_over_mean:.3f}; {r.ns_flops_per_step:.3g} NS FLOPs per domain",
        _gram_line(cfg),
        f"exchange: {r.exchange_bytes_per_rank / 1e9:.3f} GB sent per rank per direction, "
        f"{_ms(r.exchange_s).strip()} of all_to_all per step (both directions)",
        f"compute: forward {_ms(r.forward_s).strip()}, backward {_ms(r.backward_s).strip()} per micro-batch, "
        f"x{cfg.grad_accum} = {_ms(r.compute_s).strip()}",
        "",
        f"{'':22}{'exposed optimizer':>20}{'step time':>16}{'exposed %':>12}",
        f"{'without overlap':22}{_ms(r.exposed_no_overlap_s):>20}{_ms(r.step_no_overlap_s):>16}"
        f"{100 * r.exposed_fraction_no_overlap:>11.2f}%",
        f"{'overlap, default step':22}{_ms(r.exposed_barrier_s):>20}{_ms(r.step_barrier_s):>16}"
        f"{100 * r.exposed_fraction_barrier:>11.2f}%",
        f"{'overlap, async_step':22}{_ms(r.exposed_overlap_s):>20}{_ms(r.step_overlap_s):>16}"
        f"{100 * r.exposed_fraction_overlap:>11.2f}%",
        f"  (async_step: {_ms(r.overlap_wait_s).strip()} waiting in the next forward, "
        f"{_ms(r.overlap_slowdown_s).strip()} contention; step speed-up x{r.speedup:.3f})",
        f"content check at commit: {_ms(r.content_check_s).strip()} per step (one host sync included), "
        f"{100 * r.content_check_fraction:.3f}% of the async_step step",
        "",
        "overlapped run, per wave (times since the last backward started):",
        f"{'wave':>5}{'mats':>6}{'layers':>10}{'NS max':>12}{'to-home':>12}{'launch':>12}{'NS done':>12}"
        f"{'applied':>12}",
    ]
    rows = list(r.waves)
    if len(rows) > max_wave_rows:
        half = max_wave_rows // 2
        rows = rows[:half] + [None] + rows[-half:]
    for w in rows:
        if w is None:
            lines.append(f"{'...':>5}")
            continue
        lines.append(
            f"{w.index:>5}{w.num_params:>6}{f'{w.first_layer}-{w.last_layer}':>10}{1e3 * w.ns_max_s:>9.2f} ms"
            f"{1e3 * w.to_home_s:>9.2f} ms{1e3 * w.launch_at_s:>9.1f} ms{1e3 * w.ns_end_s:>9.1f} ms"
            f"{1e3 * w.applied_at_s:>9.1f} ms"
        )
    return "\n".join(lines)


def _exchange_label(cfg: SimConfig) -> str:
    if not cfg.fused_a2a:
        return "two-stage"
    return "node-aware (two hops)" if cfg.node_exchange == "node_aware" else "fused"


def _format_exchanges(rows: list[tuple[str, SimResult]]) -> str:
    """One line per exchange kind: peers, bytes (GB, sent per step), collectives, times."""
    e0 = rows[0][1].exchange
    lines = [
        "",
        f"exchange across nodes ({e0.ranks_per_node} domain ranks per node on {e0.nodes} nodes; per step, both "
        "directions, bytes sent; exposed: overlap, default step):",
        f"{'':30}{'peers max':>10}{'mean':>8}{'cross GB/rank':>14}{'total':>9}{'intra GB/rank':>14}{'a2a':>5}"
        f"{'exchange':>12}{'last wave':>12}{'exposed':>12}",
    ]
    for label, r in rows:
        e = r.exchange
        lines.append(f"{label:30}{e.peers_max:>10}{e.peers_mean:>8.1f}{e.cross_node_bytes_max / 1e9:>14.3f}"
                     f"{e.cross_node_bytes_total / 1e9:>9.1f}{e.intra_node_bytes_max / 1e9:>14.3f}"
                     f"{e.collectives_per_step:>5}{_ms(r.exchange_s):>12}{_ms(r.last_wave_latency_s):>12}"
                     f"{_ms(r.exposed_barrier_s):>12}")
    return "\n".join(lines)


def _exchange_rows(cfg: SimConfig, result: SimResult, which: str) -> list[tuple[str, SimResult]]:
    """``--node-exchange``: the run itself, and with ``both`` the other kind (and node-aware on plain homes)."""
    def label(c: SimConfig) -> str:
        kind = "node-aware" if c.node_exchange == "node_aware" else "fused"
        return f"{kind}, {'node' if c.uses_node_homes else 'plain'} homes"

    if result.exchange is None:
        return []
    rows = [(label(cfg), result)]
    one_node = cfg.domain_size == cfg.ranks_per_node  # node-aware is the fused exchange there
    if which != "both" or one_node or cfg.surplus != "idle" or cfg.domain_size % cfg.ranks_per_node:
        return rows
    for homes in [cfg.node_homes] + ([False] if cfg.node_homes is None else []):
        c = dataclasses.replace(cfg, node_exchange="node_aware", node_homes=homes)
        rows.append((label(c), simulate(c)))
    return rows


def _exchange_doc(label: str, r: SimResult) -> dict[str, Any]:
    return {"label": label, "stats": dataclasses.asdict(r.exchange), "exchange_s": r.exchange_s,
            "last_wave_latency_s": r.last_wave_latency_s, "exposed_barrier_s": r.exposed_barrier_s,
            "exposed_overlap_s": r.exposed_overlap_s, "exposed_no_overlap_s": r.exposed_no_overlap_s,
            "step_barrier_s": r.step_barrier_s}


def _format_question(qs: list[WaveQuestion]) -> str:
    q0 = qs[0]
    lines = [f"{q0.num_matrices} matrices on {q0.slots} slots ({q0.num_ranks} homes):"]
    for q in qs:
        lines.append(
            f"  taper={q.taper!s:5}: {q.num_waves} waves, sizes {list(q.wave_sizes)}; per-wave NS per home max "
            f"{[round(1e3 * x, 2) for x in q.wave_ns_max_s]} ms, "
            f"mean {[round(1e3 * x, 2) for x in q.wave_ns_mean_s]} ms; "
            f"step load max {1e3 * q.load_max_s:.2f} ms, mean {1e3 * q.load_mean_s:.2f} ms, "
            f"max/mean {q.load_max_over_mean:.3f}; last wave {1e3 * q.last_wave_s:.2f} ms with surplus "
            f"{q.surplus}" + (f" (chose {q.last_wave_policy})" if q.surplus == "auto" else "")
        )
    return "\n".join(lines)


def _format_policies(rows: list[tuple[str, int, SimResult]]) -> str:
    lines = [
        "",
        "surplus policies (scheduler.surplus; last wave = its launch to its update applied, overlapped run):",
        f"{'policy':>10}{'dp_slots':>10}{'last wave':>14}{'exposed':>14}{'exposed %':>11}{'no overlap':>14}"
        f"{'step':>14}",
    ]
    for pol, d, r in rows:
        lines.append(f"{pol:>10}{d:>10}{_ms(r.last_wave_latency_s):>14}{_ms(r.exposed_overlap_s):>14}"
                     f"{100 * r.exposed_fraction_overlap:>10.2f}%{_ms(r.exposed_no_overlap_s):>14}"
                     f"{_ms(r.step_overlap_s):>14}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI entry point; see the module docstring. Returns the exit status."""
    ap = argparse.ArgumentParser(
        prog="python -m overlap_muon.apps.simulate",
        description="Discrete-event model of one training step with layer-sharded Muon, with and without overlap.",
        epilog="Every modelling assumption is listed in the module docstring (pydoc overlap_muon.apps.simulate).",
    )
    ap.add_argument("--model", default="llama3-70b", choices=sorted(MODEL_PRESETS), help="model preset (%(default)s)")
    ap.add_argument("--shapes", help="layer shapes: a JSON file [[[P,Q],...],...] or inline PxQ,PxQ,... (one layer)")
    ap.add_argument("--layers", type=int, default=1, help="with inline --shapes: identical layers (%(default)s)")
    ap.add_argument("--tp", type=int, default=8, help="TP size (%(default)s)")
    ap.add_argument("--remat", type=int, default=8, help="GTP_remat size (%(default)s)")
    ap.add_argument("--dp", type=int, default=16, help="data-parallel replicas of the domain (%(default)s)")
    ap.add_argument("--global-batch-tokens", type=int, default=2**22, help="tokens per step in all (%(default)s)")
    ap.add_argument("--seq-len", type=int, default=8192, help="sequence length (%(default)s)")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step (%(default)s)")
    ap.add_argument("--matmul-flops", type=float, default=700e12, help="bf16 matmul FLOP/s per GPU (%(default)g)")
    ap.add_argument("--ns-flops", type=float, default=None, help="NS FLOP/s per GPU (default: --matmul-flops)")
    ap.add_argument("--intra-bw", type=float, default=400e9, help="intra-node B/s per GPU per direction (%(default)g)")
    ap.add_argument("--inter-bw", type=float, default=50e9, help="inter-node B/s per GPU (%(default)g)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="(%(default)s)")
    ap.add_argument("--latency", type=float, default=20e-6, help="seconds per all_to_all (%(default)g)")
    ap.add_argument("--elementwise-bw", type=float, default=4.0e12, help="pack/apply B/s; 0: left out (%(default)g)")
    ap.add_argument("--wave-slots", type=int, default=None, help="max matrices per wave (default: domain size)")
    ap.add_argument("--balance", default="lpt", choices=("lpt", "round_robin"))
    ap.add_argument("--no-taper", action="store_true", help="plain waves (no shrinking of the last two)")
    ap.add_argument("--two-stage", action="store_true", help="two-stage all_to_all (remat group, then TP group)")
    ap.add_argument("--node-exchange", default="both", choices=("fused", "node_aware", "both"),
                    help="the fused all_to_all in one (fused) or two hops, within then across nodes (node_aware); "
                         "'both': the run is fused, and the exchange lines compare node_aware (%(default)s)")
    ap.add_argument("--node-homes", default="auto", choices=("auto", "on", "off"),
                    help="LPT's ties of load to the least-loaded node, then local index; auto: with node_aware "
                         "(%(default)s)")
    ap.add_argument("--ns-interference", type=float, default=0.0, help="NS/model contention, 0..1 (%(default)g)")
    ap.add_argument("--surplus", default="idle", choices=("idle", "duplicate", "team", "auto", "all"),
                    help="what a wave's idle homes do (scheduler.surplus); 'all' compares every policy (%(default)s)")
    ap.add_argument("--dp-slots", type=int, default=1,
                    help="DP replicas sharing the NS work, 1..dp; with --surplus all also compared to 1 (%(default)s)")
    ap.add_argument("--team-efficiency", type=float, default=1.0, help="team NS speed-up / k, (0, 1] (%(default)g)")
    ap.add_argument("--matrices", type=int, help="answer 'N matrices on K slots' (with --slots) instead of simulating")
    ap.add_argument("--slots", type=int, help="K for --matrices")
    ap.add_argument("--shape", help="with --matrices: one PxQ for every matrix (default: the model's layer, cycled)")
    ap.add_argument("--json", help="also write the result (and config) as JSON to this path")
    args = ap.parse_args(argv)

    try:
        if args.matrices is not None or args.slots is not None:
            if args.matrices is None or args.slots is None:
                ap.error("--matrices and --slots go together")
            if args.shape:
                shapes = [_parse_shape(args.shape)]
            elif args.shapes:
                shapes = [s for layer in _parse_shapes(args.shapes, 1) for s in layer]
            else:
                shapes = [s for _, s in MODEL_PRESETS[args.model].layer_matrices()]
            ns_rate = args.ns_flops or args.matmul_flops
            from ..._scheduler.surplus import SurplusCostModel

            cm = SurplusCostModel(ns_flops_per_s=ns_rate, intra_node_bytes_per_s=args.intra_bw,
                                  inter_node_bytes_per_s=args.inter_bw, ranks_per_node=args.gpus_per_node,
                                  latency_s=args.latency, team_efficiency=args.team_efficiency)
            policies = ("idle", "duplicate", "team", "auto") if args.surplus == "all" else (args.surplus,)
            qs = [
                plan_question(args.matrices, args.slots, shapes=shapes, taper=taper, balance=args.balance,
                              ns_flops_per_s=ns_rate, surplus=pol, cost_model=cm)
                for taper in (False, True)
                for pol in policies
            ]
            print(_format_question(qs))
            if args.json:
                _write_json(args.json, {"questions": [dataclasses.asdict(q) for q in qs]})
            return 0

        common = dict(
            ns_flops_per_s=args.ns_flops or args.matmul_flops,
            intra_node_bytes_per_s=args.intra_bw,
            inter_node_bytes_per_s=args.inter_bw,
            gpus_per_node=args.gpus_per_node,
            collective_latency_s=args.latency,
            elementwise_bytes_per_s=args.elementwise_bw or None,
            wave_slots=args.wave_slots,
            balance=args.balance,
            taper=not args.no_taper,
            fused_a2a=not args.two_stage,
            node_exchange="node_aware" if args.node_exchange == "node_aware" else "fused",
            node_homes={"auto": None, "on": True, "off": False}[args.node_homes],
            ns_interference=args.ns_interference,
            surplus="idle" if args.surplus == "all" else args.surplus,
            dp_slots=args.dp_slots,
            team_efficiency=args.team_efficiency,
        )
        if args.shapes:
            layer_shapes = _parse_shapes(args.shapes, args.layers)
            tokens = args.global_batch_tokens / (args.remat * args.dp * args.grad_accum)
            per_flop = tokens / (args.tp * args.matmul_flops)
            fwd = tuple(2.0 * sum(p * q for p, q in layer) * per_flop for layer in layer_shapes)
            cfg = SimConfig(name="custom", layer_shapes=layer_shapes, layer_forward_s=fwd,
                            layer_backward_s=tuple(2 * f for f in fwd), tp_size=args.tp, remat_size=args.remat,
                            dp_size=args.dp, grad_accum=args.grad_accum, **common)
        else:
            cfg = SimConfig.for_model(args.model, tp_size=args.tp, remat_size=args.remat, dp_size=args.dp,
                                      global_batch_tokens=args.global_batch_tokens, seq_len=args.seq_len,
                                      grad_accum=args.grad_accum, matmul_flops_per_s=args.matmul_flops, **common)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = simulate(cfg)
    print(_format_result(cfg, result))
    doc: dict[str, Any] = {"config": dataclasses.asdict(cfg), "result": dataclasses.asdict(result)}
    exchanges = _exchange_rows(cfg, result, args.node_exchange)
    if exchanges:
        print(_format_exchanges(exchanges))
        doc["exchanges"] = [_exchange_doc(label, r) for label, r in exchanges]
    if args.surplus == "all":
        rows = []
        for d in sorted({1, cfg.dp_slots}):
            for pol in ("idle", "duplicate", "team", "auto"):
                r = simulate(dataclasses.replace(cfg, surplus=pol, dp_slots=d))
                rows.append((pol, d, r))
        print(_format_policies(rows))
        doc["policies"] = [{"surplus": pol, "dp_slots": d, "last_wave_latency_s": r.last_wave_latency_s,
                            "exposed_overlap_s": r.exposed_overlap_s,
                            "exposed_fraction_overlap": r.exposed_fraction_overlap,
                            "exposed_no_overlap_s": r.exposed_no_overlap_s, "step_overlap_s": r.step_overlap_s}
                           for pol, d, r in rows]
    if args.json:
        _write_json(args.json, doc)
    return 0


def _write_json(path: str, doc: dict) -> None:
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)

