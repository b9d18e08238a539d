"""Bench case ``comm``: bytes and collectives per rank per step, counted inside the ranks.

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

Node-aware (``node_exchange="on"``, the 4 ranks as 2 nodes of 2: [Note: node-aware exchange] in
``overlap_muon/_domain.py``) beside fused: peers per rank (the ranks it sends data to or receives data from, over a
step) and the bytes that leave the node (sent to a rank of another node). Both exchanges carry the same bytes
across nodes; the node-aware one adds the first hop inside the node and a second collective per direction, and at
most ``(L - 1) + (N - 1)`` peers against ``S - 1``: here 2 against 3 (at 4 ranks the bound barely differs; the
simulator gives the figures at scale, docs/results.md).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from torch import Tensor

from overlap_muon.optimizer import OverlapMuon

from .common import (_HP, _CaseResult, _domain_groups, _muon_2d, _Options, _ratio, _run_ranks, _shard_net,
                     _transformer_layer)

#: The keys of the case's ``ratios`` in the JSON.
RATIO_KEYS: tuple[str, ...] = ("fused_bytes_over_ideal", "two_stage_bytes_over_ideal", "duplicated_bytes_over_ideal",
                               "fused_default_bytes_over_ideal", "node_aware_bytes_over_ideal",
                               "node_aware_cross_node_bytes_over_fused", "node_aware_peers_over_fused")

#: The node size the node-aware configuration (and the cross-node count) assumes: 2 nodes of 2 ranks.
_NODE = 2


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
        self.peers: set[int] = set()  # global ranks this one sent data to or received data from
        self.cross_node_bytes = 0  # data sent to ranks of other nodes (node: global rank // _NODE)

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
            row = nbytes // max(1, x.shape[0]) if x.shape[0] else 0
            if splits:
                sent = nbytes - splits[me] * row
            else:
                sent = nbytes - nbytes // size
            self._peers(group, me, [s * row for s in splits] if splits else [nbytes // size] * size,
                        a.get("output_split_sizes") or [1] * size)
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


    def _peers(self, group: Any, me: int, sent: list[int], received: list[int]) -> None:
        """Record the peers of one all_to_all (``sent``: bytes to each group rank) and its bytes across nodes."""
        ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(sent)))
        mine = ranks[me] // _NODE
        with self._lock:
            self.peers |= {ranks[j] for j in range(len(ranks)) if j != me and (sent[j] or received[j])}
            self.cross_node_bytes += sum(b for j, b in enumerate(sent) if ranks[j] // _NODE != mine)


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
        "fused_default": dict(mode="layer_sharded", fused_a2a=True),
        "node_aware": dict(mode="layer_sharded", fused_a2a=True, check_grad_presence=False, node_exchange="on",
                           node_size=_NODE),
    }
    optimizers = {}
    shard_bytes = 0
    for name, kw in configs.items():
        net = _shard_net(specs, R, T, g, t, seed=200 + rank)
        shard_bytes = sum(p.numel() for p in net.parameters()) * 2  # bf16 on the wire
        optimizers[name] = OverlapMuon(net, tp_group=tp, remat_group=rm, overlap=False, muon_filter=_muon_2d,
                                       **kw, **_HP)
    counter = _CommCounter()
    counter.agreement_groups = {id(o._rt.agreement.ctrl_group) for o in optimizers.values()
                                if o._rt.agreement.ctrl_group}
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
                "peers": len(counter.peers),
                "cross_node_bytes_per_step": counter.cross_node_bytes / steps,
            }
            counter.peers = set()
            counter.cross_node_bytes = 0
    finally:
        counter.uninstall()
        for opt in optimizers.values():
            opt.close()
    return out


def run(o: _Options) -> _CaseResult:
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
                      ("fused_default", "fused_default_bytes_over_ideal"),
                      ("node_aware", "node_aware_bytes_over_ideal")):
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
    peers = {n: max(r[n]["peers"] for r in res) for n in ("fused", "node_aware")}
    cross = {n: sum(r[n]["cross_node_bytes_per_step"] for r in res) for n in ("fused", "node_aware")}
    ratios["node_aware_cross_node_bytes_over_fused"] = _ratio(cross["node_aware"], cross["fused"])
    ratios["node_aware_peers_over_fused"] = _ratio(peers["node_aware"], peers["fused"])
    det["nodes"] = {"node_size": _NODE, "peers_max": peers, "cross_node_bytes_per_step": cross}
    for n in ("fused", "node_aware"):
        lines.append(f"{n:<11} as 2 nodes of 2: peers per rank {[r[n]['peers'] for r in res]} (bound "
                     f"{'S - 1 = 3' if n == 'fused' else '(L-1)+(N-1) = 2'}), bytes leaving the node "
                     f"{cross[n]:,.0f} B per step over the ranks")
    return _CaseResult(f"bytes and collectives per rank per step, {R}x{T} domain (world {S}), overlap off",
                       ratios, lines, det)
