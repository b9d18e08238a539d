"""Bench case ``overlap``: how much of the optimizer's time the default hides in a training step, and how much
the forced overlap does.

A training step (forward, backward, optimizer) of a transformer-like residual stack (per block an
attention-like pair ``(d, d)``, ``(d, d)`` and an MLP ``(4d, d)``, ``(d, 4d)``, RMS-normed, Megatron TP
over the ranks) with OverlapMuon's defaults (``t_default``: ``auto_overlap`` keeps the faster of overlap on and
off after its trial, which the warm-up runs; the mode it kept is reported), ``overlap=True`` (``t_on``),
``overlap=True, async_step=True`` (``t_async``: the next forward waits per module instead of ``step()``),
``overlap=False`` (``t_off``) and no optimizer (``t_none``). ``exposed_fraction_world{1,2}`` =
``(t_default - t_none) / (t_off - t_none)``: the part of the optimizer's time the default fails to hide (0 all
hidden, 1 nothing hidden); ``on_exposed_fraction`` and ``async_exposed_fraction`` the same for ``t_on`` and
``t_async``; ``async_over_on_iteration_world{1,2}`` = ``t_async / t_on`` (below 1: what the step barrier costs).
``exposed_fraction_acc4_world{1,2}``: the same with 4 micro-batches per step (the default, off and no optimizer
each accumulating 4); ``exposed_fraction_{max_grad_norm,user_clip}_world1``: the default with clipping that bites
every step (``max_grad_norm``, or torch's ``clip_grad_norm_`` before ``step()``) over the plain ``t_off``. World 1
has a spare core for the lanes; at world 2 both cores run ranks, so the lanes compete with the training step. The
variants run in interleaved rounds of a few iterations each; a round's time includes ``synchronize()`` at its
end, so every launched wave is paid for. A ``--small`` run (a smoke run) skips the default's variants (their
trial) and the accumulation and clipping ones: their ratios are ``None``.
``llama_exposed_fraction_world1``: the same at world 1 on a Llama-shaped stack (:class:`_LlamaStack`: d_model
256, GQA with 4 query and 2 KV heads of 64, SwiGLU MLP 688; 6 layers, 42 matrices of 5 shapes), whose many
small same-shape matrices show how waves batch (its NS calls per step are reported beside it).
``sim_exposed_fraction_world{1,2}``: overlap on as :func:`overlap_muon.apps.simulate.simulate` models it, fed the
per-phase figures measured in the same rounds (per-layer forward / backward times, unbatched NS FLOP/s) and after
them (all_to_all bandwidth and latency, elementwise bandwidth), reported as ``exposed_overlap_s /
exposed_no_overlap_s`` (the same definition). Its ``ns_interference`` comes from how many cores two compute threads
get just before the case (:func:`_two_thread_speedup`; the machine may be shared). A full run also records a
``torch.profiler`` trace of the world-1 overlapped step and draws it with
:func:`overlap_muon.apps.timeline.draw_timeline` (``traces/bench_overlap_w1_*``): the waits it shows are the part of
the exposed time spent blocked on waves.
"""

from __future__ import annotations

import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from overlap_muon._ns import zeropower
from overlap_muon.optimizer import OverlapMuon
from overlap_muon._overlap_choice import TRIAL
from overlap_muon._scheduler import ns_flops

from .common import (_HP, _CaseResult, _max_over_ranks, _median, _ms, _muon_2d, _Options, _ratio, _run_ranks,
                     _tp_stack, _TPBlock, _two_thread_speedup)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = tuple(
    f"{p}exposed_fraction{a}_world{w}" for w in (1, 2) for p, a in (("", ""), ("on_", ""), ("sim_", ""),
                                                                      ("async_", ""), ("", "_acc4"))) + tuple(
    f"async_over_on_iteration_world{w}" for w in (1, 2)) + (
    "exposed_fraction_max_grad_norm_world1", "exposed_fraction_user_clip_world1", "llama_exposed_fraction_world1")


def _ns_sample(shapes: dict[tuple[int, int], int]) -> float:
    """Seconds of one unbatched NS of every matrix (``{full shape: count}``), as an overlapped wave runs them."""
    total = 0.0
    for full, count in shapes.items():
        x = torch.randn(full).bfloat16()
        t0 = time.perf_counter()
        zeropower(x)
        total += count * (time.perf_counter() - t0)
    return total


