"""Benchmarks of overlap-muon: each case measures our path and its baseline in the same run, on the same inputs.

Usage::

    python -m overlap_muon.apps.bench                          # every case, full sizes
    overlap-muon-bench --quick --json traces/bench_quick.json
    python -m overlap_muon.apps.bench --cases comm,balance     # a subset
    python -m overlap_muon.apps.bench --cases overhead --py-spy  # plus a py-spy flame graph of the dispatch path

Times are medians over repeats after warm-up; where a case compares variants, the variants are interleaved
(A, B, A, B, ...) so drift in the machine's load hits both alike. Multi-rank cases spawn gloo ranks on a free
loopback port, one intra-op thread per rank (``torch.set_num_threads(1)``), with a hard timeout; world-1 cases
run in this process, also with one intra-op thread. Nothing here asserts a speed.

Cases, and what each ratio means (the JSON has every key of :func:`expected_ratio_keys`; a value is ``None``
where it could not be measured, e.g. ``--no-baseline``):

``step``
    Optimizer step (``overlap=False``) on the Muon matrices of a 12-layer transformer (d_model 256, MLP 4x:
    per layer q, k, v, o ``(256, 256)``, up ``(1024, 256)``, down ``(256, 1024)``), world 2 as a 1x2 TP domain
    (plain local shards with ``partition_dim``: q, k, v, up colwise 0; o, down rowwise 1; explicit groups),
    gradients set directly. ``duplicated_over_layer_sharded``: step time of ``mode="duplicated"`` (all-gather,
    NS of every matrix on every rank) over ``mode="layer_sharded"`` (NS once, on the matrix's home). > 1 means
    layer sharding is faster. A step ends when its slowest rank ends (max over ranks per repeat).
``overhead``
    3000 small matrices of 8 shapes, world 1: ``OverlapMuon.step`` (``overlap=False``, ``batch_ns`` on) vs
    ``torch.optim.Muon.step`` on the same tensors. ``torch_muon_over_overlap_muon``: time ratio (> 1: our host
    path of planning, dispatch and shape batching is cheaper than the reference's per-matrix loop);
    ``torch_muon_over_overlap_muon_unbatched``: the same with ``batch_ns`` off (the dispatch cost alone).
    ``--py-spy`` records a flame graph of our step into ``traces/overhead_flame.svg``.
``ns``
    Batched Newton-Schulz (:func:`overlap_muon.ns.zeropower` on a ``(b, P, Q)`` bf16 stack) achieved FLOP/s,
    ``b * scheduler.ns_flops((P, Q)) / time``, over the FLOP/s of the same matmuls as plain ``torch.bmm`` in bf16
    (``5 x`` ``(b,m,n)@(b,n,m)``, ``(b,m,m)@(b,m,m)``, ``(b,m,m)@(b,m,n)``: exactly the FLOPs ``ns_flops``
    counts), the limit on this machine. ``ns_over_bmm`` in (0, 1]; the gap is NS's elementwise work (norm,
    casts, ``baddbmm`` scaling, transposes).
    ``syrk_over_plain``: one-matrix ``zeropower(syrk=True)`` (symmetric Gram and ``A @ A``, upper block rows +
    mirror, ``overlap_muon.ns.SYRK_BLOCK``) effective FLOP/s over the plain ``zeropower``'s (both counted as
    ``ns_flops``, so it is the time ratio plain / syrk), summed over 1024^2, 2048x8192 and 4096^2 (``--quick``:
    256^2, 256x1024, 512^2), 1 thread; per shape the details also give whether the result is bitwise equal to the
    plain one, the max abs and relative Frobenius difference, and the FLOPs the symmetric products skip.
``comm``
    Bytes and collectives per rank per step, counted by wrapping the ``torch.distributed`` collectives inside
    the ranks, on a 2x2 domain (world 4; even shards, partition dims 0 and 1), for layer-sharded fused
    (one ``all_to_all_single`` per direction over the flat domain), two-stage (remat group, then TP group) and
    duplicated (one ``all_gather_single`` per matrix). "Bytes sent" is what leaves the rank: an all_to_all's
    input minus the split addressed to the rank itself; an all-gather's input times ``group size - 1`` (every
    peer receives it). Ideal: ``2 * (1 - 1/S) * shard_bytes`` (``shard_bytes`` = the rank's shards of every Muon
    matrix in bf16; ``S`` = domain size): each shard leaves its rank once for the home, and each home sends
    ``S - 1`` blocks back. ``*_bytes_over_ideal``: mean over ranks of bytes sent / ideal.

    [Note: why fused is exactly ideal and two-stage is not] Fused sends every non-home shard straight to the
    home and every block straight back, so its mean equals the formula exactly (the runtime's plan includes the
    home's own block in the send buffer; that split never leaves the rank and is not counted). Two-stage
    relays: stage 1 moves rows to the home's remat row, ``(1 - 1/R)`` of the matrix, then stage 2 moves the
    assembled TP blocks, ``(1 - 1/T)`` of it, among them the rows that already moved in stage 1. It sends
    ``(2 - 1/R - 1/T) / (1 - 1/(R*T))`` times the ideal: 4/3 on a 2x2 domain, 1 when ``R`` or ``T`` is 1.
    Duplicated sends ``S - 1`` copies of each shard and nothing back: ``S / 2`` times the ideal.
``overlap``
    A training step (forward, backward, optimizer) of a transformer-like residual stack (per block an
    attention-like pair ``(d, d)``, ``(d, d)`` and an MLP ``(4d, d)``, ``(d, 4d)``, RMS-normed, Megatron TP
    over the ranks) with ``overlap=True`` (``t_on``: the default step, which returns once its updates have
    landed), ``overlap=True, async_step=True`` (``t_async``: the next forward waits per module instead),
    ``overlap=False`` (``t_off``) and no optimizer (``t_none``). ``exposed_fraction_world{1,2}`` =
    ``(t_on - t_none) / (t_off - t_none)``: the part of the optimizer's time that the overlap fails to hide (0 all
    hidden, 1 nothing hidden); ``async_exposed_fraction_world{1,2}`` the same for ``t_async``, and
    ``async_over_default_iteration_world{1,2}`` = ``t_async / t_on`` (below 1: what the step barrier costs). World 1 has the NS lane
    on the spare core; at world 2 both cores run ranks, so the lanes compete with the training step. The
    variants run in interleaved rounds of a few iterations each; a round's time includes ``synchronize()`` at its
    end, so every launched wave is paid for.
    ``llama_exposed_fraction_world1``: the same at world 1 on a Llama-shaped stack (:class:`_LlamaStack`: d_model
    256, GQA with 4 query and 2 KV heads of 64, SwiGLU MLP 688; 6 layers, 42 matrices of 5 shapes), whose many
    small same-shape matrices show how waves batch (its NS calls per step are reported beside it).
    ``sim_exposed_fraction_world{1,2}``: :func:`overlap_muon.apps.simulate.simulate` fed the per-phase figures measured
    in the same rounds (per-layer forward / backward times, unbatched NS FLOP/s) and after them (all_to_all
    bandwidth and latency, elementwise bandwidth), reported as ``exposed_overlap_s / exposed_no_overlap_s`` (the
    same definition). Its ``ns_interference`` comes from how many cores two compute threads get just before the
    case (:func:`_two_thread_speedup`; the machine may be shared). A full run also records a ``torch.profiler``
    trace of the world-1 overlapped step and draws it with :func:`overlap_muon.apps.timeline.draw_timeline`
    (``traces/bench_overlap_w1_*``): the waits it shows are the part of the exposed time spent blocked on waves.
``balance``
    Pure planning: max/mean NS load per rank (``scheduler.load_report`` of ``ns_flops`` costs) of LPT vs round
    robin, for every Muon matrix of a step of GPT-2 small, a Llama-3-8B-class and a Llama-3-70B-class model,
    on domains of 8, 16 and 64 ranks. ``{model}_S{S}_lpt_max_over_mean`` and ``..._rr_max_over_mean`` (>= 1;
    1 is perfect balance).
``surplus``
    The team NS kernel alone (``overlap_muon.team_ns.team_zeropower_full``, not the optimizer): a 2048x8192 matrix
    (``--quick``: 512x2048) at world 2 (gloo, 1 thread per rank), split by columns ([Note: team NS by columns])
    and, for comparison, by rows, against ``zeropower`` of the whole matrix on rank 0 while rank 1 waits,
    interleaved, each timed between barriers. ``single_over_team_world2``: single-rank latency over the column
    team's (> 1: the team is faster). ``idle_over_duplicate_last_wave_world2``: the optimizer itself, one such
    matrix row-sharded over TP 2 (one wave, one surplus home), ``step()`` to its last apply with
    ``surplus="idle"`` over ``"duplicate"`` (> 1: duplicating is faster; the details say whether both gave the
    same params); ``idle_over_team_last_wave_world2`` the same with ``"team"`` (the issue's goal: >= 1.6). The
    details also time the column team's matmuls alone on both ranks at once (no collectives): the compute part,
    which on a shared 2-core machine shows how much the two ranks slow each other; and the exactness of both
    splits against ``zeropower`` (bitwise or not, max abs and relative Frobenius difference).
    ``sim_70b_{idle,best}_exposed_fraction``: :mod:`overlap_muon.apps.simulate` on the 70B preset (TP 8, remat 8, DP 16),
    exposed optimizer fraction with idle surplus and with the best of ``duplicate`` / ``team`` / ``auto`` at
    ``dp_slots`` 1 and 4 (the issue's goal: <= 0.02).
``peers``
    OverlapMuon side by side with torchtitan's ``DistMuon`` (FlexShard; optional, skipped with the install line
    when not importable; CPU patches and details in :mod:`overlap_muon.apps.bench_peers`). Same model (d_model 256,
    4 heads, per layer q, k, v, o, up, down), same DTensor shards, same gradients, interleaved. (a) the optimizer
    step alone (``overlap=False``), world 2, TP (``ColwiseParallel``/``RowwiseParallel``) and FSDP2
    (``fully_shard``) layouts: ``step_{tp,fsdp}_world2_overlap_muon_over_dist_muon``; (b) the whole training
    iteration (forward, backward, step) with OverlapMuon's overlap on, TP, world 1 and 2:
    ``iteration_world{1,2}_overlap_muon_over_dist_muon``. Each is our median time over DistMuon's (one bucket);
    < 1 means OverlapMuon is faster. The case fails if any result is not ``torch.equal`` (to each other, and in
    (a) to ``torch.optim.Muon`` on the unsharded model).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from overlap_muon.scheduler import load_report, lpt_homes, ns_flops, plan_waves, round_robin_homes
from overlap_muon.scheduler.surplus import CPU_GLOO, team_row_counts, team_splits_poly

from .spawn import spawn_ranks
from ..domain import block_shape, local_tensor
from ..ns import SYRK_BLOCK, zeropower
from ..optimizer import OverlapMuon
from ..team_ns import team_zeropower_full

__all__ = ["main", "CASES", "expected_ratio_keys", "machine_info"]

#: Case names, in the order a full run executes them.
CASES: tuple[str, ...] = ("step", "overhead", "ns", "comm", "overlap", "balance", "surplus", "memory", "peers")

#: Muon hyper-parameters of every case (``torch.optim.Muon``'s defaults except a visible learning rate).
_HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def _muon_2d(name: str, p: Tensor) -> bool:
    """Muon filter of the benchmarks: every 2-D param (their models hold only Muon matrices)."""
    return p.ndim == 2


# ----------------------------------------------------------------------------------------------------------------
# Model families of the balance case (public dimensions).
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Family:
    name: str
    layers: int
    d_model: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    gated: bool  #: gated MLP (gate, up, down) vs plain (fc, proj)
    fused_qkv: bool  #: one (q + 2 kv, d) matrix vs three
    source: str

    def matrices(self) -> list[tuple[int, int]]:
        """Every Muon matrix of the model, full logical ``(out, in)`` shapes, layer 0 first."""
        d, f = self.d_model, self.ffn
        q, kv = self.q_heads * self.head_dim, self.kv_heads * self.head_dim
        attn = [(q + 2 * kv, d)] if self.fused_qkv else [(q, d), (kv, d), (kv, d)]
        attn.append((d, q))
        mlp = [(f, d), (f, d), (d, f)] if self.gated else [(f, d), (d, f)]
        return (attn + mlp) * self.layers


_FAMILIES = (
    _Family("gpt2_small", 12, 768, 3072, 12, 12, 64, False, True,
            "GPT-2 small (Radford et al. 2019): 12 layers, d 768, 12 heads, MLP 3072, fused c_attn"),
    _Family("llama3_8b", 32, 4096, 14336, 32, 8, 128, True, False,
            "Llama 3 8B ('The Llama 3 Herd of Models', Meta 2024, Table 3): 32 layers, d 4096, FFN 14336, GQA 32/8"),
    _Family("llama3_70b", 80, 8192, 28672, 64, 8, 128, True, False,
            "Llama 3 70B (same source): 80 layers, d 8192, FFN 28672, GQA 64/8"),
)
_DOMAINS = (8, 16, 64)


def expected_ratio_keys(case: str) -> tuple[str, ...]:
    """The keys of ``cases[case]["ratios"]`` in the JSON (each present in every run of the case).

    Raises:
        ValueError: unknown case.
    """
    if case == "step":
        return ("duplicated_over_layer_sharded",)
    if case == "overhead":
        return ("torch_muon_over_overlap_muon", "torch_muon_over_overlap_muon_unbatched")
    if case == "ns":
        return ("ns_over_bmm", "syrk_over_plain")
    if case == "comm":
        return ("fused_bytes_over_ideal", "two_stage_bytes_over_ideal", "duplicated_bytes_over_ideal",
                "fused_default_bytes_over_ideal")
    if case == "overlap":
        return tuple(f"{p}exposed_fraction_world{w}" for w in (1, 2) for p in ("", "sim_", "async_")) + tuple(
            f"async_over_default_iteration_world{w}" for w in (1, 2)) + (
            "exposed_fraction_max_grad_norm_world1", "exposed_fraction_user_clip_world1",
            "llama_exposed_fraction_world1")
    if case == "balance":
        return tuple(f"{f.name}_S{s}_{b}_max_over_mean" for f in _FAMILIES for s in _DOMAINS for b in ("lpt", "rr"))
    if case == "surplus":
        return ("single_over_team_world2", "idle_over_duplicate_last_wave_world2", "idle_over_team_last_wave_world2",
                "sim_70b_idle_exposed_fraction",
                "sim_70b_best_exposed_fraction")
    if case == "memory":
        return tuple(f"{v}_peak_over_min_world{w}" for w in (1, 2) for v in ("overlap", "sync", "duplicated")) + (
            "overlap_peak_over_torch_muon_world1",)
    if case == "peers":
        from .bench_peers import RATIO_KEYS

        return RATIO_KEYS
    raise ValueError(f"unknown bench case {case!r}; known: {', '.join(CASES)}")


# ----------------------------------------------------------------------------------------------------------------
# Options, results, timing helpers
# ----------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class _Options:
    quick: bool
    """Small sizes and few repeats (the CI smoke run)."""
    repeats: int | None
    """Timed repeats per variant; ``None`` takes the case's default."""
    baseline: bool
    """Measure baselines (``--no-baseline`` turns them off, for profiling our path alone)."""
    trace_dir: str
    """Where traces, timelines and flame graphs go."""
    timeout_s: float
    """Hard wall-clock limit of one multi-rank spawn, seconds."""

    def reps(self, quick: int, full: int) -> int:
        return self.repeats if self.repeats is not None else (quick if self.quick else full)


