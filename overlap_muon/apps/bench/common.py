"""What the bench cases share: options and results, timing helpers, the machine description, the gloo rank
spawner, and the model pieces several cases build (plain TP shards of transformer layers, explicit domain groups).

Every case module imports from here and from the library only, never from another case module or from the
package's ``__init__`` (which imports the case modules).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os
import platform
import statistics
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from overlap_muon.apps.spawn import spawn_ranks
from overlap_muon._layout import block_shape

#: Muon hyper-parameters of every case (``torch.optim.Muon``'s defaults except a visible learning rate).
_HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def _muon_2d(name: str, p: Tensor) -> bool:
    """Muon filter of the benchmarks: every 2-D param (their models hold only Muon matrices)."""
    return p.ndim == 2


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
    small: bool = False
    """Halve the NS-heavy cases' matrix sides, and with ``--quick`` the training cases' tokens and iterations per
    round (``--small``, or ``--quick`` on a CPU whose bf16 matmul is slower than fp32: without native bf16 every NS,
    which runs in bf16, is several times slower)."""

    def reps(self, quick: int, full: int) -> int:
        """Timed repeats: ``--repeats``, else the case's ``quick`` or ``full`` count; a quick run with
        :attr:`small` (slow bf16: a smoke run more than a measurement) takes about half the quick count, at
        least 2."""
        if self.repeats is not None:
            return self.repeats
        if not self.quick:
            return full
        return max(2, (quick + 1) // 2) if self.small else quick

    def side(self, n: int) -> int:
        """A matrix side, halved with :attr:`small`."""
        return max(1, n // 2) if self.small else n


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


def matmul_gflops(n: int = 384, rounds: int = 5) -> dict[str, float]:
    """This CPU's 1-thread matmul rate, GFLOP/s, for ``bf16`` and ``fp32`` (median of ``rounds`` ``(n, n)``
    products, about 0.1 s). Without native bf16 (no ``avx512_bf16`` / AMX) bf16 runs several times slower than
    fp32, and every NS (bf16, as ``torch.optim.Muon``) with it."""
    out = {}
    with _threads(1):
        for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            a = torch.randn(n, n).to(dtype)
            torch.mm(a, a)
            ts = []
            for _ in range(rounds):
                t0 = time.perf_counter()
                torch.mm(a, a)
                ts.append(time.perf_counter() - t0)
            out[name] = 2 * n ** 3 / sorted(ts)[rounds // 2] / 1e9
    return out


def slow_bf16(rates: dict[str, float]) -> bool:
    """Whether bf16 matmul is slower than fp32 here (``rates`` from :func:`matmul_gflops`): a CPU without native
    bf16 (``avx512_bf16`` / AMX), on which every NS, in bf16, is slow. The bench then halves its NS-heavy matrices,
    the job warns, and the test suite moves its NS-heavy tests to the long tier."""
    return rates.get("bf16", 0.0) < rates.get("fp32", 0.0)


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

# Spawned ranks unpickle their function by module path (``overlap_muon.apps.bench.<case>._x_rank``), so every
# rank function is a module-level function of its case module. ``python -m overlap_muon.apps.bench`` runs the
# package's ``__main__.py``, which multiprocessing does not re-run in a child (it skips ``*.__main__`` names), so a
# rank never re-executes the driver.


def quiet_split_log() -> None:
    """Keep the library's one-line param split summary out of the bench's report: every optimizer a case builds
    would print it once per process (the cases name their matrices themselves)."""
    logger = logging.getLogger("overlap_muon")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.ERROR)


def _quiet_rank(fn: Callable[..., Any], rank: int, world: int, *args: Any) -> Any:
    quiet_split_log()
    return fn(rank, world, *args)


def _run_ranks(fn: Callable[..., Any], world: int, *args: Any, timeout_s: float) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; return the per-rank results.

    Raises:
        RuntimeError: a rank raised (its traceback is in the message), died, or the group ran past
            ``timeout_s`` seconds (the ranks still alive are killed).
    """
    res = spawn_ranks(functools.partial(_quiet_rank, fn), world, *args, timeout=timeout_s,
                      pg_timeout=max(10.0, timeout_s))
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


# ----------------------------------------------------------------------------------------------------------------
# A Megatron-style TP stack of plain shards (the overlap and choice cases)
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


def _max_over_ranks(per_rank: list[list[float]]) -> list[float]:
    """Per repeat, the slowest rank's time (a collective step ends when its last rank ends)."""
    return [max(xs) for xs in zip(*per_rank)]
