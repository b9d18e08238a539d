"""Bench case ``peers``: OverlapMuon side by side with torchtitan's ``DistMuon`` (FlexShard) in one run.

OverlapMuon side by side with torchtitan's ``DistMuon`` (FlexShard; optional, skipped with the install line when not
importable; CPU patches and details below). Same model (d_model 256, 4 heads, per layer q, k, v, o, up, down), same
DTensor shards, same gradients, interleaved. (a) the optimizer step alone (``overlap=False``), world 2, TP
(``ColwiseParallel``/``RowwiseParallel``) and FSDP2 (``fully_shard``) layouts:
``step_{tp,fsdp}_world2_overlap_muon_over_dist_muon``; (b) the whole training iteration (forward, backward, step)
with OverlapMuon's defaults (``auto_overlap`` keeps the faster of overlap on and off after its trial, run in the
warm-up; the overlap forced on and off are reported beside it), TP, world 1 and 2:
``iteration_world{1,2}_overlap_muon_over_dist_muon``. Each is our
median time over DistMuon's (one bucket); < 1 means OverlapMuon is faster. The case fails if any result is not
``torch.equal`` (to each other, and in (a) to ``torch.optim.Muon`` on the unsharded model).

Both optimizers get the same model, the same DTensor shards and the same gradients; their steps are interleaved
(A, B, A, B, ...; the order rotates each round) so drift in the machine's load hits both alike, and the results
are compared with ``torch.equal`` (against each other and, for the optimizer step, against ``torch.optim.Muon``
on an unsharded copy). ``DistMuon`` is an optional dependency::

    pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro

(its full dependency list pulls datasets, wandb and more that ``torchtitan.distributed.flex_shard`` does not
import). Without it the case is skipped with that line as the message.

Only OverlapMuon's public API is used here (constructor, ``step``, ``zero_grad``, ``synchronize``, ``close``).

[Note: DistMuon on CPU] torchtitan 0.3.0's DistMuon targets CUDA. Two spots stop it on CPU, and
:func:`dist_muon_cpu_patches` works around exactly those two, only while a DistMuon is constructed and only when
its parameters live on the CPU (on CUDA nothing is patched):

1. ``torchtitan/distributed/flex_shard/dist_muon.py`` line 367, ``DistMuon._validate_parameter_storage``:
   ``raise ValueError("DistMuon requires one CUDA device per process")`` for any non-CUDA storage. The patch
   keeps every other check of that method (DTensor params, one device) and accepts a CPU device.
2. ``torchtitan/distributed/flex_shard/_optimizer_reshard_runtime.py`` line 267,
   ``_CommunicationContext.create``: ``device_handle.Stream(device=device, priority=0)``, which
   ``torch.cpu.Stream.__init__(self, priority=-1)`` rejects (no ``device`` argument). The patch makes
   ``torch.cpu.Stream`` accept and drop ``device`` for the duration of the construction (the context, its stream
   and events are created in the constructor's ``reserve_buffers``).

On CPU, ``torch.cpu.Stream`` and ``torch.cpu.Event`` are no-ops (``torch/cpu/__init__.py``: "only exists to
facilitate device-agnostic code"), so neither patch changes any arithmetic or communication: DistMuon runs its
prepare, ``all_to_all_single``, Newton-Schulz and update on the calling thread, in its own order.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from overlap_muon.optimizer import OverlapMuon
from overlap_muon._overlap_choice import TRIAL

from .common import _HP, _CaseResult, _max_over_ranks, _median, _ms, _Options, _ratio, _run_ranks, _timed_steps

__all__ = ["INSTALL_HINT", "import_dist_muon", "dist_muon_cpu_patches", "RATIO_KEYS", "run"]

#: How to install the peer (what the skip message says).
INSTALL_HINT = "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro"

#: The ratio keys of the case: our time over DistMuon's (single bucket), < 1 means OverlapMuon is faster.
RATIO_KEYS: tuple[str, ...] = (
    "step_tp_world2_overlap_muon_over_dist_muon",
    "step_fsdp_world2_overlap_muon_over_dist_muon",
    "iteration_world1_overlap_muon_over_dist_muon",
    "iteration_world2_overlap_muon_over_dist_muon",
)


def import_dist_muon() -> tuple[Any, str | None]:
    """``(flex_shard module, None)``, or ``(None, why)`` when torchtitan's FlexShard cannot be imported."""
    try:
        from torchtitan.distributed import flex_shard
    except Exception as e:  # noqa: BLE001 - ImportError, or a dependency of it failing to import
        return None, (f"torchtitan's DistMuon is not importable ({type(e).__name__}: {e}); install it with "
                      f"`{INSTALL_HINT}`")
    return flex_shard, None