@dataclass
class _CaseResult:
    title: str
    ratios: dict[str, float | None]
    lines: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


def _median(xs: Sequence[float]) -> float:
    return float(statistics.median(xs)) if xs else math.nan


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:9.2f} ms"


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (as a rank runs), restoring the count after."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or not den or math.isnan(num) or math.isnan(den):
        return None
    return float(num) / float(den)


def machine_info() -> dict[str, Any]:
    """What the numbers were measured on: CPU model (``/proc/cpuinfo``), cores, torch, Python, load."""
    cpu, flags = None, ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, val = line.partition(":")
                if key.strip() == "model name" and cpu is None:
                    cpu = val.strip()
                elif key.strip() == "flags" and not flags:
                    flags = val
    except OSError:
        pass
    cpu = cpu or platform.processor() or platform.machine()
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        usable = os.cpu_count() or 1
    simd = [x for x in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f" {x} " in f" {flags} "]
    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {
        "cpu_model": cpu,
        "cpu_simd": simd,
        "logical_cpus": os.cpu_count(),
        "usable_cpus": usable,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cuda": torch.cuda.is_available(),
        "load_average_at_start": load,
    }


def _two_thread_speedup(seconds: float = 0.3) -> float:
    """How many cores two compute threads get right now: work rate of two threads over one, in [0, 2] (2.0: two
    idle cores).

    Each thread runs 1-thread bf16 ``(256, 256)`` matmuls (torch releases the GIL inside them). Rounds of "one
    thread, then two threads" alternate and the median round counts, so a change of the machine's load during
    the check moves it little. On a shared machine other processes take cores, which is what the overlap case's
    spare-core assumption depends on.
    """
    a = torch.randn(256, 256).bfloat16()

    def work(n: int) -> None:
        for _ in range(n):
            torch.mm(a, a)

    with _threads(1):
        work(10)
        n, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 10:
            work(10)
            n += 10
        rounds = []
        for _ in range(3):
            t0 = time.perf_counter()
            work(n)
            one = time.perf_counter() - t0
            th = [threading.Thread(target=work, args=(n,)) for _ in range(2)]
            t0 = time.perf_counter()
            for x in th:
                x.start()
            for x in th:
                x.join()
            rounds.append(2 * one / (time.perf_counter() - t0))
    return min(2.0, _median(rounds))


# ----------------------------------------------------------------------------------------------------------------
# Spawning gloo ranks
# ----------------------------------------------------------------------------------------------------------------

# A forkserver child launched from `python -m overlap_muon.apps.bench` re-runs this module as its __mp_main__ while the
# preloaded copy is already in sys.modules; runpy then warns that this "may result in unpredictable behaviour".
# Nothing here depends on __main__ (spawned functions are pickled by their overlap_muon.apps.bench names), so the
# warning is noise in every rank's output. The filter is inherited by the children through the forkserver.
warnings.filterwarnings(
    "ignore", message=r"'overlap_muon\.bench' found in sys\.modules", category=RuntimeWarning, module="runpy"
)


def _run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or the group ran past
            ``timeout_s`` seconds (the ranks still alive are killed).
    """
    res = spawn_ranks(fn, world, *args, timeout=timeout_s, pg_timeout=max(10.0, timeout_s))
    errors = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in enumerate(res) if not ok]
    if errors:
        raise RuntimeError(f"{fn.__name__} on {world} ranks failed:\n" + "\n".join(errors))
    return [payload for _, payload in res]


# ----------------------------------------------------------------------------------------------------------------
# Shared model pieces
# ----------------------------------------------------------------------------------------------------------------


def _transformer_layer(d: int, mlp: int = 4) -> list[tuple[str, tuple[int, int], int]]:
    """``(name, full (P, Q), TP partition_dim)`` of one layer's Muon matrices (Megatron layout)."""
    return [
        ("q", (d, d), 0),
        ("k", (d, d), 0),
        ("v", (d, d), 0),
        ("o", (d, d), 1),
        ("up", (mlp * d, d), 0),
        ("down", (d, mlp * d), 1),
    ]


