"""Profile (issue 15, item 5): where the synchronous step's time goes, OverlapMuon vs DistMuon, world 2.

Wraps (in the rank processes only) the NS functions and ``all_to_all_single`` of both with per-thread timers
and runs ``steps`` steps of one optimizer at a time on the peers case's model. Prints per-step medians of:
the step, NS, all_to_all (incl. waiting for the peer), and the rest (host work: momentum, casts, pack/unpack,
apply, dispatch). ``--only NAME`` runs one optimizer (for py-spy).

    PYTHONPATH=. python experiments/prof_peers.py [tp|fsdp] [layers] [steps] [--only overlap_muon|dist_muon|...]
"""

from __future__ import annotations

import statistics
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

from overlap_muon.apps.bench import peers as bp
from overlap_muon.apps.spawn import spawn_ranks

_acc: dict[str, float] = defaultdict(float)
_cnt: dict[str, int] = defaultdict(int)
_lock = threading.Lock()


def _wrap(obj, attr, key):
    fn = getattr(obj, attr)

    def w(*a, **k):
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                _acc[key] += dt
                _cnt[key] += 1

    setattr(obj, attr, w)


def _rank(rank, world, layout, layers, steps, only):
    import contextlib

    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.flex_shard import _optimizer_reshard_runtime as rt
    from torchtitan.distributed.flex_shard import dist_muon as dm

    import overlap_muon.lanes as lanes
    import overlap_muon.ns as ns
    from overlap_muon import OverlapMuon
    from overlap_muon.agreement import Agreement

    _wrap(dist, "all_to_all_single", "a2a")
    _wrap(ns, "zeropower", "zeropower")
    _wrap(dm, "_zeropower_via_newtonschulz", "zeropower")
    _wrap(Agreement, "check_wave", "presence")
    for f in ("_prepare_redistributed", "_compute_redistributed", "_finalize_redistributed"):
        _wrap(rt, f, f.strip("_"))
    _wrap(dm, "_apply_muon_update", "apply")

    @contextlib.contextmanager
    def timed_range(name, nvtx=False):
        t0 = time.perf_counter()
        try:
            yield
        finally:
            dt = time.perf_counter() - t0
            with _lock:
                _acc[name.rsplit("::", 1)[-1]] += dt

    lanes.prof_range = timed_range
    flex, _ = bp.import_dist_muon()
    axis = "tp" if layout == "tp" else "remat"
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=(axis,))
    names = [only] if only else ["overlap_muon", "overlap_muon_unchecked", "overlap_muon_inline", "dist_muon"]
    opts = {}
    for name in names:
        net = bp._shard(bp._full_net(256, layers, 4, 21), mesh, layout)
        bp._set_grads(net, bp._full_grads(net, 22))
        if name.startswith("overlap_muon"):
            kw = dict(check_grad_presence=(name == "overlap_muon"))
            if name.endswith("inline"):
                kw["side_streams"] = False
            opts[name] = OverlapMuon(net, device_mesh=mesh, overlap=False, **kw, **bp._HP)
        else:
            opts[name] = bp._build_dist_muon(flex, net, axis, "one")
        opts[name].step()
    rows = {n: [] for n in names}
    for s in range(steps):
        k = s % len(names)
        for name in names[k:] + names[:k]:
            dist.barrier()
            with _lock:
                _acc.clear()
                _cnt.clear()
            t0 = time.perf_counter()
            opts[name].step()
            dt = time.perf_counter() - t0
            with _lock:
                rows[name].append({"step": dt, **dict(_acc), **{f"n_{k}": v for k, v in _cnt.items()}})
    for o in opts.values():
        if hasattr(o, "close"):
            o.close()
    keys = {n: sorted({k for r in rows[n] for k in r}) for n in names}
    return {n: {k: statistics.median(r.get(k, 0.0) for r in rows[n]) for k in keys[n]} for n in names}


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    only = None
    if "--only" in sys.argv:
        only = sys.argv[sys.argv.index("--only") + 1]
        args = [a for a in args if a != only]
    layout = args[0] if args else "tp"
    layers = int(args[1]) if len(args) > 1 else 12
    steps = int(args[2]) if len(args) > 2 else 15
    res = spawn_ranks(_rank, 2, layout, layers, steps, only, timeout=900)
    for r, (ok, payload) in enumerate(res):
        if not ok:
            print(payload)
            sys.exit(1)
        print(f"rank {r} (medians over {steps} interleaved steps, ms):")
        for name, m in payload.items():
            rest = m["step"] - m.get("zeropower", 0) - m.get("a2a", 0)
            phases = "  ".join(f"{k}={1e3 * v:.2f}" for k, v in m.items() if not k.startswith("n_") and k != "step")
            print(f"  {name:<24} step {1e3 * m['step']:7.2f}  rest(step-zeropower-a2a) {1e3 * rest:6.2f}  | {phases}")