@contextlib.contextmanager
def dist_muon_cpu_patches(device: torch.device) -> Iterator[None]:
    """Let a torchtitan 0.3.0 ``DistMuon`` be constructed on CPU; see [Note: DistMuon on CPU]. No-op unless
    ``device.type == "cpu"``. Everything patched is restored on exit."""
    if device.type != "cpu":
        yield
        return
    from torch.distributed.tensor import DTensor
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    def validate_parameter_storage(self: Any) -> torch.device:
        # dist_muon.py line 367 raises for non-CUDA storage; the same checks otherwise, CPU accepted.
        devices = set()
        for group in self.param_groups:
            for param in group["params"]:
                if not isinstance(param, DTensor):
                    raise TypeError("DistMuon requires DTensor parameters")
                devices.add(param.to_local().device)
        if len(devices) != 1 or next(iter(devices)).type not in ("cuda", "cpu"):
            raise ValueError(f"DistMuon (CPU-patched) needs one device per process, got {sorted(map(str, devices))}")
        return devices.pop()

    cpu_stream = torch.cpu.Stream

    class _CpuStream(cpu_stream):  # type: ignore[misc, valid-type]
        # _optimizer_reshard_runtime.py line 267 passes device=..., which torch.cpu.Stream does not take.
        def __init__(self, device: Any = None, priority: int = -1) -> None:
            super().__init__(priority=priority)

    orig_validate = DistMuon.__dict__["_validate_parameter_storage"]
    DistMuon._validate_parameter_storage = validate_parameter_storage
    torch.cpu.Stream = _CpuStream
    try:
        yield
    finally:
        DistMuon._validate_parameter_storage = orig_validate
        torch.cpu.Stream = cpu_stream


# ----------------------------------------------------------------------------------------------------------------
# The model both optimizers train
# ----------------------------------------------------------------------------------------------------------------


class _PeerLayer(nn.Module):
    """A pre-norm transformer layer: causal multi-head attention (q, k, v, o ``(d, d)``) and an MLP (up ``(4d, d)``,
    down ``(d, 4d)``); no biases and no norm weights, so every param is a Muon matrix. Input/output ``(B, S, d)``
    float32. Written so that torchtitan-style TP (``ColwiseParallel`` on q, k, v, up; ``RowwiseParallel`` on o,
    down; local heads) runs it unchanged."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.d, self.head_dim = d, d // heads
        self.q = nn.Linear(d, d, bias=False)
        self.k = nn.Linear(d, d, bias=False)
        self.v = nn.Linear(d, d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        h = F.rms_norm(x, (self.d,))
        q, k, v = (m(h).view(B, S, -1, self.head_dim).transpose(1, 2) for m in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, S, -1)
        x = x + self.o(a)
        return x + self.down(F.gelu(self.up(F.rms_norm(x, (self.d,)))))


class _PeerNet(nn.Module):
    def __init__(self, d: int, layers: int, heads: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_PeerLayer(d, heads) for _ in range(layers)])

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _full_net(d: int, layers: int, heads: int, seed: int) -> _PeerNet:
    """The unsharded model, identical on every rank and in every variant (weights from ``seed``)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        return _PeerNet(d, layers, heads)


def _full_grads(net: nn.Module, seed: int) -> dict[str, Tensor]:
    """A full-shape float32 gradient per param name, from ``seed`` (the step case's fixed gradients)."""
    gen = torch.Generator().manual_seed(seed)
    return {n: torch.randn(p.shape, generator=gen) for n, p in net.named_parameters()}