def _shard_net(specs: Sequence[tuple[tuple[int, int], int | None]], R: int, T: int, g: int, t: int,
               seed: int) -> nn.Module:
    """A module holding one plain local shard per spec, with ``partition_dim``/``full_shape`` and a gradient set."""
    gen = torch.Generator().manual_seed(seed)
    net = nn.Module()
    params = nn.ParameterList()
    for full, pd in specs:
        shape = block_shape(full, pd, R, T, g, t)
        p = nn.Parameter(torch.randn(shape, generator=gen) / math.sqrt(full[1]))
        p.partition_dim = pd
        p.full_shape = full
        p.grad = torch.randn(shape, generator=gen)
        params.append(p)
    net.params = params
    return net


def _domain_groups(R: int, T: int, g: int, t: int) -> tuple[Any, Any]:
    """Explicit TP (ranks sharing ``g``) and remat (ranks sharing ``t``) groups; every rank creates all of them."""
    tp = [dist.new_group([gg * T + tt for tt in range(T)]) for gg in range(R)] if T > 1 else None
    rm = [dist.new_group([gg * T + tt for gg in range(R)]) for tt in range(T)] if R > 1 else None
    return (tp[g] if tp else None), (rm[t] if rm else None)


def _timed_steps(opts: dict[str, Any], warmup: int, repeats: int, barrier: bool) -> dict[str, list[float]]:
    """Interleaved step timings, seconds: ``warmup`` untimed rounds, then ``repeats`` rounds over every optimizer
    (the order rotates each round)."""
    names = list(opts)
    out: dict[str, list[float]] = {n: [] for n in names}
    for r in range(warmup + repeats):
        rot = names[r % len(names):] + names[: r % len(names)]
        for n in rot:
            if barrier:
                dist.barrier()
            t0 = time.perf_counter()
            opts[n].step()
            dt = time.perf_counter() - t0
            if r >= warmup:
                out[n].append(dt)
    return out


def _max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's time (a collective step ends when its last rank ends)."""
    return [max(xs) for xs in zip(*per_rank)]


# ----------------------------------------------------------------------------------------------------------------
# Case: step
# ----------------------------------------------------------------------------------------------------------------


def _step_rank(rank: int, world: int, layers: int, d: int, warmup: int, repeats: int) -> dict[str, Any]:
    T = world
    tp = dist.new_group(list(range(world))) if world > 1 else None
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    optimizers = {}
    for mode in ("layer_sharded", "duplicated"):
        net = _shard_net(specs, 1, T, 0, rank, seed=100 + rank)
        optimizers[mode] = OverlapMuon(net, tp_group=tp, mode=mode, overlap=False, muon_filter=_muon_2d, **_HP)
    times = _timed_steps(optimizers, warmup, repeats, barrier=True)
    ns = {m: o.stats["ns_matrices"] / max(1, o.stats["steps"]) for m, o in optimizers.items()}
    for o in optimizers.values():
        o.close()
    return {"times": times, "ns_matrices_per_step": ns}


def _case_step(o: _Options) -> _CaseResult:
    layers = 2 if o.quick else 12
    d, world = 256, 2
    warmup, repeats = (1, o.reps(5, 15))
    res = _run_ranks(_step_rank, world, layers, d, warmup, repeats, timeout_s=o.timeout_s)
    med = {m: _median(_max_over_ranks([r["times"][m] for r in res])) for m in ("layer_sharded", "duplicated")}
    ratio = _ratio(med["duplicated"], med["layer_sharded"])
    n = 6 * layers
    title = (f"optimizer step (overlap off), {layers}-layer transformer d_model {d} MLP 4x ({n} matrices), "
             f"world {world} (1x{world} TP, plain shards + explicit groups)")
    lines = []
    for m in ("layer_sharded", "duplicated"):
        per_rank = [r["ns_matrices_per_step"][m] for r in res]
        lines.append(f"{m:<16}{_ms(med[m])}   (median of {repeats}; NS on {per_rank} matrices per rank per step)")
    lines.append(f"duplicated / layer_sharded = {ratio:.3f}" if ratio else "ratio unavailable")
    return _CaseResult(
        title,
        {"duplicated_over_layer_sharded": ratio},
        lines,
        {"layers": layers, "d_model": d, "world": world, "matrices": n, "repeats": repeats, "median_s": med,
         "ns_matrices_per_rank_per_step": {m: [r["ns_matrices_per_step"][m] for r in res] for m in med},
         "samples_s": {m: _max_over_ranks([r["times"][m] for r in res]) for m in med}},
    )


# ----------------------------------------------------------------------------------------------------------------
# Case: overhead
# ----------------------------------------------------------------------------------------------------------------

#: The 8 small shapes of the overhead case (wide, tall, square; several sizes).
_SMALL_SHAPES = ((16, 16), (16, 32), (32, 16), (32, 32), (8, 48), (48, 8), (24, 24), (12, 36))


def _case_overhead(o: _Options) -> _CaseResult:
    n = 3000
    warmup, repeats = 1, o.reps(3, 9)
    specs = [(_SMALL_SHAPES[i % len(_SMALL_SHAPES)], None) for i in range(n)]
    with _threads(1):
        # One model per optimizer (same values and gradients): one live OverlapMuon drives a model at a time.
        def net() -> nn.Module:
            return _shard_net(specs, 1, 1, 0, 0, seed=7)

        optimizers: dict[str, Any] = {
            "overlap_muon": OverlapMuon(net(), overlap=False, batch_ns=True, muon_filter=_muon_2d, **_HP),
        }
        if o.baseline:
            optimizers["overlap_muon_unbatched"] = OverlapMuon(
                net(), overlap=False, batch_ns=False, muon_filter=_muon_2d, **_HP
            )
            optimizers["torch_muon"] = torch.optim.Muon(net().parameters(), **_HP)
        times = _timed_steps(optimizers, warmup, repeats, barrier=False)
        ns_calls = optimizers["overlap_muon"].stats["ns_calls"] / max(1, optimizers["overlap_muon"].stats["steps"])
        for k, opt in optimizers.items():
            if isinstance(opt, OverlapMuon):
                opt.close()
    med = {k: _median(v) for k, v in times.items()}
    r1 = _ratio(med.get("torch_muon"), med["overlap_muon"])
    r2 = _ratio(med.get("torch_muon"), med.get("overlap_muon_unbatched"))
    lines = [f"{k:<24}{_ms(v)}   (median of {repeats})" for k, v in med.items()]
    lines.append(f"OverlapMuon zeropower calls per step: {ns_calls:g} (shape batching), torch.optim.Muon: {n}")
    if r1 is not None:
        lines.append(f"torch_muon / overlap_muon = {r1:.3f};  torch_muon / overlap_muon_unbatched = {r2:.3f}")
    else:
        lines.append("baseline not measured (--no-baseline)")
    return _CaseResult(
        f"host overhead: {n} small matrices of {len(_SMALL_SHAPES)} shapes, world 1, overlap off",
        {"torch_muon_over_overlap_muon": r1, "torch_muon_over_overlap_muon_unbatched": r2},
        lines,
        {"matrices": n, "shapes": [list(s) for s in _SMALL_SHAPES], "repeats": repeats, "median_s": med,
         "zeropower_calls_per_step": ns_calls, "samples_s": times},
    )


# ----------------------------------------------------------------------------------------------------------------
# Case: ns
# ----------------------------------------------------------------------------------------------------------------


def _bmm_like_ns(x: Tensor, steps: int) -> Tensor:
    """The matmuls of ``steps`` NS iterations on a ``(b, m, n)`` stack (``m <= n``), nothing else."""
    for _ in range(steps):
        a = torch.bmm(x, x.mT)
        b = torch.bmm(a, a)
        x = torch.bmm(b, x)
    return x


def _case_ns(o: _Options) -> _CaseResult:
    # The step case's matrices as the runtime batches them by shape (square, wide, tall).
    batches = ((8, 256, 256), (4, 1024, 256), (4, 256, 1024)) if o.quick else (
        (48, 256, 256), (12, 1024, 256), (12, 256, 1024))
    warmup, repeats = 1, o.reps(3, 7)
    steps = 5
    rows, tot_flops, tot_ns, tot_bmm = [], 0, 0.0, 0.0
    gen = torch.Generator().manual_seed(3)
    with _threads(1):
        for b, P, Q in batches:
            x = torch.randn(b, P, Q, generator=gen).bfloat16()
            m, k = min(P, Q), max(P, Q)
            y = torch.randn(b, m, k, generator=gen).bfloat16() / math.sqrt(m * k)
            t_ns, t_bmm = [], []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                zeropower(x, ns_steps=steps)
                t1 = time.perf_counter()
                _bmm_like_ns(y, steps)
                t2 = time.perf_counter()
                if r >= warmup:
                    t_ns.append(t1 - t0)
                    t_bmm.append(t2 - t1)
            flops = b * ns_flops((P, Q), steps)
            mn, mb = _median(t_ns), _median(t_bmm)
            rows.append({"batch": b, "shape": [P, Q], "flops": flops, "ns_s": mn, "bmm_s": mb,
                         "ns_flops_per_s": flops / mn, "bmm_flops_per_s": flops / mb})
            tot_flops += flops
            tot_ns += mn
            tot_bmm += mb
    ratio = _ratio(tot_bmm, tot_ns)
    lines = [
        f"({r['batch']:>2}, {r['shape'][0]:>4}, {r['shape'][1]:>4})  NS {r['ns_flops_per_s'] / 1e9:7.1f} GFLOP/s"
        f"   bmm {r['bmm_flops_per_s'] / 1e9:7.1f} GFLOP/s   ratio {r['bmm_s'] / r['ns_s']:.3f}"
        for r in rows
    ]
    lines.append(f"all shapes: NS {tot_flops / tot_ns / 1e9:.1f} GFLOP/s over bmm {tot_flops / tot_bmm / 1e9:.1f}"
                 f" GFLOP/s = {ratio:.3f}")
    syrk_rows, syrk_ratio = _syrk_vs_plain(o, steps)
    lines.append(f"symmetric Gram (syrk, block {SYRK_BLOCK}) vs plain NS, one matrix, 1 thread:")
    for r in syrk_rows:
        lines.append(f"  {r['shape'][0]:>4}x{r['shape'][1]:<4}  plain {r['plain_flops_per_s'] / 1e9:7.1f} GFLOP/s  "
                     f"syrk {r['syrk_flops_per_s'] / 1e9:7.1f} GFLOP/s  ratio {r['plain_s'] / r['syrk_s']:.3f}  "
                     f"bitwise {r['bitwise']}  max abs {r['max_abs_diff']:.3g}  rel {r['rel_fro_diff']:.3g}")
    lines.append(f"all shapes: syrk / plain FLOP/s = {syrk_ratio:.3f}" if syrk_ratio else "syrk ratio unavailable")
    return _CaseResult(
        "batched Newton-Schulz FLOP/s vs plain torch.bmm (bf16, same matmuls), 1 thread; symmetric Gram vs plain NS",
        {"ns_over_bmm": ratio, "syrk_over_plain": syrk_ratio},
        lines,
        {"ns_steps": steps, "repeats": repeats, "threads": 1, "shapes": rows,
         "ns_flops_per_s": tot_flops / tot_ns, "bmm_flops_per_s": tot_flops / tot_bmm,
         "syrk": {"block": SYRK_BLOCK, "shapes": syrk_rows}},
    )


