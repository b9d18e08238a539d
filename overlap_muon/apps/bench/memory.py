"""Bench case ``memory``: optimizer memory, the peak per step vs the floor of the wave plan.

Peak bytes of tensor storage one optimizer step allocates beyond params, gradients and optimizer state (rank
0; storages counted by a ``TorchDispatchMode``, :func:`_peak_bytes`, with the lanes inline,
``side_streams=False``), for ``overlap=True`` (``overlap``), ``overlap=False`` (``sync``) and ``mode="duplicated"``
(``duplicated``), on the step case's transformer layers (``--quick``: 2 layers d_model 64; else 4 layers d_model
256) as plain TP shards, world 1 and world 2 (1x2 TP). ``{overlap,sync,duplicated}_peak_over_min_world{1,2}``: that
peak over the floor of the wave plan (:func:`_min_wave_bytes`: one wave's exchange buffers and full matrices plus
the update blocks earlier waves hold until ``step()`` commits them; >= 1, 1 is the floor);
``overlap_peak_over_torch_muon_world1``: the overlap peak over ``torch.optim.Muon``'s on the same shards.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from overlap_muon._placement import local_tensor
from overlap_muon.optimizer import OverlapMuon

from .common import (_HP, _CaseResult, _domain_groups, _muon_2d, _Options, _ratio, _run_ranks, _shard_net,
                     _transformer_layer)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = tuple(f"{v}_peak_over_min_world{w}" for w in (1, 2)
                                    for v in ("overlap", "sync", "duplicated")) + (
    "overlap_peak_over_torch_muon_world1",)


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


def run(o: _Options) -> _CaseResult:
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