def _shard(net: _PeerNet, mesh: Any, layout: str) -> _PeerNet:
    """Shard ``net`` in place over the 1-D ``mesh``: ``"tp"`` (torchtitan-style ``ColwiseParallel`` q, k, v, up;
    ``RowwiseParallel`` o, down) or ``"fsdp"`` (FSDP2 ``fully_shard`` per layer and at the root: ``Shard(0)``)."""
    if layout == "tp":
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                "up": ColwiseParallel(), "down": RowwiseParallel()}
        for layer in net.layers:
            parallelize_module(layer, mesh, plan)
    elif layout == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in net.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(net, mesh=mesh)
    else:
        raise ValueError(f"layout must be 'tp' or 'fsdp', got {layout!r}")
    return net


def _set_grads(net: nn.Module, grads: dict[str, Tensor]) -> None:
    """``p.grad`` = the full gradient distributed like ``p`` (a DTensor with ``p``'s mesh and placements)."""
    from torch.distributed.tensor import distribute_tensor

    for n, p in net.named_parameters():
        p.grad = distribute_tensor(grads[n], p.device_mesh, p.placements)


def _build_dist_muon(flex: Any, net: nn.Module, axis: str, buckets: str) -> Any:
    """torchtitan's DistMuon over every param of ``net`` (each ``Owned`` on ``axis``: whole-matrix NS on one
    owner rank, as ours), with ``buckets="one"`` (one bucket) or ``"layer"`` (one bucket per layer, last layer
    first, the order backward produces them), ``_HP`` hyper-parameters."""
    names = [n for n, _ in net.named_parameters()]
    params = [p for _, p in net.named_parameters()]
    layout = flex.ComputeLayout(shardings_by_mesh_axis={axis: flex.Owned()})
    if buckets == "one":
        cfgs = [flex.BucketConfig(patterns=("*",), name="all")]
    else:
        n_layers = len(net.layers)
        cfgs = [flex.BucketConfig(patterns=(f"layers.{i}.*",), name=f"layer{i}") for i in reversed(range(n_layers))]
    with dist_muon_cpu_patches(params[0].device):
        return flex.build_dist_muon([{"params": params, "param_names": names}],
                                    compute_sharding_by_fqn={n: layout for n in names}, bucket_configs=cfgs, **_HP)