def _syrk_flops(shape: tuple[int, int], steps: int, block: int) -> int:
    """FLOPs ``zeropower(syrk=True)`` executes: block rows of ``X Xᵀ`` and ``A @ A``, the full ``B @ X``."""
    m, n = min(shape), max(shape)
    rows = sum(m - i for i in range(0, m, block)) if block < m else m * m  # entries of the upper block rows
    return steps * (2 * rows * n + 2 * rows * m + 2 * m * m * n)


def _syrk_vs_plain(o: _Options, steps: int) -> tuple[list[dict[str, Any]], float | None]:
    """Time ``zeropower`` with and without ``syrk`` on one matrix per shape, interleaved; compare the results."""
    shapes = ((256, 256), (256, 1024), (512, 512)) if o.quick else ((1024, 1024), (2048, 8192), (4096, 4096))
    warmup, repeats = 1, o.reps(2, 3)
    gen = torch.Generator().manual_seed(13)
    rows, tot_plain, tot_syrk, tot_flops = [], 0.0, 0.0, 0
    with _threads(1):
        for P, Q in shapes:
            x = torch.randn(P, Q, generator=gen)
            t_plain, t_syrk = [], []
            for r in range(warmup + repeats):
                t0 = time.perf_counter()
                plain = zeropower(x, ns_steps=steps)
                t1 = time.perf_counter()
                sym = zeropower(x, ns_steps=steps, syrk=True)
                t2 = time.perf_counter()
                if r >= warmup:
                    t_plain.append(t1 - t0)
                    t_syrk.append(t2 - t1)
            flops = ns_flops((P, Q), steps)
            mp, ms = _median(t_plain), _median(t_syrk)
            diff = (sym.float() - plain.float()).abs()
            rows.append({"shape": [P, Q], "flops": flops, "syrk_flops_executed": _syrk_flops((P, Q), steps, SYRK_BLOCK),
                         "plain_s": mp, "syrk_s": ms, "plain_flops_per_s": flops / mp, "syrk_flops_per_s": flops / ms,
                         "bitwise": bool(torch.equal(sym, plain)), "max_abs_diff": float(diff.max()),
                         "rel_fro_diff": float(diff.norm() / plain.float().norm())})
            tot_plain += mp
            tot_syrk += ms
            tot_flops += flops
    return rows, _ratio(tot_plain, tot_syrk)


# ----------------------------------------------------------------------------------------------------------------
# Case: comm
# ----------------------------------------------------------------------------------------------------------------

#: Collectives the counter wraps; the runtime's exchanges use the first ones.
_COUNTED = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all",
            "all_reduce", "broadcast", "reduce_scatter_tensor", "barrier")


#: The collectives that move optimizer data (the runtime's per-wave gradient-presence check, run by overlap-mode
#: waves, is a one-byte-per-matrix all_to_all_single on a gloo group; a synchronous step folds it into step()'s
#: agreement, which the comm case counts apart).
_DATA_OPS = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_to_all")


class _CommCounter:
    """Wraps ``torch.distributed`` collectives in this process: calls, input bytes and bytes leaving the rank.

    Only the outermost call counts (``all_gather_into_tensor`` calls ``all_gather_single`` inside torch), and only
    while :attr:`enabled`. Thread safe: the runtime's lanes issue collectives from worker threads.
    """

    def __init__(self) -> None:
        self.enabled = False
        self._lock = threading.Lock()
        self._local = threading.local()
        self._orig: dict[str, Callable[..., Any]] = {}
        self.agreement_groups: set[int] = set()  # ids of the groups step()'s agreement runs on (counted apart)
        self.reset()

    def reset(self) -> None:
        self.calls: dict[str, int] = {}
        self.input_bytes = 0
        self.sent_bytes = 0
        self.data_sent_bytes = 0  # moved by the data collectives (all_to_all / all_gather), not control flags
        self.agreement_sent_bytes = 0  # step()'s host-side agreement (stale waves, gradient presence), kept apart

    def install(self) -> None:
        for name in _COUNTED:
            fn = getattr(dist, name, None)
            if fn is not None and name not in self._orig:
                self._orig[name] = fn
                setattr(dist, name, self._wrap(name, fn))

    def uninstall(self) -> None:
        for name, fn in self._orig.items():
            setattr(dist, name, fn)
        self._orig.clear()

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        sig = inspect.signature(fn)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth = getattr(self._local, "depth", 0)
            if self.enabled and depth == 0:
                self._count(name, sig.bind(*args, **kwargs).arguments)
            self._local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._local.depth = depth

        return wrapper

    def _count(self, name: str, a: dict[str, Any]) -> None:
        group = a.get("group")
        if group is not None and id(group) in self.agreement_groups:
            x = a.get("input")
            with self._lock:
                self.agreement_sent_bytes += 0 if x is None else x.numel() * x.element_size() * (1 - 1 / dist.get_world_size(group))
            return
        size = dist.get_world_size(group) if name != "barrier" else 1
        nbytes, sent = 0, 0
        if name == "all_to_all_single":
            x = a["input"]
            nbytes = x.numel() * x.element_size()
            splits = a.get("input_split_sizes")
            me = dist.get_rank(group)
            if splits:
                row = nbytes // max(1, x.shape[0]) if x.shape[0] else 0
                sent = nbytes - splits[me] * row
            else:
                sent = nbytes - nbytes // size
        elif name in ("all_gather_single", "all_gather_into_tensor", "all_gather"):
            x = a.get("input_tensor", a.get("tensor"))
            nbytes = x.numel() * x.element_size()
            sent = nbytes * (size - 1)
        elif name == "all_to_all":
            xs = a["input_tensor_list"]
            nbytes = sum(x.numel() * x.element_size() for x in xs)
            me = dist.get_rank(group)
            sent = nbytes - xs[me].numel() * xs[me].element_size()
        else:
            x = a.get("tensor")
            if isinstance(x, Tensor):
                nbytes = sent = x.numel() * x.element_size()
        with self._lock:
            self.calls[name] = self.calls.get(name, 0) + 1
            self.input_bytes += nbytes
            self.sent_bytes += sent
            if name in _DATA_OPS:
                self.data_sent_bytes += sent


def _comm_rank(rank: int, world: int, R: int, T: int, layers: int, d: int, steps: int) -> dict[str, Any]:
    g, t = divmod(rank, T)
    tp, rm = _domain_groups(R, T, g, t)
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    # Data movement alone (gradient-presence check off), then the default configuration (its presence agreement
    # is step()'s, counted apart).
    configs = {
        "fused": dict(mode="layer_sharded", fused_a2a=True, check_grad_presence=False),
        "two_stage": dict(mode="layer_sharded", fused_a2a=False, check_grad_presence=False),
        "duplicated": dict(mode="duplicated", check_grad_presence=False),
        "fused_checked": dict(mode="layer_sharded", fused_a2a=True),
    }
    optimizers = {}
    shard_bytes = 0
    for name, kw in configs.items():
        net = _shard_net(specs, R, T, g, t, seed=200 + rank)
        shard_bytes = sum(p.numel() for p in net.parameters()) * 2  # bf16 on the wire
        optimizers[name] = OverlapMuon(net, tp_group=tp, remat_group=rm, overlap=False, muon_filter=_muon_2d,
                                       **kw, **_HP)
    counter = _CommCounter()
    counter.agreement_groups = {id(o._pipeline.ctrl_group) for o in optimizers.values() if o._pipeline.ctrl_group}
    out: dict[str, Any] = {"shard_bytes": shard_bytes}
    counter.install()
    try:
        for name, opt in optimizers.items():
            opt.step()  # warm-up: plans and groups are built
            counter.reset()
            counter.enabled = True
            for _ in range(steps):
                opt.step()
            counter.enabled = False
            out[name] = {
                "calls_per_step": {k: v / steps for k, v in counter.calls.items()},
                "input_bytes_per_step": counter.input_bytes / steps,
                "sent_bytes_per_step": counter.sent_bytes / steps,
                "data_sent_bytes_per_step": counter.data_sent_bytes / steps,
                "agreement_sent_bytes_per_step": counter.agreement_sent_bytes / steps,
            }
    finally:
        counter.uninstall()
        for opt in optimizers.values():
            opt.close()
    return out