def _link_figures(elems: int, wave_bytes: int, world: int, group: Any, repeats: int) -> dict[str, float]:
    """Elementwise B/s (momentum ``lerp_`` over ``elems`` fp32 elements: 12 B each) and, for ``world > 1``, the
    all_to_all bandwidth (B/s leaving a rank, for ``wave_bytes`` per rank) and latency (s, a ``world``-byte one)."""
    buf, grad = torch.zeros(elems), torch.randn(elems)
    ts = []
    for _ in range(repeats + 1):
        t0 = time.perf_counter()
        buf.lerp_(grad, 0.05)
        ts.append(time.perf_counter() - t0)
    out = {"elementwise_bytes_per_s": 12 * elems / _median(ts[1:]), "link_bytes_per_s": 1e12,
           "collective_latency_s": 0.0}
    if world > 1:
        nbytes = wave_bytes - wave_bytes % world
        send, recv = torch.empty(nbytes, dtype=torch.uint8), torch.empty(nbytes, dtype=torch.uint8)
        tiny_s, tiny_r = torch.empty(world, dtype=torch.uint8), torch.empty(world, dtype=torch.uint8)
        big, small = [], []
        for _ in range(repeats + 1):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            dist.all_to_all_single(recv, send, group=group)
            t1 = time.perf_counter()
            dist.all_to_all_single(tiny_r, tiny_s, group=group)
            t2 = time.perf_counter()
            big.append(t1 - t0)
            small.append(t2 - t1)
        lat = _median(small[1:])
        out["collective_latency_s"] = lat
        out["link_bytes_per_s"] = (nbytes * (1 - 1 / world)) / max(1e-9, _median(big[1:]) - lat)
    return out


#: A clipping bound every gradient norm of the overlap case exceeds, so clipping bites on every step.
_TINY_NORM = 1e-3

#: The variants' OverlapMuon options (``None``: no optimizer). ``default`` sets nothing: ``auto_overlap`` keeps
#: the faster mode after its trial, which the warm-up runs. ``on`` forces the overlap (what the simulator models).
_VARIANTS: dict[str, dict[str, Any] | None] = {"none": None, "off": dict(overlap=False), "on": dict(overlap=True),
                                               "default": {}, "async": dict(async_step=True)}
#: World 1 (plain TP shards at world 2 cannot be clipped by the runtime): ``max_grad_norm`` biting every step, and
#: torch's ``clip_grad_norm_`` biting between backward and ``step()``; the default otherwise.
_CLIP_VARIANTS: dict[str, dict[str, Any] | None] = {"default_clip": dict(max_grad_norm=_TINY_NORM),
                                                    "default_user_clip": {}}
#: Four micro-batches (forward and backward each) per ``step()``.
_ACC_VARIANTS: dict[str, dict[str, Any] | None] = {"none_acc4": None, "off_acc4": dict(overlap=False),
                                                   "default_acc4": {}}