def _fulls(net: nn.Module) -> dict[str, Tensor]:
    """Every param as a full tensor (collective for DTensors: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in net.named_parameters()}


def _unequal(a: dict[str, Tensor], b: dict[str, Tensor]) -> list[str]:
    """Names whose tensors are not ``torch.equal``."""
    return [n for n in a if not torch.equal(a[n], b[n])]


# ----------------------------------------------------------------------------------------------------------------
# (a) the optimizer step alone
# ----------------------------------------------------------------------------------------------------------------


def _peers_step_rank(rank: int, world: int, layout: str, d: int, layers: int, heads: int, warmup: int,
                     repeats: int) -> dict[str, Any]:
    """Time ``overlap=False`` OverlapMuon steps (with and without its gradient-presence check) against DistMuon
    (one bucket; one bucket per layer) on the same shards and gradients; then compare every result with
    ``torch.equal`` (rank 0 also against ``torch.optim.Muon`` on the unsharded model, same number of steps)."""
    from torch.distributed.device_mesh import init_device_mesh

    flex, why = import_dist_muon()
    if flex is None:
        raise RuntimeError(why)
    axis = "tp" if layout == "tp" else "remat"  # OverlapMuon reads a 1-D mesh not named "tp" as the remat dim
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    seed, gseed = 21, 22
    nets: dict[str, nn.Module] = {}
    opts: dict[str, Any] = {}
    for name in ("overlap_muon", "overlap_muon_unchecked", "dist_muon", "dist_muon_per_layer"):
        net = _shard(_full_net(d, layers, heads, seed), mesh, layout)
        _set_grads(net, _full_grads(net, gseed))
        nets[name] = net
        if name.startswith("overlap_muon"):
            opts[name] = OverlapMuon(net, device_mesh=mesh, overlap=False,
                                     check_grad_presence=(name == "overlap_muon"), **_HP)
        else:
            opts[name] = _build_dist_muon(flex, net, axis, "one" if name == "dist_muon" else "layer")
    times = _timed_steps(opts, warmup, repeats, barrier=True)
    fulls = {n: _fulls(net) for n, net in nets.items()}
    out: dict[str, Any] = {"times": times, "steps": warmup + repeats}
    if rank == 0:
        ref_net = _full_net(d, layers, heads, seed)
        grads = _full_grads(ref_net, gseed)
        ref = torch.optim.Muon(list(ref_net.parameters()), **_HP)
        for _ in range(warmup + repeats):
            for n, p in ref_net.named_parameters():
                p.grad = grads[n]
            ref.step()
        want = _fulls(ref_net)
        out["unequal_to_torch_muon"] = {n: _unequal(f, want) for n, f in fulls.items()}
    for o in opts.values():
        if isinstance(o, OverlapMuon):
            o.close()
    return out


# ----------------------------------------------------------------------------------------------------------------
# (b) the whole training iteration
# ----------------------------------------------------------------------------------------------------------------

#: OverlapMuon in the iteration: the defaults (``auto_overlap`` keeps the faster mode after its trial, which the
#: warm-up runs), the overlap forced on, and off.
_ITERATION_VARIANTS: dict[str, dict[str, Any]] = {"overlap_muon": {}, "overlap_muon_on": dict(overlap=True),
                                                  "overlap_muon_sync": dict(overlap=False)}


def _peers_iteration_rank(rank: int, world: int, d: int, layers: int, heads: int, batch: int, seq: int,
                          rounds: int, chunk: int) -> dict[str, Any]:
    """Interleaved rounds of ``chunk`` training iterations (forward, backward, step, zero_grad) of the TP model
    with OverlapMuon (:data:`_ITERATION_VARIANTS`: the defaults, overlap forced on, off) and with DistMuon (one
    bucket; its step is synchronous); a round's time ends after ``synchronize()`` so every launched wave is paid
    for. Then every model's params are compared with ``torch.equal`` to DistMuon's."""
    from torch.distributed.device_mesh import init_device_mesh

    flex, why = import_dist_muon()
    if flex is None:
        raise RuntimeError(why)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    x = torch.randn(batch, seq, d, generator=torch.Generator().manual_seed(23))
    names = list(_ITERATION_VARIANTS) + ["dist_muon"]
    nets = {n: _shard(_full_net(d, layers, heads, 21), mesh, "tp") for n in names}
    opts: dict[str, Any] = {n: OverlapMuon(nets[n], device_mesh=mesh, **kw, **_HP)
                            for n, kw in _ITERATION_VARIANTS.items()}
    opts["dist_muon"] = _build_dist_muon(flex, nets["dist_muon"], "tp", "one")

    def run_chunk(name: str, n: int = chunk) -> float:
        net, opt = nets[name], opts[name]
        if world > 1:
            dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            net(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        if isinstance(opt, OverlapMuon):
            opt.synchronize()
        return (time.perf_counter() - t0) / chunk

    for n in names:  # warm-up (as long for all: the params are compared); the default's trial ends inside it
        run_chunk(n, 2 * TRIAL + 3)
    times: dict[str, list[float]] = {n: [] for n in names}
    for r in range(rounds):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(run_chunk(n))
    fulls = {n: _fulls(net) for n, net in nets.items()}
    out: dict[str, Any] = {"times": times, "iterations": chunk * rounds + 2 * TRIAL + 3,
                           "kept_on": opts["overlap_muon"].stats.get("overlap_auto_chose_on")}
    ours = list(_ITERATION_VARIANTS)
    if rank == 0:
        out["unequal"] = sorted({x for n in ours for x in _unequal(fulls[n], fulls["dist_muon"])})
    for n in ours:
        opts[n].close()
    return out


# ----------------------------------------------------------------------------------------------------------------
# The case
# ----------------------------------------------------------------------------------------------------------------


def run(o: _Options) -> _CaseResult:
    """Run (a) and (b); see the module docstring. Skipped (every ratio ``None``) when DistMuon is not importable.

    Raises:
        RuntimeError: a rank failed, or a result is not ``torch.equal`` where it must be (a parity failure is a
            failed case, not a figure).
    """
    flex, why = import_dist_muon()
    if flex is None:
        return _CaseResult("OverlapMuon vs torchtitan DistMuon: SKIPPED", {k: None for k in RATIO_KEYS},
                           [f"skipped: {why}"], {"skipped": why})
    import torchtitan

    d, heads = o.side(256), 4
    step_layers, warmup, repeats = (2, 1, o.reps(15, 30)) if o.quick else (12, 2, o.reps(15, 30))
    it_layers, batch, seq = (2, 2, 64 if o.small else 128) if o.quick else (4, 4, 256)
    rounds, chunk = o.reps(5, 8), (1 if o.small else 2) if o.quick else 3
    ratios: dict[str, float | None] = {}
    lines: list[str] = []
    det: dict[str, Any] = {"torchtitan": getattr(torchtitan, "__version__", "?"), "d_model": d, "heads": heads}
    failures: list[str] = []

    variants = ("overlap_muon", "overlap_muon_unchecked", "dist_muon", "dist_muon_per_layer")
    for layout in ("tp", "fsdp"):
        world = 2
        res = _run_ranks(_peers_step_rank, world, layout, d, step_layers, heads, warmup, repeats,
                         timeout_s=o.timeout_s)
        samples = {v: _max_over_ranks([r["times"][v] for r in res]) for v in variants}
        med = {v: _median(samples[v]) for v in variants}
        unequal = res[0]["unequal_to_torch_muon"]
        key = f"step_{layout}_world{world}_overlap_muon_over_dist_muon"
        ratios[key] = _ratio(med["overlap_muon"], med["dist_muon"])
        det[f"step_{layout}"] = {"world": world, "layers": step_layers, "matrices": 6 * step_layers,
                                 "repeats": repeats, "steps": res[0]["steps"], "median_s": med, "samples_s": samples,
                                 "unequal_to_torch_muon": unequal}
        lines.append(f"(a) step, world {world}, {layout.upper()} layout, {6 * step_layers} matrices (median of "
                     f"{repeats}, slowest rank):")
        for v in variants:
            lines.append(f"      {v:<24}{_ms(med[v])}   x{med[v] / med['dist_muon']:.3f} of DistMuon   "
                         f"{'torch.equal to torch.optim.Muon' if not unequal[v] else 'DIFFERS: ' + str(unequal[v][:3])}")
        failures += [f"step {layout} {v}: {unequal[v][:3]}" for v in variants if unequal[v]]

    for world in (1, 2):
        res = _run_ranks(_peers_iteration_rank, world, d, it_layers, heads, batch, seq, rounds, chunk,
                         timeout_s=o.timeout_s)
        samples = {v: _max_over_ranks([r["times"][v] for r in res]) for v in res[0]["times"]}
        med = {v: _median(s) for v, s in samples.items()}
        unequal = res[0]["unequal"]
        key = f"iteration_world{world}_overlap_muon_over_dist_muon"
        ratios[key] = _ratio(med["overlap_muon"], med["dist_muon"])
        det[f"iteration_world{world}"] = {"layers": it_layers, "matrices": 6 * it_layers, "batch": batch,
                                          "seq": seq, "rounds": rounds, "iters_per_round": chunk,
                                          "iterations": res[0]["iterations"], "median_s": med, "samples_s": samples,
                                          "unequal": unequal, "kept_on": res[0]["kept_on"]}
        kept = {None: "undecided", 0: "off", 1: "on"}[res[0]["kept_on"]]
        dm = med["dist_muon"]
        lines.append(f"(b) iteration (fwd+bwd+step), world {world}, TP, {6 * it_layers} matrices, {batch}x{seq} "
                     f"tokens: overlap_muon (default, kept {kept}) {_ms(med['overlap_muon']).strip()}, overlap on "
                     f"{_ms(med['overlap_muon_on']).strip()}, off {_ms(med['overlap_muon_sync']).strip()}, dist_muon "
                     f"{_ms(dm).strip()}; ratio {ratios[key]:.3f} (on: {med['overlap_muon_on'] / dm:.3f}, off: "
                     f"{med['overlap_muon_sync'] / dm:.3f}); params after {res[0]['iterations']} iterations "
                     + ("torch.equal" if not unequal else f"DIFFER: {unequal[:3]}"))
        if unequal:
            failures.append(f"iteration world {world}: {unequal[:3]}")
    if failures:
        raise RuntimeError("peers: results are not bitwise equal: " + "; ".join(failures))
    return _CaseResult(f"OverlapMuon vs torchtitan {det['torchtitan']} DistMuon (FlexShard), same shards and "
                       "gradients, interleaved; ratio = ours / DistMuon's (< 1: we are faster)", ratios, lines, det)