def _case_comm(o: _Options) -> _CaseResult:
    R, T = 2, 2
    S = R * T
    layers, d, steps = (2 if o.quick else 4), 64, 2
    res = _run_ranks(_comm_rank, S, R, T, layers, d, steps, timeout_s=o.timeout_s)
    shard = [r["shard_bytes"] for r in res]
    # Ideal per rank, as an exact fraction of integers: 2 * (S - 1) * shard_bytes / S, averaged over ranks.
    ideal_mean = 2 * (S - 1) * sum(shard) / S / S
    ratios, lines, det = {}, [], {"R": R, "T": T, "layers": layers, "d_model": d,
                                  "matrices": 6 * layers, "shard_bytes_per_rank": shard,
                                  "ideal_bytes_per_rank_per_step": ideal_mean}
    lines.append(f"ideal 2*(1-1/S)*shard_bytes = {ideal_mean:,.0f} B per rank per step (S = {S}, "
                 f"shard_bytes {shard[0]:,} B in bf16)")
    for name, key in (("fused", "fused_bytes_over_ideal"), ("two_stage", "two_stage_bytes_over_ideal"),
                      ("duplicated", "duplicated_bytes_over_ideal"),
                      ("fused_checked", "fused_default_bytes_over_ideal")):
        sent = [r[name]["data_sent_bytes_per_step"] for r in res]
        mean = sum(sent) / S
        calls = res[0][name]["calls_per_step"]
        ndata = sum(v for op, v in calls.items() if op in _DATA_OPS)
        nctrl = sum(v for op, v in calls.items() if op not in _DATA_OPS)
        ratios[key] = _ratio(mean, ideal_mean)
        det[name] = {"sent_bytes_per_rank_per_step": sent, "mean_sent_bytes": mean,
                     "all_sent_bytes_per_rank_per_step": [r[name]["sent_bytes_per_step"] for r in res],
                     "input_bytes_per_rank_per_step": [r[name]["input_bytes_per_step"] for r in res],
                     "collectives_per_step": ndata, "control_collectives_per_step": nctrl,
                     "calls_per_step_by_op": calls}
        lines.append(f"{name:<11} {mean:>12,.0f} B sent per rank per step  (per rank {[int(s) for s in sent]}), "
                     f"{ndata:g} collectives (+{nctrl:g} other) per step {calls}; "
                     f"/ ideal = {ratios[key]:.4f}")
    return _CaseResult(f"bytes and collectives per rank per step, {R}x{T} domain (world {S}), overlap off",
                       ratios, lines, det)


# ----------------------------------------------------------------------------------------------------------------
# Case: overlap
# ----------------------------------------------------------------------------------------------------------------


class _CopyToTP(torch.autograd.Function):
    """Megatron's ``f``: identity forward, all-reduce of the input gradient over the TP group backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


class _ReduceFromTP(torch.autograd.Function):
    """Megatron's ``g``: all-reduce of the partial output forward, identity backward."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: Any) -> Tensor:
        x = x.contiguous().clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


class _ShardLinear(nn.Module):
    """``y = x @ W_local.T`` of a plain TP shard (colwise: rows of ``W``; rowwise: columns, partial output)."""

    def __init__(self, full: tuple[int, int], pd: int, T: int, t: int, gen: torch.Generator) -> None:
        super().__init__()
        w = torch.randn(full, generator=gen) / math.sqrt(full[1])
        rows, cols = block_shape(full, pd, 1, T, 0, t)
        block = w[t * rows:(t + 1) * rows] if pd == 0 else w[:, t * cols:(t + 1) * cols]
        self.weight = nn.Parameter(block.clone())
        self.weight.partition_dim = pd
        self.weight.full_shape = full

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight)


class _TPBlock(nn.Module):
    """A residual block: an attention-like pair ``(d, d)`` colwise + ``(d, d)`` rowwise, then an MLP ``(4d, d)``
    colwise + ``(d, 4d)`` rowwise, each behind an RMS norm; activations ``(N, d)`` are replicated over TP."""

    def __init__(self, d: int, T: int, t: int, group: Any, gen: torch.Generator) -> None:
        super().__init__()
        self.d, self.group = d, group
        self.a = _ShardLinear((d, d), 0, T, t, gen)
        self.b = _ShardLinear((d, d), 1, T, t, gen)
        self.up = _ShardLinear((4 * d, d), 0, T, t, gen)
        self.down = _ShardLinear((d, 4 * d), 1, T, t, gen)

    def _f(self, x: Tensor) -> Tensor:
        return x if self.group is None else _CopyToTP.apply(x, self.group)

    def _g(self, x: Tensor) -> Tensor:
        return x if self.group is None else _ReduceFromTP.apply(x, self.group)

    def forward(self, x: Tensor) -> Tensor:
        h = self.a(self._f(F.rms_norm(x, (self.d,))))
        x = x + self._g(self.b(F.gelu(h)))
        h = self.up(self._f(F.rms_norm(x, (self.d,))))
        return x + self._g(self.down(F.gelu(h)))

    @staticmethod
    def shapes(d: int) -> list[tuple[int, int]]:
        return [(d, d), (d, d), (4 * d, d), (d, 4 * d)]


def _tp_stack(d: int, blocks: int, T: int, t: int, group: Any) -> nn.Sequential:
    gen = torch.Generator().manual_seed(11)  # the same full weights on every rank and in every variant
    return nn.Sequential(*[_TPBlock(d, T, t, group, gen) for _ in range(blocks)])


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


def _overlap_rank(rank: int, world: int, d: int, blocks: int, tokens: int, rounds: int, chunk: int,
                  trace_path: str | None) -> dict[str, Any]:
    """Interleaved rounds of ``chunk`` iterations per variant (none / off / on) plus one NS sample per round, so
    the per-phase figures the simulator gets see the same machine load as the step times."""
    T, t = world, rank
    group = dist.new_group(list(range(world))) if world > 1 else None
    x = torch.randn(tokens, d, generator=torch.Generator().manual_seed(5))
    variants: dict[str, tuple[nn.Module, OverlapMuon | None]] = {}
    # on_clip: max_grad_norm biting every step (world 1: plain TP shards cannot be clipped by the runtime);
    # on_user_clip: torch's clip_grad_norm_ between backward and step(), biting: every wave re-runs in step().
    # async: async_step=True (step() returns before the updates land; the next forward waits per module).
    names = ("none", "off", "on", "async") + (("on_clip", "on_user_clip") if world == 1 else ())
    for name in names:
        net = _tp_stack(d, blocks, T, t, group)
        opt = None
        if name != "none":
            opt = OverlapMuon(net, tp_group=group, overlap=(name != "off"), muon_filter=_muon_2d,
                              max_grad_norm=_TINY_NORM if name == "on_clip" else None,
                              async_step=name == "async", **_HP)
        variants[name] = (net, opt)
    fwd_bwd: dict[str, list[float]] = {"forward": [], "backward": []}

    def iteration(name: str, record: bool) -> None:
        net, opt = variants[name]
        t0 = time.perf_counter()
        with torch.profiler.record_function("## forward ##"):
            loss = net(x).pow(2).mean()
        t1 = time.perf_counter()
        with torch.profiler.record_function("## backward ##"):
            loss.backward()
        t2 = time.perf_counter()
        with torch.profiler.record_function("## optimizer ##"):
            if name == "on_user_clip":
                torch.nn.utils.clip_grad_norm_(net.parameters(), _TINY_NORM)
            if opt is not None:
                opt.step()
                opt.zero_grad()
            else:
                net.zero_grad()
        if record and name == "none":
            fwd_bwd["forward"].append(t1 - t0)
            fwd_bwd["backward"].append(t2 - t1)

    def run_chunk(name: str, record: bool) -> float:
        """Seconds per iteration over ``chunk`` iterations, every launched wave applied at the end."""
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(chunk):
            iteration(name, record)
        opt = variants[name][1]
        if opt is not None:
            opt.synchronize()
        return (time.perf_counter() - t0) / chunk

    shapes: dict[tuple[int, int], int] = {}
    for p in variants["none"][0].parameters():
        shapes[tuple(p.full_shape)] = shapes.get(tuple(p.full_shape), 0) + 1
    names = list(variants) + ["ns"]
    times: dict[str, list[float]] = {n: [] for n in names}
    for n in names[:-1]:  # warm-up chunk
        run_chunk(n, False)
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
    """A Llama-shaped decoder stack at small scale: per layer RMS norm, causal GQA attention (q ``(256, d)``, k and
    v ``(128, d)``: 4 query heads and 2 KV heads of 64; o ``(d, 256)``), RMS norm, SwiGLU MLP (gate and up
    ``(688, d)``, down ``(d, 688)``); no biases, no norm weights (every param a Muon matrix). Input/output
    ``(B, S, d)`` float32."""

    def __init__(self, layers: int, d: int = 256) -> None:
        super().__init__()
        self.d = d
        self.layers = nn.ModuleList()
        for _ in range(layers):
            m = nn.Module()
            m.q, m.k, m.v = nn.Linear(d, 256, bias=False), nn.Linear(d, 128, bias=False), nn.Linear(d, 128, bias=False)
            m.o = nn.Linear(256, d, bias=False)
            m.gate, m.up = nn.Linear(d, 688, bias=False), nn.Linear(d, 688, bias=False)
            m.down = nn.Linear(688, d, bias=False)
            self.layers.append(m)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        for m in self.layers:
            h = F.rms_norm(x, (self.d,))
            q = m.q(h).view(B, S, 4, 64).transpose(1, 2)
            k = m.k(h).view(B, S, 2, 64).transpose(1, 2)
            v = m.v(h).view(B, S, 2, 64).transpose(1, 2)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + m.o(a.transpose(1, 2).reshape(B, S, 256))
            h = F.rms_norm(x, (self.d,))
            x = x + m.down(F.silu(m.gate(h)) * m.up(h))
        return x