def _overlap_rank(rank: int, world: int, d: int, blocks: int, tokens: int, rounds: int, chunk: int,
                  trace_path: str | None, small: bool = False) -> dict[str, Any]:
    """Interleaved rounds of ``chunk`` iterations per variant (none / off / on) plus one NS sample per round, so
    the per-phase figures the simulator gets see the same machine load as the step times."""
    T, t = world, rank
    group = dist.new_group(list(range(world))) if world > 1 else None
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(5))
    variants: dict[str, tuple[nn.Module, OverlapMuon | None]] = {}
    names = list(_VARIANTS) + (list(_CLIP_VARIANTS) if world == 1 else []) + list(_ACC_VARIANTS)
    if small:  # a smoke run: no auto_overlap trial (the default's variants), the quick run's cost of before
        names = [n for n in names if n in ("none", "off", "on", "async")]
    for name in names:
        net = _tp_stack(d, blocks, T, t, group)
        kw = {**_VARIANTS, **_CLIP_VARIANTS, **_ACC_VARIANTS}[name]
        variants[name] = (net, None if kw is None else OverlapMuon(net, tp_group=group, muon_filter=_muon_2d,
                                                                   **kw, **_HP))
    fwd_bwd: dict[str, list[float]] = {"forward": [], "backward": []}

    def iteration(name: str, record: bool) -> None:
        net, opt = variants[name]
        for _ in range(4 if name.endswith("_acc4") else 1):
            t0 = time.perf_counter()
            with torch.profiler.record_function("## forward ##"):
                loss = net(x).pow(2).mean()
            t1 = time.perf_counter()
            with torch.profiler.record_function("## backward ##"):
                loss.backward()
            t2 = time.perf_counter()
        with torch.profiler.record_function("## optimizer ##"), warnings.catch_warnings():
            if name in _CLIP_VARIANTS:  # re-runs are what these variants measure: no warning
                warnings.filterwarnings("ignore", message=r"OverlapMuon: \d+ of \d+ waves re-ran")
            if name == "default_user_clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), _TINY_NORM)
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        if record and name == "none":
            fwd_bwd["forward"].append(t1 - t0)
            fwd_bwd["backward"].append(t2 - t1)

    def run_chunk(name: str, record: bool, n: int = chunk) -> float:
        """Seconds per iteration over ``n`` iterations, every launched wave applied at the end."""
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            iteration(name, record)
        opt = variants[name][1]
        if opt is not None:
            opt.synchronize()
        return (time.perf_counter() - t0) / chunk

    shapes: dict[tuple[int, int], int] = {}
    for p in variants["none"][0].parameters():
        shapes[tuple(p.full_shape)] = shapes.get(tuple(p.full_shape), 0) + 1
    names = names + ["ns"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names[:-1]:  # warm-up; the default's auto_overlap trial ends inside it
        run_chunk(n, False, 2 * TRIAL + 3 if n.startswith("default") else chunk)
    _ns_sample(shapes)
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(run_chunk(n, True) if n != "ns" else _ns_sample(shapes))
    ns_time = times.pop("ns")
    flops = sum(c * ns_flops(s) for s, c in shapes.items())
    local = [p for p in variants["none"][0].parameters()]
    elems = sum(p.numel() for p in local)
    out: dict[str, Any] = {"times": times, "forward_s": _median(fwd_bwd["forward"]),
                           "backward_s": _median(fwd_bwd["backward"]), "ns_flops_per_s": flops / _median(ns_time)}
    # One wave's exchange: the bf16 shards of one block's matrices.
    out.update(_link_figures(elems, 2 * elems // blocks, world, group, repeats=3))
    if trace_path is not None and rank == 0:
        out["trace"] = _profile_overlap(iteration, variants["on"][1], trace_path)
    out["default_chose_on"] = {n: o.stats.get("overlap_auto_chose_on") for n, (_, o) in variants.items()
                               if n.startswith("default") and o is not None}
    for _, opt in variants.values():
        if opt is not None:
            opt.close()
    return out


def _profile_overlap(iteration: Callable[[str, bool], None], opt: OverlapMuon | None, path: str) -> str | None:
    """Record a ``torch.profiler`` Chrome trace (all threads) of 3 overlapped iterations after 1 warm-up, with a
    ``ProfilerStep#N`` range per iteration; return the path, or None if profiling failed."""
    try:
        from torch._C._profiler import _ExperimentalConfig

        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU],
            schedule=torch.profiler.schedule(wait=0, warmup=1, active=3, repeat=1),
            on_trace_ready=lambda prof: prof.export_chrome_trace(path),
            experimental_config=_ExperimentalConfig(profile_all_threads=True),
        ) as prof:
            for _ in range(4):
                iteration("on", False)
                prof.step()
        if opt is not None:
            opt.synchronize()
        return path if os.path.exists(path) else None
    except Exception:  # noqa: BLE001 - the trace is an extra; the measurement stands without it
        return None


def _simulate_exposed(d: int, blocks: int, world: int, r: dict[str, Any], speedup: float) -> dict[str, Any] | None:
    """The simulator's exposed fraction for the measured figures of rank 0 (None without overlap_muon.apps.simulate).

    ``speedup`` is :func:`_two_thread_speedup`, measured just before: at world 1 the NS lane and the training step
    are two threads, each slowed to ``speedup / 2`` of its speed while both run, i.e. ``ns_interference =
    2 / speedup - 1`` (0 on two idle cores). At world 2 every core already runs a rank, so the lanes share a
    rank's core with its training step: ``ns_interference = 1``.
    """
    try:
        from overlap_muon.apps.simulate import SimConfig, simulate
    except ImportError:
        return None
    cfg = SimConfig.from_measured(
        layer_shapes=[_TPBlock.shapes(d)] * blocks,
        layer_forward_s=[r["forward_s"] / blocks] * blocks,
        layer_backward_s=[r["backward_s"] / blocks] * blocks,
        ns_flops_per_s=r["ns_flops_per_s"],
        link_bytes_per_s=r["link_bytes_per_s"],
        tp_size=world,
        remat_size=1,
        collective_latency_s=r["collective_latency_s"],
        elementwise_bytes_per_s=r["elementwise_bytes_per_s"],
        # [Note: what the model assumes] item 8: contention between NS and the training step.
        ns_interference=min(1.0, max(0.0, 2.0 / speedup - 1.0)) if world == 1 else 1.0,
    )
    s = simulate(cfg)
    return {
        "exposed_fraction": _ratio(s.exposed_overlap_s, s.exposed_no_overlap_s),
        "exposed_overlap_s": s.exposed_overlap_s,
        "exposed_no_overlap_s": s.exposed_no_overlap_s,
        "ns_interference": cfg.ns_interference,
        "waves": s.num_waves,
    }


class _LlamaStack(nn.Module):
    """A Llama-shaped decoder stack at small scale: per layer RMS norm, causal GQA attention (q ``(d, d)``, k and
    v ``(d/2, d)``: 4 query heads and 2 KV heads of ``d/4``; o ``(d, d)``), RMS norm, SwiGLU MLP (gate and up
    ``(43d/16, d)``, down ``(d, 43d/16)``: 688 at d 256); no biases, no norm weights (every param a Muon matrix).
    Input/output ``(B, S, d)`` float32."""

    def __init__(self, layers: int, d: int = 256) -> None:
        super().__init__()
        self.d, self.head, ff = d, d // 4, 43 * d // 16
        self.layers = nn.ModuleList()
        for _ in range(layers):
            m = nn.Module()
            m.q = nn.Linear(d, d, bias=False)
            m.k, m.v = nn.Linear(d, d // 2, bias=False), nn.Linear(d, d // 2, bias=False)
            m.o = nn.Linear(d, d, bias=False)
            m.gate, m.up = nn.Linear(d, ff, bias=False), nn.Linear(d, ff, bias=False)
            m.down = nn.Linear(ff, d, bias=False)
            self.layers.append(m)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        for m in self.layers:
            h = F.rms_norm(x, (self.d,))
            q = m.q(h).view(B, S, 4, self.head).transpose(1, 2)
            k = m.k(h).view(B, S, 2, self.head).transpose(1, 2)
            v = m.v(h).view(B, S, 2, self.head).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + m.o(a.transpose(1, 2).reshape(B, S, self.d))
            h = F.rms_norm(x, (self.d,))
            x = x + m.down(F.silu(m.gate(h)) * m.up(h))
        return x


def _overlap_llama_rank(rank: int, world: int, layers: int, d: int, batch: int, seq: int, rounds: int,
                        chunk: int) -> dict[str, Any]:
    """Interleaved rounds of ``chunk`` training iterations of :class:`_LlamaStack` with no optimizer, overlap off
    and overlap on (each round ends with ``synchronize()``); seconds per iteration and NS calls per step."""
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(5))
    variants: dict[str, tuple[nn.Module, OverlapMuon | None]] = {}
    for name in ("none", "off", "on"):
        with torch.random.fork_rng():
            torch.manual_seed(12)
            net = _LlamaStack(layers, d)
        opt = None if name == "none" else OverlapMuon(net, overlap=(name == "on"), **_HP)
        variants[name] = (net, opt)

    def run_chunk(name: str) -> float:
        net, opt = variants[name]
        t0 = time.perf_counter()
        for _ in range(chunk):
            net(x).pow(2).mean().backward()
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        if opt is not None:
            opt.synchronize()
        return (time.perf_counter() - t0) / chunk

    names = list(variants)
    for n in names:
        run_chunk(n)
    steps0 = {n: (o.stats["ns_calls"], o.stats["steps"]) for n, (_, o) in variants.items() if o is not None}
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        for n in names[r % 3:] + names[: r % 3]:
            times[n].append(run_chunk(n))
    ns_calls = {n: (o.stats["ns_calls"] - steps0[n][0]) / max(1, o.stats["steps"] - steps0[n][1])
                for n, (_, o) in variants.items() if o is not None}
    waves = {n: len(o.waves) for n, (_, o) in variants.items() if o is not None}
    for _, o in variants.values():
        if o is not None:
            o.close()
    return {"times": times, "ns_calls_per_step": ns_calls, "waves": waves,
            "matrices": sum(1 for _ in variants["none"][0].parameters())}


def run(o: _Options) -> _CaseResult:
    d = o.side(256)
    blocks, tokens = (2, 128 if o.small else 512) if o.quick else (6, 1024)
    rounds, chunk = o.reps(5, 5), (1 if o.small else 2) if o.quick else 3
    ratios: dict[str, float | None] = {}
    lines, det = [], {"d_model": d, "blocks": blocks, "tokens": tokens, "rounds": rounds, "iters_per_chunk": chunk,
                      "matrices": 4 * blocks}
    for world in (1, 2):
        trace = None
        if not o.quick and world == 1:
            trace = os.path.abspath(os.path.join(o.trace_dir, "bench_overlap_w1_trace.json"))
        speedup = _two_thread_speedup()
        res = _run_ranks(_overlap_rank, world, d, blocks, tokens, rounds, chunk, trace, o.small,
                         timeout_s=o.timeout_s)
        med = {n: _median(_max_over_ranks([r["times"][n] for r in res])) for n in res[0]["times"]}

        def exposed(v: str, none: str = "none", off: str = "off") -> float | None:
            return _ratio(med[v] - med[none], med[off] - med[none]) if v in med else None

        frac, on_frac, async_frac = exposed("default"), exposed("on"), exposed("async")
        ratios[f"on_exposed_fraction_world{world}"] = on_frac
        ratios[f"async_exposed_fraction_world{world}"] = async_frac
        ratios[f"async_over_on_iteration_world{world}"] = _ratio(med["async"], med["on"])
        ratios[f"exposed_fraction_acc4_world{world}"] = exposed("default_acc4", "none_acc4", "off_acc4")
        kept = res[0]["default_chose_on"]
        clip_lines = [] if "default_acc4" not in med else [
            f"         4 micro-batches per step: none {_ms(med['none_acc4'])}  off {_ms(med['off_acc4'])}  default "
            f"{_ms(med['default_acc4'])} (kept {_mode(kept['default_acc4'])}) -> exposed fraction "
            f"{_fmt(ratios[f'exposed_fraction_acc4_world{world}'])}"]
        for v, key in (("default_clip", "max_grad_norm"), ("default_user_clip", "user_clip")):
            if v in med:
                ratios[f"exposed_fraction_{key}_world{world}"] = exposed(v)
                clip_lines.append(f"         {key} biting every step: default {_ms(med[v]).strip()} (kept "
                                  f"{_mode(kept[v])}) -> exposed fraction "
                                  f"{_fmt(ratios[f'exposed_fraction_{key}_world{world}'])}")
        sim = _simulate_exposed(d, blocks, world, res[0], speedup)
        sim_frac = sim["exposed_fraction"] if sim else None
        ratios[f"exposed_fraction_world{world}"] = frac
        ratios[f"sim_exposed_fraction_world{world}"] = sim_frac
        entry = {"median_s": med, "two_thread_speedup": speedup, "default_chose_on": kept,
                 "measured": {k: v for k, v in res[0].items() if k not in ("times", "trace")},
                 "simulated": sim, "samples_s": {n: _max_over_ranks([r["times"][n] for r in res]) for n in med}}
        default = f"default {_ms(med['default'])} (kept {_mode(kept['default'])})  " if "default" in med else ""
        lines.append(f"world {world}: none {_ms(med['none'])}  off {_ms(med['off'])}  on {_ms(med['on'])}  {default}"
                     f"async_step {_ms(med['async'])}  -> "
                     f"optimizer {_ms(med['off'] - med['none']).strip()}  (two threads got {speedup:.2f} cores)")
        over_on = _fmt(ratios[f"async_over_on_iteration_world{world}"])
        lines.append(f"         exposed fraction: default {_fmt(frac)}, overlap on {_fmt(on_frac)}, async_step "
                     f"{_fmt(async_frac)}; iteration async_step / on {over_on}")
        if sim_frac is not None and on_frac is not None:
            lines.append(f"         overlap on's exposed fraction measured {on_frac:.3f}, simulator {sim_frac:.3f} "
                         f"(difference {sim_frac - on_frac:+.3f}; simulated optimizer "
                         f"{_ms(sim['exposed_no_overlap_s']).strip()} vs measured "
                         f"{_ms(med['off'] - med['none']).strip()})")
        else:
            lines.append("         simulator unavailable")
        lines += clip_lines
        if res[0].get("trace"):
            entry["trace"] = res[0]["trace"]
            entry["timeline"] = _draw(res[0]["trace"], os.path.join(o.trace_dir, "bench_overlap_w1_timeline.png"))
            tl = entry["timeline"]
            if tl and "mean_exposed_ms" in tl:
                lines.append(f"         timeline {tl['png']}: the main thread waits for waves / runs step() "
                             f"{tl['mean_exposed_ms']:.1f} ms per step ({tl['mean_exposed_fraction']:.3f} of the "
                             f"step); the rest of the exposed time is the lanes slowing forward/backward")
        det[f"world{world}"] = entry
    # The Llama-shaped stack at world 1 (many small same-shape matrices: what wave batching is about).
    llama_layers = 2 if o.quick else 6
    res = _run_ranks(_overlap_llama_rank, 1, llama_layers, d, 4, 128 if o.quick else 256, rounds, chunk,
                     timeout_s=o.timeout_s)
    med = {n: _median(res[0]["times"][n]) for n in ("none", "off", "on")}
    frac = _ratio(med["on"] - med["none"], med["off"] - med["none"])
    ratios["llama_exposed_fraction_world1"] = frac
    det["llama_world1"] = {"layers": llama_layers, "matrices": res[0]["matrices"], "median_s": med,
                           "ns_calls_per_step": res[0]["ns_calls_per_step"], "waves": res[0]["waves"],
                           "samples_s": res[0]["times"]}
    calls = res[0]["ns_calls_per_step"]
    lines.append(f"llama world 1 ({llama_layers} layers, {res[0]['matrices']} matrices): none {_ms(med['none'])}  "
                 f"off {_ms(med['off'])}  on {_ms(med['on'])}  -> exposed fraction "
                 f"{'-' if frac is None else format(frac, '.3f')}; NS calls per step on {calls['on']:g} "
                 f"({res[0]['waves']['on']} waves), off {calls['off']:g}")
    return _CaseResult(
        f"training step with overlap on / off / no optimizer: {blocks} blocks d {d} ({4 * blocks} matrices), "
        f"{tokens} tokens",
        ratios, lines, det,
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else format(x, ".3f")


def _mode(chose_on: int | None) -> str:
    """What ``auto_overlap`` kept (``stats["overlap_auto_chose_on"]``)."""
    return "undecided" if chose_on is None else "on" if chose_on else "off"


def _draw(trace: str, png: str) -> dict[str, Any] | None:
    try:
        from overlap_muon.apps.timeline import draw_timeline
    except ImportError:
        return None
    try:
        s = draw_timeline(trace, png)
    except Exception as e:  # noqa: BLE001 - the picture is an extra
        return {"error": f"{type(e).__name__}: {e}"}
    return {"png": png, "lanes": list(s.lanes), "mean_exposed_fraction": s.mean_exposed_fraction,
            "mean_exposed_ms": s.mean_exposed_ms, "warnings": list(s.warnings),
            "exposed_ms": list(s.exposed_ms), "step_ms": list(s.step_ms)}