def _overlap_llama_rank(rank: int, world: int, layers: int, batch: int, seq: int, rounds: int,
                        chunk: int) -> dict[str, Any]:
    """Interleaved rounds of ``chunk`` training iterations of :class:`_LlamaStack` with no optimizer, overlap off
    and overlap on (each round ends with ``synchronize()``); seconds per iteration and NS calls per step."""
    x = torch.randn(batch, seq, 256, generator=torch.Generator().manual_seed(5))
    variants: dict[str, tuple[nn.Module, OverlapMuon | None]] = {}
    for name in ("none", "off", "on"):
        with torch.random.fork_rng():
            torch.manual_seed(12)
            net = _LlamaStack(layers)
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


def _case_overlap(o: _Options) -> _CaseResult:
    d = 256
    blocks, tokens = (2, 512) if o.quick else (6, 1024)
    rounds, chunk = o.reps(3, 5), (2 if o.quick else 3)
    ratios: dict[str, float | None] = {}
    lines, det = [], {"d_model": d, "blocks": blocks, "tokens": tokens, "rounds": rounds, "iters_per_chunk": chunk,
                      "matrices": 4 * blocks}
    for world in (1, 2):
        trace = None
        if not o.quick and world == 1:
            trace = os.path.abspath(os.path.join(o.trace_dir, "bench_overlap_w1_trace.json"))
        speedup = _two_thread_speedup()
        res = _run_ranks(_overlap_rank, world, d, blocks, tokens, rounds, chunk, trace, timeout_s=o.timeout_s)
        med = {n: _median(_max_over_ranks([r["times"][n] for r in res])) for n in res[0]["times"]}
        frac = _ratio(med["on"] - med["none"], med["off"] - med["none"])
        async_frac = _ratio(med["async"] - med["none"], med["off"] - med["none"])
        ratios[f"async_exposed_fraction_world{world}"] = async_frac
        ratios[f"async_over_default_iteration_world{world}"] = _ratio(med["async"], med["on"])
        clip_lines = []
        for v, key in (("on_clip", "max_grad_norm"), ("on_user_clip", "user_clip")):
            if v in med:
                ratios[f"exposed_fraction_{key}_world{world}"] = _ratio(med[v] - med["none"], med["off"] - med["none"])
                clip_lines.append(f"         {key} biting every step: {_ms(med[v]).strip()} -> exposed fraction "
                                  f"{ratios[f'exposed_fraction_{key}_world{world}']:.3f}")
        sim = _simulate_exposed(d, blocks, world, res[0], speedup)
        sim_frac = sim["exposed_fraction"] if sim else None
        ratios[f"exposed_fraction_world{world}"] = frac
        ratios[f"sim_exposed_fraction_world{world}"] = sim_frac
        entry = {"median_s": med, "two_thread_speedup": speedup,
                 "measured": {k: v for k, v in res[0].items() if k not in ("times", "trace")},
                 "simulated": sim, "samples_s": {n: _max_over_ranks([r["times"][n] for r in res]) for n in med}}
        lines.append(f"world {world}: none {_ms(med['none'])}  off {_ms(med['off'])}  on {_ms(med['on'])}  "
                     f"async_step {_ms(med['async'])}  -> optimizer {_ms(med['off'] - med['none']).strip()}, "
                     f"exposed with overlap {_ms(med['on'] - med['none']).strip()} (default step) / "
                     f"{_ms(med['async'] - med['none']).strip()} (async_step)  (two threads got {speedup:.2f} cores)")
        lines.append(f"         exposed fraction: default {'-' if frac is None else format(frac, '.3f')}, async_step "
                     f"{'-' if async_frac is None else format(async_frac, '.3f')}; iteration async_step / default "
                     f"{'-' if async_frac is None else format(med['async'] / med['on'], '.3f')}")
        if sim_frac is not None and frac is not None:
            lines.append(f"         exposed fraction measured {frac:.3f}, simulator {sim_frac:.3f} "
                         f"(difference {sim_frac - frac:+.3f}; simulated optimizer "
                         f"{_ms(sim['exposed_no_overlap_s']).strip()} vs measured "
                         f"{_ms(med['off'] - med['none']).strip()})")
        else:
            lines.append(f"         exposed fraction measured {frac if frac is None else round(frac, 3)}; "
                         "simulator unavailable")
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
    res = _run_ranks(_overlap_llama_rank, 1, llama_layers, 4, 128 if o.quick else 256, rounds, chunk,
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


# ----------------------------------------------------------------------------------------------------------------
# Case: balance
# ----------------------------------------------------------------------------------------------------------------


def _case_balance(o: _Options) -> _CaseResult:
    ratios: dict[str, float | None] = {}
    lines = [f"{'model':<12}{'matrices':>9}{'S':>5}{'LPT max/mean':>14}{'RR max/mean':>13}{'bound':>8}"
             f"{'waves LPT':>11}{'waves RR':>10}"]
    det: dict[str, Any] = {}
    for fam in _FAMILIES:
        mats = fam.matrices()
        costs = [float(ns_flops(s)) for s in mats]
        det[fam.name] = {"source": fam.source, "matrices": len(mats), "ns_flops_per_step": sum(costs)}
        for S in _DOMAINS:
            lpt = load_report(costs, lpt_homes(costs, S), S)
            rr = load_report(costs, round_robin_homes(len(costs), S), S)
            # The best any assignment can do: max(heaviest matrix, mean).
            bound = max(max(costs), sum(costs) / S) / (sum(costs) / S)
            # The overlap plan (waves of S matrices in gradient-ready order, taper), total load per rank.
            order = list(reversed(range(len(mats))))
            wl = {}
            for bal in ("lpt", "round_robin"):
                homes = [0] * len(mats)
                for w in plan_waves(order, costs, S, wave_slots=S, balance=bal, taper=True):
                    for i, h in w.homes.items():
                        homes[i] = h
                wl[bal] = load_report(costs, homes, S).max_over_mean
            ratios[f"{fam.name}_S{S}_lpt_max_over_mean"] = lpt.max_over_mean
            ratios[f"{fam.name}_S{S}_rr_max_over_mean"] = rr.max_over_mean
            det[fam.name][f"S{S}"] = {"lpt_max_over_mean": lpt.max_over_mean, "rr_max_over_mean": rr.max_over_mean,
                                      "lower_bound": bound, "waves_lpt_max_over_mean": wl["lpt"],
                                      "waves_rr_max_over_mean": wl["round_robin"]}
            lines.append(f"{fam.name:<12}{len(mats):>9}{S:>5}{lpt.max_over_mean:>14.4f}{rr.max_over_mean:>13.4f}"
                         f"{bound:>8.4f}{wl['lpt']:>11.4f}{wl['round_robin']:>10.4f}")
    lines.append("bound = max(heaviest matrix, mean)/mean; waves: the overlap plan (S matrices per wave, taper)")
    return _CaseResult("NS load balance per rank, LPT vs round robin (planning only, ns_flops costs)", ratios, lines,
                       det)


# ----------------------------------------------------------------------------------------------------------------
# Case: surplus
# ----------------------------------------------------------------------------------------------------------------


def _surplus_rank(rank: int, world: int, shape: tuple[int, int], steps: int, warmup: int,
                  repeats: int) -> dict[str, Any]:
    group = dist.group.WORLD
    X = torch.randn(shape, generator=torch.Generator().manual_seed(17))  # the same matrix on every rank
    x = X.mT if shape[0] > shape[1] else X
    counts = team_row_counts(x.size(1), world)
    lo = sum(counts[:rank])
    times: dict[str, list[float]] = {"single_s": [], "team_s": [], "team_rows_s": [], "team_compute_s": []}
    single = team = rows = None
    split_poly = team_splits_poly(tuple(X.shape), world, CPU_GLOO)  # as the runtime decides on a CPU job
    xb = (x.bfloat16() / x.bfloat16().norm()).contiguous()
    xc = xb[:, lo : lo + counts[rank]].contiguous()
    gram = xc @ xc.mT
    for r in range(warmup + repeats):
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            single = zeropower(X, ns_steps=steps)
        dist.barrier()  # the other ranks wait: the single-rank latency is rank 0's
        t1 = time.perf_counter()
        team = team_zeropower_full(X, group, ns_steps=steps, split_poly=split_poly)
        dist.barrier()
        t2 = time.perf_counter()
        rows = team_zeropower_full(X, group, ns_steps=steps, split="rows")
        dist.barrier()
        t3 = time.perf_counter()
        # The column team's matmuls alone, every rank at once, no collectives: its compute under this machine's
        # contention.
        y, brows = xc, slice(sum(team_row_counts(x.size(0), world)[:rank]),
                             sum(team_row_counts(x.size(0), world)[: rank + 1]))
        for _ in range(steps):
            g = y @ y.mT
            if split_poly:  # this member's rows of b*A + c*A@A only (the all-gather is left out)
                torch.addmm(g[brows], g[brows], g, beta=-4.775, alpha=2.0315)
                y = torch.addmm(y, gram, y, beta=3.4445)
            else:
                y = torch.addmm(y, torch.addmm(gram, g, g, beta=-4.775, alpha=2.0315), y, beta=3.4445)
        dist.barrier()
        t4 = time.perf_counter()
        if r >= warmup:
            for k, v in zip(times, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                times[k].append(v)
    out: dict[str, Any] = dict(times, split_poly=split_poly)
    out.update(_last_wave_latency(rank, world, X, warmup, repeats))
    if rank == 0:
        for key, got in (("", team), ("rows_", rows)):
            diff = (got.float() - single.float()).abs()
            out.update({f"{key}bitwise": bool(torch.equal(got, single)), f"{key}max_abs_diff": float(diff.max()),
                        f"{key}rel_fro_diff": float(diff.norm() / single.float().norm())})
    return out


def _last_wave_latency(rank: int, world: int, X: Tensor, warmup: int, repeats: int) -> dict[str, Any]:
    """OverlapMuon on one matrix ``X`` row-sharded over a TP group of all ranks, ``overlap=False`` (one wave of one
    matrix: ``world - 1`` surplus homes), ``surplus="idle"`` vs ``"duplicate"`` vs ``"team"``, interleaved: seconds
    from ``step()`` to its last apply, per repeat; whether duplicate gives idle's params (``torch.equal``), and
    team's largest difference from them."""
    from .. import OverlapMuon

    group = dist.new_group(list(range(world)))
    nets, opts = {}, {}
    for policy in _POLICIES:
        net = torch.nn.Module()
        net.w = torch.nn.Parameter(block_of(X, rank, world).clone())
        net.w.partition_dim, net.w.full_shape = 0, tuple(X.shape)
        nets[policy] = net
        opts[policy] = OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=group, overlap=False, surplus=policy)
    times: dict[str, list[float]] = {p: [] for p in _POLICIES}
    for r in range(warmup + repeats):
        grad = block_of(torch.randn(X.shape, generator=torch.Generator().manual_seed(100 + r)), rank, world)
        for policy in _POLICIES:
            nets[policy].w.grad = grad.clone()
            dist.barrier()
            t0 = time.perf_counter()
            opts[policy].step()  # overlap=False: returns once applied
            dist.barrier()
            if r >= warmup:
                times[policy].append(time.perf_counter() - t0)
    same = torch.equal(nets["idle"].w.detach(), nets["duplicate"].w.detach())
    team_diff = float((nets["idle"].w.detach() - nets["team"].w.detach()).abs().max())
    used = all(opts[p]._pipeline.gathered for p in ("duplicate", "team"))
    for o in opts.values():
        o.close()
    return {**{f"last_wave_{p}_s": times[p] for p in _POLICIES}, "duplicate_equal": same,
            "team_max_abs_diff": team_diff, "surplus_used": used}


_POLICIES = ("idle", "duplicate", "team")


def block_of(x: Tensor, rank: int, world: int) -> Tensor:
    """Rank ``rank``'s row block of ``x`` over ``world`` ranks (``torch.chunk``)."""
    return torch.chunk(x, world, dim=0)[rank].contiguous()


def _case_surplus(o: _Options) -> _CaseResult:
    import dataclasses as _dc

    from overlap_muon.apps.simulate import SimConfig, simulate

    shape = (512, 2048) if o.quick else (2048, 8192)
    world, steps = 2, 5
    warmup, repeats = 1, o.reps(2, 5)
    res = _run_ranks(_surplus_rank, world, shape, steps, warmup, repeats, timeout_s=o.timeout_s)
    single = _median(_max_over_ranks([r["single_s"] for r in res]))
    team = _median(_max_over_ranks([r["team_s"] for r in res]))
    rows = _median(_max_over_ranks([r["team_rows_s"] for r in res]))
    compute = _median(_max_over_ranks([r["team_compute_s"] for r in res]))
    ratio = _ratio(single, team)
    ex = res[0]
    lw_idle = _median(_max_over_ranks([r["last_wave_idle_s"] for r in res]))
    lw_dup = _median(_max_over_ranks([r["last_wave_duplicate_s"] for r in res]))
    lw_team = _median(_max_over_ranks([r["last_wave_team_s"] for r in res]))
    lw_ratio, lw_team_ratio = _ratio(lw_idle, lw_dup), _ratio(lw_idle, lw_team)
    dup_equal = all(r["duplicate_equal"] for r in res)
    team_diff = max(r["team_max_abs_diff"] for r in res)
    used = all(r["surplus_used"] for r in res)
    base = SimConfig.for_model("llama3-70b", tp_size=8, remat_size=8, dp_size=16)
    sims = {(p, d): simulate(_dc.replace(base, surplus=p, dp_slots=d))
            for p in ("idle", "duplicate", "team", "auto") for d in (1, 4)}
    idle = sims[("idle", 1)]
    best_key = min(sims, key=lambda k: sims[k].exposed_overlap_s)
    best = sims[best_key]
    lines = [
        f"team NS of one {shape[0]}x{shape[1]} matrix, world {world} (gloo, 1 thread per rank): single rank "
        f"{_ms(single).strip()}, team by columns {_ms(team).strip()}, single / team = {ratio:.3f}; by rows "
        f"{_ms(rows).strip()}, single / rows = {_ratio(single, rows) or 0:.3f}" if ratio else "unavailable",
        f"the column team's matmuls alone (both ranks at once, no collectives) {_ms(compute).strip()}: the rest of "
        f"its time, {_ms(max(0.0, team - compute)).strip()}, is its {steps} Gram all-reduces"
        + (f", {steps} all-gathers of B" if ex["split_poly"] else "") + ", the norm and the final all-gather",
        f"team vs zeropower: by columns bitwise {ex['bitwise']}, max abs {ex['max_abs_diff']:.3g}, relative "
        f"Frobenius {ex['rel_fro_diff']:.3g}; by rows bitwise {ex['rows_bitwise']}, max abs "
        f"{ex['rows_max_abs_diff']:.3g}, relative Frobenius {ex['rows_rel_fro_diff']:.3g}",
        f"OverlapMuon, one {shape[0]}x{shape[1]} matrix over TP {world}, step() to last apply: surplus idle "
        f"{_ms(lw_idle).strip()}, duplicate {_ms(lw_dup).strip()}, team {_ms(lw_team).strip()}; idle / duplicate = "
        + (f"{lw_ratio:.3f}" if lw_ratio else "n/a") + ", idle / team = "
        + (f"{lw_team_ratio:.3f}" if lw_team_ratio else "n/a")
        + f"; duplicate's params equal idle's: {dup_equal}; team's max abs difference {team_diff:.3g}"
        + ("" if used else " (the plan kept a policy idle: no surplus work ran)"),
        "simulator, llama3-70b TP 8 x remat 8 x DP 16: exposed optimizer time per surplus policy",
    ]
    for (p, d), r in sims.items():
        lines.append(f"  {p:>9} dp_slots {d}: last wave {_ms(r.last_wave_latency_s).strip():>10}, exposed "
                     f"{_ms(r.exposed_overlap_s).strip():>10} = {100 * r.exposed_fraction_overlap:.2f}% of the step")
    return _CaseResult(
        "surplus slots: team NS latency vs one rank (the kernel), and the simulator's policies at 70B",
        {"single_over_team_world2": ratio, "idle_over_duplicate_last_wave_world2": lw_ratio,
         "idle_over_team_last_wave_world2": lw_team_ratio,
         "sim_70b_idle_exposed_fraction": idle.exposed_fraction_overlap,
         "sim_70b_best_exposed_fraction": best.exposed_fraction_overlap},
        lines,
        {"shape": list(shape), "world": world, "ns_steps": steps, "repeats": repeats, "single_s": single,
         "team_s": team, "team_rows_s": rows, "team_compute_s": compute,
         "rows_bitwise": ex["rows_bitwise"], "rows_rel_fro_diff": ex["rows_rel_fro_diff"],
         "last_wave_idle_s": lw_idle, "last_wave_duplicate_s": lw_dup,
         "last_wave_team_s": lw_team, "duplicate_equal": dup_equal, "team_max_abs_diff": team_diff,
         "surplus_used": used, "bitwise": ex["bitwise"], "max_abs_diff": ex["max_abs_diff"],
         "rel_fro_diff": ex["rel_fro_diff"], "sim_best": {"surplus": best_key[0], "dp_slots": best_key[1]},
         "sim": {f"{p}_dp{d}": {"last_wave_latency_s": r.last_wave_latency_s,
                                "exposed_overlap_s": r.exposed_overlap_s,
                                "exposed_fraction_overlap": r.exposed_fraction_overlap} for (p, d), r in sims.items()}},
    )


# ----------------------------------------------------------------------------------------------------------------
# Case: memory
# ----------------------------------------------------------------------------------------------------------------


def _peak_bytes(fn: Callable[[], None]) -> int:
    """Peak bytes of tensor storage created while ``fn`` runs and alive at the same time (this thread).

    A ``TorchDispatchMode`` sees every op; a storage returned by an op that did not receive it (not in place) is
    new: its bytes count from then until the storage is freed (``weakref.finalize`` on the storage fires when the
    last tensor or view of it dies). What existed before (params, gradients, optimizer state) is not counted.
    Dispatch modes are per thread, so run the optimizer with ``side_streams=False`` (lanes inline).
    """
    import weakref as _weakref

    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    state = {"live": 0, "peak": 0}
    lock = threading.Lock()

    def freed(n: int) -> None:
        with lock:
            state["live"] -= n

    class _Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            ins = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs)) if isinstance(x, Tensor)}
            for x in tree_leaves(out):
                if isinstance(x, Tensor) and x.device.type == "cpu":
                    st = x.untyped_storage()
                    ptr, n = st.data_ptr(), st.nbytes()
                    if ptr and ptr not in ins and not getattr(st, "_counted", False):
                        st._counted = True
                        _weakref.finalize(st, freed, n)
                        with lock:
                            state["live"] += n
                            state["peak"] = max(state["peak"], state["live"])
            return out

    with _Count():
        fn()
    return state["peak"]


def _min_wave_bytes(opt: OverlapMuon, rank_flat: int) -> int:
    """The floor of what a step must hold at once on this rank: a wave's bf16 shards out and back and the bf16 full
    matrices homed here, assembled and orthogonalized (duplicated mode: every matrix of the wave), plus the bf16
    update blocks of the earlier waves, which wait for ``step()`` to commit them; max over the waves, and at least
    every update block (all held at the commit)."""
    best = held = 0
    for w in opt.waves:
        total = 0
        for i in w.params:
            m = opt._muon[i]
            shard = local_tensor(m.param).numel()
            full = m.full_shape[0] * m.full_shape[1]
            home_here = opt.config.mode == "duplicated" or w.homes[i] == rank_flat
            if opt.domain.size == 1:  # no exchange: the bf16 NS input and output only
                total += 2 * 2 * full
            else:
                total += 2 * 2 * shard + (2 * 2 * full if home_here else 0)
        best = max(best, total + held)
        held += sum(2 * local_tensor(opt._muon[i].param).numel() for i in w.params)
    return max(best, held)


def _memory_rank(rank: int, world: int, layers: int, d: int) -> dict[str, Any]:
    R, T, g, t = 1, world, 0, rank
    specs = [(full, pd) for _ in range(layers) for _, full, pd in _transformer_layer(d)]
    tp, rm = _domain_groups(R, T, g, t) if world > 1 else (None, None)
    out: dict[str, Any] = {}
    variants = {"overlap": dict(overlap=True), "sync": dict(overlap=False),
                "duplicated": dict(overlap=False, mode="duplicated")}
    for name, kw in variants.items():
        net = _shard_net(specs, R, T, g, t, seed=1)
        grads = [p.grad for p in net.parameters()]
        opt = OverlapMuon(net, muon_filter=_muon_2d, tp_group=tp, remat_group=rm, side_streams=False, **_HP, **kw)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # manual gradients: no forward covers them (the fallback warning)
            def one_step() -> None:
                for p, gr in zip(net.parameters(), grads):
                    p.grad = gr
                opt.step()
                opt.synchronize()

            one_step()  # warm-up: plans, route caches, lane threads, allocator
            out[name] = _peak_bytes(one_step)
        out[f"{name}_min"] = _min_wave_bytes(opt, rank)
        opt.close()
    if world == 1:
        net = _shard_net(specs, R, T, g, t, seed=1)
        mu = torch.optim.Muon(net.parameters(), **_HP)
        mu.step()
        out["torch_muon"] = _peak_bytes(mu.step)
    out["min"] = {k: out.pop(f"{k}_min") for k in variants}
    return out


def _mib(x: int | None) -> str:
    return "n/a" if x is None else f"{x / 2**20:.2f} MiB"


def _case_memory(o: _Options) -> _CaseResult:
    layers, d = (2, 64) if o.quick else (4, 256)
    ratios: dict[str, float | None] = {}
    lines = [f"{layers} layers d {d} ({6 * layers} matrices): peak bytes a step allocates beyond params, gradients "
             "and optimizer state (rank 0; storages counted by a dispatch mode, lanes inline)"]
    det: dict[str, Any] = {"layers": layers, "d_model": d}
    for world in (1, 2):
        r = _run_ranks(_memory_rank, world, layers, d, timeout_s=o.timeout_s)[0]
        det[f"world{world}"] = r
        for v in ("overlap", "sync", "duplicated"):
            ratios[f"{v}_peak_over_min_world{world}"] = _ratio(r[v], r["min"][v])
        parts = "  ".join(f"{v} {_mib(r[v])} (min {_mib(r['min'][v])})" for v in ("overlap", "sync", "duplicated"))
        lines.append(f"world {world}: {parts}")
        if world == 1:
            ratios["overlap_peak_over_torch_muon_world1"] = _ratio(r["overlap"], r["torch_muon"])
            lines.append(f"         torch.optim.Muon on the same shards {_mib(r['torch_muon'])}")
    lines.append("min: one wave's exchange buffers and full matrices plus the update blocks earlier waves hold until "
                 "step() commits them")
    return _CaseResult("optimizer memory: peak per step vs the floor of the wave plan", ratios, lines, det)


# ----------------------------------------------------------------------------------------------------------------
# Case: peers (implemented in overlap_muon.apps.bench_peers, which needs torchtitan)
# ----------------------------------------------------------------------------------------------------------------


def _case_peers(o: _Options) -> _CaseResult:
    from .bench_peers import case_peers

    return case_peers(o)


_RUNNERS: dict[str, Callable[[_Options], _CaseResult]] = {
    "step": _case_step,
    "overhead": _case_overhead,
    "ns": _case_ns,
    "comm": _case_comm,
    "overlap": _case_overlap,
    "balance": _case_balance,
    "surplus": _case_surplus,
    "memory": _case_memory,
    "peers": _case_peers,
}


# ----------------------------------------------------------------------------------------------------------------
# py-spy, CLI
# ----------------------------------------------------------------------------------------------------------------


def _py_spy(o: _Options) -> dict[str, Any]:
    """Record a flame graph of the overhead case's OverlapMuon step (no baseline) with py-spy, if installed."""
    exe = shutil.which("py-spy")
    if exe is None:
        msg = ("py-spy is not installed, so no flame graph was recorded; install it with `pip install py-spy` "
               "(or the project's [profile] extra) and rerun with --py-spy")
        print(msg)
        return {"ok": False, "message": msg}
    out = os.path.join(o.trace_dir, "overhead_flame.svg")
    os.makedirs(o.trace_dir, exist_ok=True)
    cmd = [exe, "record", "--output", out, "--format", "flamegraph", "--rate", "250", "--",
           sys.executable, "-m", "overlap_muon.apps.bench", "--cases", "overhead", "--no-baseline",
           "--repeats", "5" if o.quick else "20"]
    print("recording: " + " ".join(cmd))
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=o.timeout_s)
    except subprocess.TimeoutExpired:
        msg = f"py-spy ran past {o.timeout_s:.0f} s and was stopped; no flame graph"
        print(msg)
        return {"ok": False, "message": msg}
    if proc.returncode != 0 or not os.path.exists(out):
        tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-5:]
        msg = f"py-spy failed (exit {proc.returncode}): " + " | ".join(tail)
        print(msg)
        return {"ok": False, "message": msg}
    print(f"flame graph of the OverlapMuon dispatch path: {out}")
    return {"ok": True, "svg": out}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="overlap-muon-bench",
        description="Benchmarks of overlap-muon; each case measures our path and its baseline in the same run.",
        epilog="Every case and ratio is described in the module docstring (pydoc overlap_muon.apps.bench).",
    )
    ap.add_argument("--quick", action="store_true", help="small sizes and few repeats (about a minute on 2 cores)")
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated subset of {','.join(CASES)}")
    ap.add_argument("--json", metavar="PATH", help="write every figure, ratio and the machine description here")
    ap.add_argument("--repeats", type=int, default=None, help="timed repeats per variant (default: per case)")
    ap.add_argument("--no-baseline", action="store_true", help="overhead case: time our step only (what --py-spy records)")
    ap.add_argument("--py-spy", action="store_true", help="also record a flame graph of the overhead case's step")
    ap.add_argument("--trace-dir", default="traces", help="where traces, timelines and flame graphs go (%(default)s)")
    ap.add_argument("--timeout", type=float, default=600.0, help="hard limit of one multi-rank spawn, s (%(default)s)")
    return ap


def _header(info: dict[str, Any], o: _Options) -> str:
    return (f"overlap-muon bench ({'quick' if o.quick else 'full'}): {info['cpu_model']} "
            f"[{' '.join(info['cpu_simd'])}], {info['usable_cpus']}/{info['logical_cpus']} CPUs usable, "
            f"torch {info['torch']}, Python {info['python']}, load average {info['load_average_at_start']}, "
            f"two compute threads get {info['two_thread_speedup_at_start']:.2f} cores")


def main(argv: list[str] | None = None) -> int:
    """Run the selected cases, print a table, optionally write JSON; return 0, or 1 if any case failed.

    Raises:
        SystemExit: bad arguments (argparse), e.g. an unknown case name.
    """
    ap = _parser()
    args = ap.parse_args(argv)
    names = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in names if c not in CASES]
    if unknown or not names:
        ap.error(f"--cases: unknown {unknown or 'empty list'}; choose from {','.join(CASES)}")
    if args.repeats is not None and args.repeats < 1:
        ap.error(f"--repeats must be >= 1, got {args.repeats}")
    if not args.timeout > 0:
        ap.error(f"--timeout must be > 0 seconds, got {args.timeout}")
    o = _Options(quick=args.quick, repeats=args.repeats, baseline=not args.no_baseline, trace_dir=args.trace_dir,
                 timeout_s=args.timeout)
    info = machine_info()
    info["two_thread_speedup_at_start"] = round(_two_thread_speedup(), 3)
    print(_header(info, o), flush=True)
    t_all = time.perf_counter()
    report: dict[str, Any] = {"schema": 1, "machine": info, "quick": o.quick, "cases": {}, "ratios": {}}
    failed = []
    for name in names:
        t0 = time.perf_counter()
        try:
            res = _RUNNERS[name](o)
        except Exception as e:  # noqa: BLE001 - one failing case must not hide the others' figures
            failed.append(name)
            print(f"\n== {name}: FAILED ({type(e).__name__})\n{e}", flush=True)
            report["cases"][name] = {"error": f"{type(e).__name__}: {e}",
                                     "ratios": {k: None for k in expected_ratio_keys(name)}}
            for k in expected_ratio_keys(name):
                report["ratios"][f"{name}.{k}"] = None
            continue
        dt = time.perf_counter() - t0
        print(f"\n== {name}: {res.title}  [{dt:.1f} s]", flush=True)
        for line in res.lines:
            print("   " + line)
        report["cases"][name] = {"title": res.title, "elapsed_s": dt, "ratios": res.ratios, "details": res.details}
        for k in expected_ratio_keys(name):
            report["ratios"][f"{name}.{k}"] = res.ratios.get(k)
    if args.py_spy:
        report["py_spy"] = _py_spy(o)
    report["elapsed_s"] = time.perf_counter() - t_all
    with contextlib.suppress(OSError):
        info["load_average_at_end"] = [round(x, 2) for x in os.getloadavg()]
    print(f"\n{'ratio':<52}{'value':>10}")
    for k, v in report["ratios"].items():
        print(f"{k:<52}{'-' if v is None else format(v, '.4f'):>10}")
    print(f"total {report['elapsed_s']:.1f} s" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"wrote {args.json}")
    return 1 if failed else 0


if __name__ == "__main__":
    # Run through the package module, so the functions spawned ranks unpickle are overlap_muon.apps.bench's, not
    # __main__'s (a forkserver child has a different __main__).
    from overlap_muon.apps.bench import main as _main

    sys.exit(_main())
