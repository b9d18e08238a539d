"""A discrete-event model of ONE training step at scale, with and without the Muon optimizer overlapped.

Usage::

    python -m overlap_muon.apps.simulate                                  # a 70B-class dense model, TP 8, remat 8, DP 16
    python -m overlap_muon.apps.simulate --model llama3-405b --tp 8 --remat 16 --dp 8 --json traces/sim.json
    python -m overlap_muon.apps.simulate --shapes 4096x4096,11008x4096,4096x11008 --layers 32 --tp 4 --remat 2
    python -m overlap_muon.apps.simulate --matrices 3000 --slots 1000     # "N matrices on K slots": waves, per-wave load
    python -m overlap_muon.apps.simulate --surplus all --dp-slots 4       # every surplus policy, with and without DP slots
    python -m overlap_muon.apps.simulate --tp 1 --remat 8192 --dp 1       # 1,024 nodes: fused vs node-aware

Pure Python: no ``torch.distributed``, no streams, no device. The planning is the real one
(:func:`scheduler.plan_waves` with :func:`scheduler.ns_flops` costs), the timing is modelled.

[Note: what the model assumes] Every assumption, in one place:

1. **Model and work.** A dense decoder; each layer holds the Muon matrices ``Wq (H*hd, d)``, ``Wk (KV*hd, d)``,
   ``Wv (KV*hd, d)``, ``Wo (d, H*hd)``, ``W_gate (F, d)``, ``W_up (F, d)``, ``W_down (d, F)`` (full logical
   ``(out, in)`` shapes). Embedding, output head and norms use AdamW on local shards (elementwise, not modelled).
   Forward FLOPs per token per layer are ``2 * (matmul params)`` plus causal attention ``2 * seq_len * H * hd``
   (``QK^T`` and ``AV``, ``2*seq*H*hd`` FLOPs each, halved by the causal mask); the output head's
   ``2 * d * vocab`` is folded into the last layer. Backward is 2x forward (no activation recomputation).
   Presets use the dimensions published for Llama 3 ("The Llama 3 Herd of Models", Meta, 2024, Table 3).
2. **Parallelism.** ``num_gpus = tp * remat * dp``. The Muon weight-shard domain is ``S = remat * tp`` ranks;
   every DP replica holds its own domain and runs the same optimizer step in parallel on other GPUs, so one
   domain is simulated. The remat dim is FSDP-like (data parallel with sharded weights), so the data-parallel
   degree is ``remat * dp``: each TP group processes ``global_batch_tokens / (remat * dp * grad_accum)`` tokens
   per micro-batch, and each GPU does ``1 / tp`` of that group's matmul FLOPs.
3. **Compute rate.** Per-GPU dense bf16 matmul rate ``matmul_flops_per_s`` (default 700e12 FLOP/s, an
   achievable figure for an H200-class chip whose dense bf16 peak is ~989e12) for the model and for NS.
   TP / FSDP / DP collectives of the model itself are not modelled (assumed hidden by the framework, or
   folded into the achievable rate); gradients of a layer are ready (reduced) at the end of its backward.
4. **Links.** Domain ranks are consecutive global ranks (TP innermost), ``gpus_per_node`` (8) per node.
   Intra-node (NVLink) ``400e9`` B/s per direction per GPU; inter-node ``50e9`` B/s per GPU (one 400 Gb/s NIC
   per GPU). An all_to_all moves each rank's bytes evenly over its group peers; the intra- and inter-node
   parts run concurrently, so its time is ``latency + max(intra_bytes / intra_bw, inter_bytes / inter_bw)``,
   taken for the busiest rank (``max`` over ranks of its send and receive bytes). ``collective_latency_s``
   (default 20 us) per collective. The optimizer's exchanges get the full link bandwidth.
5. **Exchanges.** Shards are bf16 (2 B/element) and even (``P*Q/S`` elements per rank). To-home, fused
   (one all_to_all over the flat domain): a rank sends its shard of every matrix homed elsewhere,
   ``2*(1-1/S)*shard_bytes`` per rank per wave on average, and a home receives ``S-1`` shards of each of its
   matrices. Two-stage (``fused_a2a=False``): one all_to_all over the remat group, then one over the TP group
   (each skipped at size 1), times added. From-home mirrors to-home (same time). The node-aware exchange
   (``node_exchange="node_aware"``: two hops per direction) is [Note: node-aware exchange in the model].
6. **Elementwise work.** Pack (momentum lerp + bf16 cast + copy into the send buffer: 16 B/element of the
   local shard, fp32 grad and momentum) runs on the comm lane before the to-home exchange; apply (unpack +
   update of the fp32 param shard: 12 B/element) after the from-home exchange; both at
   ``elementwise_bytes_per_s`` (default 4.0e12 B/s, achievable on H200's 4.8e12 B/s HBM3e); ``None`` skips them.
7. **Waves and lanes.** Param order is gradient-readiness order (layers last-first, inside a layer reverse
   registration order); waves and homes come from :func:`scheduler.plan_waves` (``wave_slots`` default ``S``,
   LPT, taper). Wave ``k`` is launched when every param in it has its gradient and wave ``k-1`` is launched.
   One comm lane per rank, lock-step across the domain (a collective), runs to-home (pack + exchange) and
   from-home (exchange + apply) items first-ready-first-served; one compute lane per home runs NS
   (``ns_flops / ns_flops_per_s`` seconds) of its matrices, wave after wave; from-home of wave ``k`` is
   ready when every home has finished wave ``k``'s NS.
8. **Contention.** Comm never slows compute. NS shares a home's compute with the training step on it:
   while both run on a GPU each progresses at ``1 / (1 + ns_interference)`` of its speed (0: NS is free,
   the lanes of the brief's ideal model; 1: the GPU's matmul throughput is split, total work conserved -- the
   realistic bound when the backward already saturates the tensor cores). The ranks of the domain run the
   model in lock-step: a layer ends when its slowest rank ends (TP / FSDP collectives sync every layer).
9. **The step.** ``grad_accum`` micro-batches of forward + backward; only the last backward produces the
   gradients. *Without overlap* all waves launch when that backward ends and the next forward starts when
   every wave is applied: exposed time = the optimizer's makespan. *With overlap* waves launch as gradients
   are ready and the next forward's layer ``l`` waits only for the waves holding layer ``l``'s matrices:
   exposed time = how much later the simulated next forward ends than ``backward + forward`` alone (waits
   plus contention slowdown). Step time = ``grad_accum * (forward + backward) + exposed``.

[Note: what is guaranteed] With ``ns_interference = 0`` the model is monotone: overlap is never worse than no
overlap, and more bandwidth never makes a step slower (both tested). With contention neither holds, and that
is a prediction, not a bug: the domain runs the model in lock-step, so a layer is slowed by the *busiest* home's
NS at that moment. LPT balances each home's NS over the step, not over each window of it, so when a wave puts
one large matrix on some homes and small ones on others the whole domain pays the large one's time, wave
after wave; the sum of these per-window maxima can exceed the per-home total that the non-overlapped step
pays once (the 70B preset at ``ns_interference = 1`` shows it). Splitting large matrices' NS across homes or
balancing NS per wave, not only per step, is what would remove it.

[Note: surplus and DP slots in the model] ``surplus`` (``scheduler.surplus``): each wave's plan is given, per
replica, to :func:`scheduler.surplus.plan_surplus` with that module's cost model built from this config, and with
the previous wave's per-home NS work as ``busy_s`` (conservative: as if none of it had run yet). A duplicate home
runs the whole NS; a team member runs its share (``1/k`` of the two large products, all of ``A @ A``, over
``team_efficiency``) plus the team's Gram all-reduces (one per step, intra- or inter-node by where the members are)
on its NS lane. The exchanges are then counted flow by flow: to-home, every rank sends its shard (a team member: its
``1/k`` column part) to every home of the matrix; back,
a single home or team member sends to every rank, a duplicate home to the ranks it serves (its node first); a
direction takes ``latency + max`` over ranks and directions of intra / inter bytes over their bandwidth. Modelled
for the fused all_to_all only. ``dp_slots = D``: ``D`` DP replicas share the NS work, so a wave (still at most
``wave_slots``, default ``S``, matrices) spreads by LPT over ``D * S`` homes; each replica exchanges only the
matrices homed in it, and before the apply every rank all-gathers over its DP group (``D`` ranks, ``S`` apart, so
usually inter-node) its shard of the results the other replicas computed: ``latency + busiest bytes / link``
appended to the from-home item. The simulated lanes are then those of ``D`` replicas, in lock-step.

[Note: node-aware exchange in the model] The domain's ``S`` ranks lie ``L = min(gpus_per_node, S)`` to a node on
``N = S / L`` nodes (consecutive: rank ``f`` is local index ``l = f % L`` of node ``n = f // L``; ``node_aware``
needs ``S % L == 0``). ``node_exchange="node_aware"`` runs each direction of a fused exchange in two all_to_alls:
hop 1 within the node (rank ``(n, l)`` hands its node-mate ``(n, l')`` every piece bound for a rank of local index
``l'`` on any node), hop 2 across nodes among the ``N`` ranks of one local index (``(n, l')`` sends ``(n', l')``
what it now holds for it), with a local reorder copy between them; the same bytes arrive. ``N = 1`` is the fused
exchange; ``L = 1`` skips hop 1. Per wave and replica, with ``o[r]`` the shard bytes (``2*P*Q/S`` per matrix)
of the matrices homed on rank ``r``, ``B = sum(o)``, ``O[n]`` the sum of ``o`` over node ``n`` and ``C[l]`` over
local index ``l`` (all nodes), a rank ``r = (n, l)`` (``L_n``: ranks of its node; fused allows a short last node)
sends and receives, in bytes:

======================  ===================  ===================  =========================
exchange, direction     sends                receives             crosses nodes
======================  ===================  ===================  =========================
fused, to-home          ``B - o[r]``         ``(S-1) o[r]``       ``B - O[n]`` sent,
                                                                  ``(S-L_n) o[r]`` received
fused, from-home        ``(S-1) o[r]``       ``B - o[r]``         ``(S-L_n) o[r]`` sent,
                                                                  ``B - O[n]`` received
node-aware to, hop 1    ``B - C[l]``         ``(L-1) C[l]``       none
node-aware to, hop 2    ``L (C[l] - o[r])``  ``(N-1) L o[r]``     all
node-aware back, hop 1  ``(L-1) N o[r]``     ``N (O[n] - o[r])``  none
node-aware back, hop 2  ``(N-1) O[n]``       ``B - O[n]``         all
======================  ===================  ===================  =========================

Summed over ranks both kinds send ``(S - L) B`` across nodes per direction (each cross-node byte crosses once);
node-aware adds hop 1's ``N (L-1) B`` within nodes. To-home, a home's NIC receives every cross-node shard of its
matrices (``(S-L) o[r]``) in both kinds; from-home, node-aware sends a home's results out through the ``L`` NICs
of its node (``(N-1) O[n]`` each), fused through the home's one: so node-aware's from-home gains only where
a node holds few homes, which is what ``node_homes`` (``scheduler.homes`` [Note: homes that know nodes]; the
same per-rank NS loads, only ties move) arranges when a wave has fewer matrices than ranks. A node-aware
direction takes ``(latency + hop-1 busiest / intra_bw) + reorder + (latency + hop-2 busiest / inter_bw)``,
busiest = ``max`` over ranks of sends and receives; the reorder reads and writes what the busiest rank holds
after hop 1 (to-home ``L * max C``, from-home ``N * max O``) at ``elementwise_bytes_per_s`` (none if ``None``).
The fused time stays item 4's (even split over peers). :class:`ExchangeStats` (:attr:`SimResult.exchange`)
counts, per step and for the config's kind and homes, from these formulas in ``O(S)`` per wave: peers per rank
(the ranks a rank sends to or receives from in any wave, either direction, either hop: fused ``S-1`` for a
rank that is ever a home, else the number of homes; node-aware ``(L-1 if some home has local index l, else
the number of local indices with a home) + (N-1 if node n has a home, else the number of nodes with one)``,
at most ``(L-1) + (N-1)``), cross-node and intra-node bytes a rank sends (both directions, all hops), and
all_to_alls (node-aware: ``2 * (int(L > 1) + 1)`` per wave, plus the gradient-presence check, a gloo collective
that neither kind changes and the peer count leaves out, as it does the DP all-gather of ``dp_slots``).

For validation against a measurement, :meth:`SimConfig.from_measured` builds a config from measured per-layer
forward / backward times, NS rate and link bandwidth (e.g. on a CPU/gloo run), and
:attr:`SimResult.exposed_fraction_overlap` is the figure to compare with the measured exposed fraction that
``python -m overlap_muon.apps.timeline`` prints.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any, Sequence

__all__ = [
    "ModelShape",
    "MODEL_PRESETS",
    "SimConfig",
    "SimResult",
    "WaveTiming",
    "ExchangeStats",
    "WaveQuestion",
    "simulate",
    "plan_question",
    "main",
]

#: bf16: the update is cast before routing (docs/design.md §1).
_WIRE_BYTES = 2
#: Pack, per element of the local shard: fp32 grad read (4) + fp32 momentum read and write (8) + bf16 update
#: write (2) + bf16 copy into the send buffer (2).
_PACK_BYTES = 16
#: Apply, per element of the local shard: bf16 receive-buffer copy (2) + bf16 update read (2) + fp32 param
#: read and write (8).
_APPLY_BYTES = 12
#: [Note: content fingerprints] (overlap_muon/wave_state.py): ``step()`` reads every gradient and momentum shard a
#: wave read again (8 B/element, fp32), in three passes of the words (read, product write, product read).
_CONTENT_BYTES = 24
#: The content check's one host read per step on CUDA: the host waits for the queued work (a sync), seconds.
_CONTENT_SYNC_S = 50e-6
#: A lane item is finished when less than this much of it (seconds) is left: absorbs float round-off.
_EPS = 1e-12
#: How a fused exchange crosses nodes ([Note: node-aware exchange in the model]).
NODE_EXCHANGES = ("fused", "node_aware")


# ----------------------------------------------------------------------------------------------------------
# Models


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """Published dimensions of a dense decoder-only transformer (grouped-query attention, gated MLP)."""

    name: str
    """Preset name."""
    num_layers: int
    """Transformer blocks."""
    d_model: int
    """Hidden size d."""
    ffn_hidden: int
    """Gated-MLP inner size F."""
    num_heads: int
    """Query heads H."""
    num_kv_heads: int
    """Key/value heads KV (grouped-query attention)."""
    head_dim: int
    """Head dim hd."""
    vocab_size: int
    """Vocabulary (embedding and output head; AdamW, only their FLOPs are counted)."""
    source: str = ""
    """Where the dimensions come from."""

    def layer_matrices(self) -> tuple[tuple[str, tuple[int, int]], ...]:
        """The Muon matrices of one layer, registration order, full logical ``(out, in)`` shapes."""
        d, f, q, kv = self.d_model, self.ffn_hidden, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return (
            ("wq", (q, d)),
            ("wk", (kv, d)),
            ("wv", (kv, d)),
            ("wo", (d, q)),
            ("w_gate", (f, d)),
            ("w_up", (f, d)),
            ("w_down", (d, f)),
        )

    def layer_forward_flops_per_token(self, seq_len: int) -> float:
        """Forward FLOPs per token of one layer: ``2 * matmul params + 2 * seq_len * H * hd`` (causal attention)."""
        params = sum(p * q for _, (p, q) in self.layer_matrices())
        return 2.0 * params + 2.0 * seq_len * self.num_heads * self.head_dim

    def head_forward_flops_per_token(self) -> float:
        """Forward FLOPs per token of the output head, ``2 * d * vocab``."""
        return 2.0 * self.d_model * self.vocab_size


_LLAMA3 = "Llama 3 published dimensions ('The Llama 3 Herd of Models', Meta, 2024, Table 3)"

#: Built-in model presets, by name.
MODEL_PRESETS: dict[str, ModelShape] = {
    m.name: m
    for m in (
        ModelShape(name="llama3-8b", num_layers=32, d_model=4096, ffn_hidden=14336, num_heads=32,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
        ModelShape(name="llama3-70b", num_layers=80, d_model=8192, ffn_hidden=28672, num_heads=64,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
        ModelShape(name="llama3-405b", num_layers=126, d_model=16384, ffn_hidden=53248, num_heads=128,
                   num_kv_heads=8, head_dim=128, vocab_size=128256, source=_LLAMA3),
    )
}


# ----------------------------------------------------------------------------------------------------------
# Config


def _pos_int(name: str, v: Any) -> None:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"SimConfig.{name} must be an int >= 1, got {v!r}")


def _pos_float(name: str, v: Any, allow_zero: bool = False) -> None:
    bad = isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
    if bad or v < 0 or (v == 0 and not allow_zero):
        raise ValueError(f"SimConfig.{name} must be a finite number {'>= 0' if allow_zero else '> 0'}, got {v!r}")


@dataclass(frozen=True, kw_only=True, slots=True)
class SimConfig:
    """Everything :func:`simulate` needs; see the module's [Note: what the model assumes].

    Build one with :meth:`for_model` (a preset or :class:`ModelShape`, times from FLOPs) or
    :meth:`from_measured` (measured times), or directly. Lists are stored as tuples.

    Raises:
        ValueError: a field is out of range, per-layer lengths differ, or a shape is not two ints >= 0.
    """

    name: str = "custom"
    """A label for reports."""
    layer_shapes: tuple[tuple[tuple[int, int], ...], ...]
    """Per layer, in forward order, the full logical ``(P, Q)`` shape of each Muon matrix (registration order)."""
    layer_forward_s: tuple[float, ...]
    """Per layer, forward time of one micro-batch on one GPU, seconds (the output head folded into the last)."""
    layer_backward_s: tuple[float, ...]
    """Per layer, backward time of one micro-batch on one GPU, seconds."""
    tp_size: int = 1
    """TP size T."""
    remat_size: int = 1
    """GTP_remat size R; the weight-shard domain has ``S = R * T`` ranks."""
    dp_size: int = 1
    """Data-parallel replicas of the domain (only ``num_gpus`` depends on it)."""
    grad_accum: int = 1
    """Micro-batches per optimizer step; only the last one's backward shadows the optimizer."""
    ns_flops_per_s: float
    """NS matmul rate on a home GPU, FLOP/s."""
    ns_steps: int = 5
    """Newton-Schulz iterations (``torch.optim.Muon`` default)."""
    intra_node_bytes_per_s: float = 400e9
    """Intra-node (NVLink) bandwidth per GPU per direction, B/s."""
    inter_node_bytes_per_s: float = 50e9
    """Inter-node bandwidth per GPU per direction, B/s."""
    gpus_per_node: int = 8
    """GPUs sharing the intra-node link domain."""
    collective_latency_s: float = 20e-6
    """Fixed cost of one all_to_all, seconds."""
    elementwise_bytes_per_s: float | None = 4.0e12
    """Memory bandwidth for pack / apply, B/s; ``None`` leaves pack and apply out."""
    wave_slots: int | None = None
    """Max matrices per wave; ``None`` means ``S``."""
    balance: str = "lpt"
    """Home assignment, ``"lpt"`` or ``"round_robin"``."""
    taper: bool = True
    """Shrink the last two waves (``scheduler.plan_waves``)."""
    fused_a2a: bool = True
    """One all_to_all over the flat domain per direction (else two stages: remat group, then TP group)."""
    node_exchange: str = "fused"
    """How the fused exchange crosses nodes: ``"fused"`` (one all_to_all over the domain per direction) or
    ``"node_aware"`` (two per direction: within nodes, then across); [Note: node-aware exchange in the model]."""
    node_homes: bool | None = None
    """Break LPT's ties of load by node load, then local-index load (``scheduler.homes`` [Note: homes that know
    nodes]); ``None``: on with ``node_exchange="node_aware"``, off otherwise."""
    grad_presence_check: bool = True
    """Each wave first exchanges one byte per matrix with every peer (the runtime's gradient-presence check):
    one more latency-bound all_to_all per wave on the to-home lane."""
    ns_interference: float = 0.0
    """How much NS and the training step slow each other on a GPU, in [0, 1]: both run at ``1/(1+x)`` speed
    while both are busy (0: no contention, 1: throughput shared)."""
    surplus: str = "idle"
    """What homes without a matrix in a wave do (``scheduler.surplus``): ``idle``, ``duplicate``, ``team`` or
    ``auto``; see [Note: surplus and DP slots in the model]."""
    dp_slots: int = 1
    """DP replicas whose domains share the NS work (1: every replica runs every NS; ``D``: a wave spreads over
    ``D * S`` homes and the results are all-gathered over the DP group), ``1 <= dp_slots <= dp_size``."""
    team_efficiency: float = 1.0
    """Fraction of the ideal ``k``-fold NS speed-up of a team of ``k``, in (0, 1]."""

    def __post_init__(self) -> None:
        shapes = tuple(tuple((int(p), int(q)) for p, q in layer) for layer in self.layer_shapes)
        for l, layer in enumerate(self.layer_shapes):
            for j, s in enumerate(layer):
                if len(s) != 2 or any(isinstance(x, bool) or not isinstance(x, int) or x < 0 for x in s):
                    raise ValueError(f"SimConfig.layer_shapes[{l}][{j}] is {s!r}; expected (P, Q) ints >= 0")
        object.__setattr__(self, "layer_shapes", shapes)
        object.__setattr__(self, "layer_forward_s", tuple(float(x) for x in self.layer_forward_s))
        object.__setattr__(self, "layer_backward_s", tuple(float(x) for x in self.layer_backward_s))
        n = len(self.layer_shapes)
        if n == 0:
            raise ValueError("SimConfig.layer_shapes is empty; expected at least one layer")
        for fname in ("layer_forward_s", "layer_backward_s"):
            vals = getattr(self, fname)
            if len(vals) != n:
                raise ValueError(f"SimConfig.{fname} has {len(vals)} entries; expected one per layer ({n})")
            for l, v in enumerate(vals):
                if not math.isfinite(v) or v < 0:
                    raise ValueError(f"SimConfig.{fname}[{l}] is {v!r}; expected a finite time >= 0 (seconds)")
        for fname in ("tp_size", "remat_size", "dp_size", "grad_accum", "gpus_per_node"):
            _pos_int(fname, getattr(self, fname))
        if isinstance(self.ns_steps, bool) or not isinstance(self.ns_steps, int) or self.ns_steps < 0:
            raise ValueError(f"SimConfig.ns_steps must be an int >= 0, got {self.ns_steps!r}")
        for fname in ("ns_flops_per_s", "intra_node_bytes_per_s", "inter_node_bytes_per_s"):
            _pos_float(fname, getattr(self, fname))
        _pos_float("collective_latency_s", self.collective_latency_s, allow_zero=True)
        if self.elementwise_bytes_per_s is not None:
            _pos_float("elementwise_bytes_per_s", self.elementwise_bytes_per_s)
        if self.wave_slots is not None:
            _pos_int("wave_slots", self.wave_slots)
        if self.balance not in ("lpt", "round_robin"):
            raise ValueError(f"SimConfig.balance must be 'lpt' or 'round_robin', got {self.balance!r}")
        for fname in ("taper", "fused_a2a"):
            if not isinstance(getattr(self, fname), bool):
                raise ValueError(f"SimConfig.{fname} must be a bool, got {getattr(self, fname)!r}")
        _pos_float("ns_interference", self.ns_interference, allow_zero=True)
        if self.ns_interference > 1:
            raise ValueError(f"SimConfig.ns_interference must be in [0, 1], got {self.ns_interference!r}")
        from ..scheduler.surplus import POLICIES

        if self.surplus not in POLICIES:
            raise ValueError(f"SimConfig.surplus must be one of {POLICIES}, got {self.surplus!r}")
        _pos_int("dp_slots", self.dp_slots)
        if self.dp_slots > self.dp_size:
            raise ValueError(f"SimConfig.dp_slots={self.dp_slots} exceeds dp_size={self.dp_size}")
        _pos_float("team_efficiency", self.team_efficiency)
        if self.team_efficiency > 1:
            raise ValueError(f"SimConfig.team_efficiency must be in (0, 1], got {self.team_efficiency!r}")
        if self.surplus != "idle" and not self.fused_a2a:
            raise ValueError("SimConfig.surplus other than 'idle' is modelled for the fused all_to_all only "
                             "(fused_a2a=True)")
        self._check_node_exchange()

    def _check_node_exchange(self) -> None:
        if self.node_exchange not in NODE_EXCHANGES:
            raise ValueError(f"SimConfig.node_exchange must be one of {NODE_EXCHANGES}, got {self.node_exchange!r}")
        if self.node_homes is not None and not isinstance(self.node_homes, bool):
            raise ValueError(f"SimConfig.node_homes must be a bool or None, got {self.node_homes!r}")
        if self.node_exchange == "fused":
            return
        if not self.fused_a2a:
            raise ValueError("SimConfig.node_exchange='node_aware' splits the fused all_to_all (fused_a2a=True)")
        if self.surplus != "idle":
            raise ValueError("SimConfig.node_exchange='node_aware' is modelled with surplus='idle' only")
        if self.domain_size % self.ranks_per_node:
            raise ValueError(f"SimConfig.node_exchange='node_aware' needs whole nodes: a domain of "
                             f"{self.domain_size} ranks is not a multiple of gpus_per_node={self.gpus_per_node}")

    @property
    def domain_size(self) -> int:
        """``S = remat_size * tp_size``, the number of NS homes."""
        return self.remat_size * self.tp_size

    @property
    def ranks_per_node(self) -> int:
        """``L = min(gpus_per_node, S)``: the domain's ranks on one node."""
        return min(self.gpus_per_node, self.domain_size)

    @property
    def uses_node_homes(self) -> bool:
        """Whether the homes break LPT's ties by node (:attr:`node_homes`, ``None`` resolved)."""
        return self.node_exchange == "node_aware" if self.node_homes is None else self.node_homes

    @property
    def ns_slots(self) -> int:
        """``S * dp_slots``: the homes a wave can spread over."""
        return self.domain_size * self.dp_slots

    @property
    def num_gpus(self) -> int:
        """``tp_size * remat_size * dp_size``."""
        return self.domain_size * self.dp_size

    @classmethod
    def for_model(
        cls,
        model: str | ModelShape,
        *,
        tp_size: int,
        remat_size: int,
        dp_size: int,
        global_batch_tokens: int = 2**22,
        seq_len: int = 8192,
        grad_accum: int = 1,
        matmul_flops_per_s: float = 700e12,
        **overrides: Any,
    ) -> "SimConfig":
        """A config whose per-layer times come from the model's FLOPs at ``matmul_flops_per_s``.

        Args:
            model: a :data:`MODEL_PRESETS` name or a :class:`ModelShape`.
            tp_size, remat_size, dp_size: parallel sizes (``num_gpus`` is their product).
            global_batch_tokens: tokens per optimizer step over all replicas (default 4M = 2**22).
            seq_len: sequence length, tokens (attention FLOPs).
            grad_accum: micro-batches per step.
            matmul_flops_per_s: achievable dense bf16 matmul rate per GPU, FLOP/s (also the NS rate unless
                ``ns_flops_per_s`` is given in ``overrides``).
            overrides: any other :class:`SimConfig` field.

        Raises:
            ValueError: unknown preset, or fewer than one token per TP group per micro-batch.
        """
        if isinstance(model, str):
            if model not in MODEL_PRESETS:
                raise ValueError(f"unknown model {model!r}; presets: {sorted(MODEL_PRESETS)}")
            model = MODEL_PRESETS[model]
        for fname, v in (
            ("tp_size", tp_size),
            ("remat_size", remat_size),
            ("dp_size", dp_size),
            ("grad_accum", grad_accum),
            ("seq_len", seq_len),
            ("global_batch_tokens", global_batch_tokens),
        ):
            _pos_int(fname, v)
        _pos_float("matmul_flops_per_s", matmul_flops_per_s)
        tokens = global_batch_tokens / (remat_size * dp_size * grad_accum)
        if tokens < 1:
            raise ValueError(
                f"global_batch_tokens={global_batch_tokens} gives {tokens:g} tokens per TP group per micro-batch "
                f"(remat {remat_size} x dp {dp_size} x grad_accum {grad_accum}); expected >= 1"
            )
        per_gpu = tokens / (tp_size * matmul_flops_per_s)  # seconds per FLOP-per-token
        fwd = [model.layer_forward_flops_per_token(seq_len) * per_gpu] * model.num_layers
        fwd[-1] += model.head_forward_flops_per_token() * per_gpu
        shapes = tuple(tuple(s for _, s in model.layer_matrices()) for _ in range(model.num_layers))
        kw: dict[str, Any] = dict(
            name=model.name,
            layer_shapes=shapes,
            layer_forward_s=tuple(fwd),
            layer_backward_s=tuple(2.0 * f for f in fwd),
            tp_size=tp_size,
            remat_size=remat_size,
            dp_size=dp_size,
            grad_accum=grad_accum,
            ns_flops_per_s=matmul_flops_per_s,
        )
        kw.update(overrides)
        return cls(**kw)

    @classmethod
    def from_measured(
        cls,
        *,
        layer_shapes: Sequence[Sequence[tuple[int, int]]],
        layer_forward_s: Sequence[float],
        layer_backward_s: Sequence[float],
        ns_flops_per_s: float,
        link_bytes_per_s: float,
        tp_size: int = 1,
        remat_size: int = 1,
        collective_latency_s: float = 0.0,
        elementwise_bytes_per_s: float | None = None,
        **overrides: Any,
    ) -> "SimConfig":
        """A config from measured figures (e.g. a CPU/gloo benchmark), to compare prediction and measurement.

        Every link gets ``link_bytes_per_s`` (one node); other fields keep their defaults unless overridden
        (on a CPU run the lanes' threads share cores with the training step: ``ns_interference`` near 1).

        Args:
            layer_shapes: per layer, the full ``(P, Q)`` of each Muon matrix.
            layer_forward_s, layer_backward_s: measured per-layer times of one micro-batch, seconds.
            ns_flops_per_s: measured NS rate, FLOP/s (``ns_flops(shape) / measured NS seconds``).
            link_bytes_per_s: measured all_to_all bandwidth per rank, B/s.
            tp_size, remat_size: the domain.
            collective_latency_s: measured fixed cost of one all_to_all, seconds.
            elementwise_bytes_per_s: measured memory bandwidth for pack/apply, B/s; None leaves them out.
            overrides: any other :class:`SimConfig` field.
        """
        kw: dict[str, Any] = dict(
            name="measured",
            layer_shapes=tuple(tuple(tuple(s) for s in layer) for layer in layer_shapes),
            layer_forward_s=tuple(layer_forward_s),
            layer_backward_s=tuple(layer_backward_s),
            ns_flops_per_s=ns_flops_per_s,
            intra_node_bytes_per_s=link_bytes_per_s,
            inter_node_bytes_per_s=link_bytes_per_s,
            gpus_per_node=max(1, remat_size * tp_size),
            tp_size=tp_size,
            remat_size=remat_size,
            collective_latency_s=collective_latency_s,
            elementwise_bytes_per_s=elementwise_bytes_per_s,
        )
        kw.update(overrides)
        return cls(**kw)


# ----------------------------------------------------------------------------------------------------------
# Results


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveTiming:
    """One wave in the overlapped run. Times are seconds since the start of the last backward."""

    index: int
    """Launch order."""
    num_params: int
    """Matrices in the wave."""
    first_layer: int
    """Lowest layer index among its matrices."""
    last_layer: int
    """Highest layer index among its matrices."""
    ns_max_s: float
    """Largest per-home NS time in the wave, seconds."""
    ns_mean_s: float
    """Mean per-home NS time in the wave (over all S homes), seconds."""
    to_home_s: float
    """Comm-lane time of the to-home item (pack + exchange), seconds."""
    from_home_s: float
    """Comm-lane time of the from-home item (exchange + apply), seconds."""
    launch_at_s: float
    """When its last gradient was ready (and the wave launched)."""
    to_home_end_s: float
    """When its to-home exchange finished."""
    ns_end_s: float
    """When the last home finished its NS."""
    applied_at_s: float
    """When its from-home exchange and apply finished."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ExchangeStats:
    """The to-home and from-home exchanges of one step, one domain, by rank ([Note: node-aware exchange in the
    model]). Bytes are bf16 payload, both directions and every hop summed; with ``dp_slots > 1`` per-rank figures
    are over the ranks of every replica, totals per replica's domain."""

    kind: str
    """``"fused"`` or ``"node_aware"`` (a domain on one node exchanges as ``"fused"`` whatever the kind)."""
    node_homes: bool
    """Whether LPT's ties went to the least-loaded node."""
    ranks_per_node: int
    """``L``, the domain's ranks on one node."""
    nodes: int
    """``N = ceil(S / L)``, the nodes the domain spans."""
    peers_max: int
    """Most distinct ranks one rank sends to or receives from over the step (fused ``S - 1``, node-aware at most
    ``(L - 1) + (N - 1)``)."""
    peers_mean: float
    """Mean over ranks of the same count."""
    cross_node_bytes_max: float
    """Most bytes one rank sends to other nodes per step, B."""
    cross_node_bytes_total: float
    """Bytes the domain's ranks send to other nodes per step, B (the same for both kinds)."""
    intra_node_bytes_max: float
    """Most bytes one rank sends to ranks of its own node per step, B."""
    busiest_inter_bytes: float
    """Sum over the step's inter-node all_to_alls (fused: each exchange; node-aware: each hop 2) of the busiest
    rank's cross-node bytes, sent or received, B: what the inter-node part of the exchange time is made of."""
    collectives_per_step: int
    """all_to_alls per step per rank, the gradient-presence check included (as
    :attr:`SimResult.collectives_per_step`)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SimResult:
    """What :func:`simulate` predicts for one step of one weight-shard domain (all DP replicas alike)."""

    name: str
    """The config's label."""
    num_gpus: int
    """``tp * remat * dp``."""
    domain_size: int
    """``S``, NS homes per domain."""
    num_layers: int
    """Transformer layers."""
    num_matrices: int
    """Muon matrices."""
    num_waves: int
    """Waves per step."""
    wave_sizes: tuple[int, ...]
    """Matrices per wave, launch order."""
    collectives_per_step: int
    """all_to_all calls per step per rank (2 per wave fused; 2 per non-trivial stage per wave otherwise)."""
    forward_s: float
    """Forward of one micro-batch (all layers), seconds."""
    backward_s: float
    """Backward of one micro-batch, seconds."""
    compute_s: float
    """``grad_accum * (forward_s + backward_s)``: the step with a free optimizer, seconds."""
    ns_flops_per_step: float
    """NS FLOPs of one step in one domain (all matrices)."""
    ns_load_max_s: float
    """Largest per-home NS time per step, seconds."""
    ns_load_mean_s: float
    """Mean per-home NS time per step, seconds."""
    ns_load_max_over_mean: float
    """Per-home NS balance (1 is perfect)."""
    exchange_bytes_per_rank: float
    """bf16 bytes one rank sends to the homes per step (one direction; the way back moves as many), B."""
    exchange_s: float
    """Sum over waves of both exchanges (with latency, without pack/apply), seconds."""
    content_check_s: float
    """The commit's content check on the step's critical path ([Note: content fingerprints] in
    ``overlap_muon/wave_state.py``): ``_CONTENT_BYTES`` per element of this rank's Muon shards at
    ``elementwise_bytes_per_s``, plus one host sync (``_CONTENT_SYNC_S``), seconds. (The pack's own fingerprint,
    as many bytes again, runs on the comm lane and is not modelled.)"""
    content_check_fraction: float
    """``content_check_s / step_overlap_s``."""
    exposed_no_overlap_s: float
    """Optimizer time added to the step without overlap (the whole optimizer after backward), seconds."""
    exposed_overlap_s: float
    """Optimizer time added to the step with overlap (waits in the next forward + contention), seconds."""
    overlap_wait_s: float
    """Part of ``exposed_overlap_s`` the next forward spends blocked on waves, seconds."""
    overlap_slowdown_s: float
    """Part of ``exposed_overlap_s`` from NS contention on the training step, seconds."""
    step_no_overlap_s: float
    """``compute_s + exposed_no_overlap_s``, seconds."""
    step_overlap_s: float
    """``compute_s + exposed_overlap_s``, seconds."""
    exposed_fraction_no_overlap: float
    """``exposed_no_overlap_s / step_no_overlap_s``."""
    exposed_fraction_overlap: float
    """``exposed_overlap_s / step_overlap_s``."""
    exposed_barrier_s: float
    """Optimizer time added to the step with overlap and the default step barrier (the next forward starts once
    every wave has been applied; backward overlap only), seconds. ``exposed_overlap_s`` is ``async_step``'s."""
    step_barrier_s: float
    """``compute_s + exposed_barrier_s``, seconds."""
    exposed_fraction_barrier: float
    """``exposed_barrier_s / step_barrier_s``."""
    waves: tuple[WaveTiming, ...]
    """Per-wave timing of the overlapped run."""
    exchange: ExchangeStats | None
    """Peers, bytes within and across nodes, and collectives of the config's exchange kind on its homes; ``None``
    for the two-stage exchange (``fused_a2a=False``), which it does not model."""

    @property
    def speedup(self) -> float:
        """``step_no_overlap_s / step_overlap_s``."""
        return self.step_no_overlap_s / self.step_overlap_s if self.step_overlap_s > 0 else 1.0

    @property
    def last_wave_latency_s(self) -> float:
        """Overlapped run: the last wave's launch to its update applied (to-home, NS, back), seconds."""
        w = self.waves[-1] if self.waves else None
        return w.applied_at_s - w.launch_at_s if w is not None else 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class WaveQuestion:
    """Answer to "N matrices on K slots": how many waves and how much NS each wave puts on a home."""

    num_matrices: int
    """N."""
    slots: int
    """K, the wave size cap."""
    num_ranks: int
    """Homes the waves are spread over."""
    taper: bool
    """Whether the last two waves were shrunk."""
    num_waves: int
    """Waves (``ceil(N / K)`` without taper)."""
    wave_sizes: tuple[int, ...]
    """Matrices per wave."""
    wave_ns_max_s: tuple[float, ...]
    """Per wave, the largest per-home NS time, seconds."""
    wave_ns_mean_s: tuple[float, ...]
    """Per wave, the mean per-home NS time over all homes, seconds."""
    load_max_s: float
    """Largest per-home NS time over the step, seconds."""
    load_mean_s: float
    """Mean per-home NS time over the step, seconds."""
    load_max_over_mean: float
    """Balance over the step (1 is perfect)."""
    surplus: str = "idle"
    """Surplus policy of :attr:`last_wave_s` (``auto`` as given; the plan says what it chose)."""
    last_wave_policy: str = "idle"
    """The policy the last wave's plan follows (``auto`` resolved)."""
    last_wave_s: float = 0.0
    """Cost-model latency of the last wave (``scheduler.surplus`` [Note: surplus cost model]): the longest
    to-home + NS + back of its matrices, seconds. Homes still running the previous wave's NS are not used as
    surplus (``busy_s``: the previous wave's per-home NS)."""


# ----------------------------------------------------------------------------------------------------------
# Exchange model


def _intra_fraction(group_size: int, stride: int, gpus_per_node: int) -> float:
    """Share of a rank's all_to_all peers on its own node, for a group whose members are ``stride`` apart."""
    if group_size <= 1:
        return 1.0
    per_node = min(group_size, max(1, gpus_per_node // stride))
    return (per_node - 1) / (group_size - 1)


def _a2a_s(cfg: SimConfig, busiest_bytes: float, group_size: int, stride: int) -> float:
    """Time of one all_to_all whose busiest rank sends or receives ``busiest_bytes``; 0 for a trivial group."""
    if group_size <= 1:
        return 0.0
    f = _intra_fraction(group_size, stride, cfg.gpus_per_node)
    t = max(busiest_bytes * f / cfg.intra_node_bytes_per_s, busiest_bytes * (1 - f) / cfg.inter_node_bytes_per_s)
    return cfg.collective_latency_s + t


def _exchange_s(cfg: SimConfig, shard_bytes: list[float], homes: list[int]) -> float:
    """One direction of a wave's exchange; ``shard_bytes[j]`` is matrix j's bf16 bytes on one rank."""
    S, R, T = cfg.domain_size, cfg.remat_size, cfg.tp_size
    total = sum(shard_bytes)
    own = [0.0] * S  # shard bytes of the matrices homed on each rank
    for b, h in zip(shard_bytes, homes):
        own[h] += b
    if cfg.fused_a2a:
        busiest = max(max(total - o for o in own), max((S - 1) * o for o in own))
        return _a2a_s(cfg, busiest, S, 1)
    # Two stages. Stage 1 over the remat group (members T apart): shards go to the home's remat coordinate g.
    own_g = [sum(own[g * T + t] for t in range(T)) for g in range(R)]
    busiest1 = max(max(total - x for x in own_g), max((R - 1) * x for x in own_g))
    # Stage 2 over the TP group: rank (g, t) now holds R shards of every matrix homed at remat coordinate g.
    send2 = max(R * (own_g[g] - own[g * T + t]) for g in range(R) for t in range(T))
    recv2 = max((T - 1) * R * o for o in own)
    return _a2a_s(cfg, busiest1, R, T) + _a2a_s(cfg, max(send2, recv2), T, 1)


def _node_aware(cfg: SimConfig) -> bool:
    """Whether the exchanges run in two hops: ``node_exchange="node_aware"`` on a domain spanning nodes."""
    return cfg.node_exchange == "node_aware" and cfg.domain_size > cfg.ranks_per_node


def _collectives_per_wave(cfg: SimConfig) -> int:
    if cfg.domain_size == 1:
        return 0
    check = int(cfg.grad_presence_check)
    if _node_aware(cfg):
        return 2 * (int(cfg.ranks_per_node > 1) + 1) + check
    if cfg.fused_a2a:
        return 2 + check
    return 2 * (int(cfg.remat_size > 1) + int(cfg.tp_size > 1)) + check


def _node_sums(own: Sequence[float], L: int) -> tuple[list[float], list[float]]:
    """``(O, C)``: ``own`` summed per node (ranks ``[n*L, (n+1)*L)``, the last may be short) and per local index."""
    O, C = [0.0] * -(-len(own) // L), [0.0] * L
    for r, o in enumerate(own):
        O[r // L] += o
        C[r % L] += o
    return O, C


@dataclass(frozen=True, slots=True)
class _Hops:
    """Busiest-rank bytes (max over ranks of sends and receives) of each hop of a node-aware wave, and the most
    bytes a rank holds between the hops (what the reorder copies)."""

    to1: float
    to2: float
    back1: float
    back2: float
    held_to: float
    held_back: float


def _node_aware_hops(own: Sequence[float], L: int) -> _Hops:
    """The table of [Note: node-aware exchange in the model], maximized over ranks; ``own[r]``: rank r's bytes."""
    N, B = len(own) // L, sum(own)
    O, C = _node_sums(own, L)
    return _Hops(
        to1=max(max(B - c, (L - 1) * c) for c in C),
        to2=max(max(L * (C[r % L] - o), (N - 1) * L * o) for r, o in enumerate(own)),
        back1=max(max((L - 1) * N * o, N * (O[r // L] - o)) for r, o in enumerate(own)),
        back2=max(max((N - 1) * x, B - x) for x in O),
        held_to=L * max(C),
        held_back=N * max(O),
    )


def _node_aware_s(cfg: SimConfig, own: Sequence[float]) -> tuple[float, float]:
    """``(to_home_s, from_home_s)`` of a node-aware wave: hop 1 (intra) + reorder + hop 2 (inter) per direction."""
    L, lat, h = cfg.ranks_per_node, cfg.collective_latency_s, _node_aware_hops(own, cfg.ranks_per_node)

    def direction(hop1: float, hop2: float, held: float) -> float:
        t = lat + hop2 / cfg.inter_node_bytes_per_s
        if L > 1:
            t += lat + hop1 / cfg.intra_node_bytes_per_s
            if cfg.elementwise_bytes_per_s is not None:
                t += 2 * held / cfg.elementwise_bytes_per_s
        return t

    return direction(h.to1, h.to2, h.held_to), direction(h.back1, h.back2, h.held_back)


def _exchange_pair_s(cfg: SimConfig, shard_bytes: list[float], homes: list[int]) -> tuple[float, float]:
    """``(to_home_s, from_home_s)`` of one replica's wave, by the config's exchange kind."""
    if not _node_aware(cfg):
        ex = _exchange_s(cfg, shard_bytes, homes)
        return ex, ex
    own = [0.0] * cfg.domain_size
    for b, h in zip(shard_bytes, homes):
        own[h] += b
    return _node_aware_s(cfg, own)


@dataclass(slots=True)
class _Traffic:
    """One wave of one replica, both directions: bytes each rank sends across and within nodes, and the sum over
    the wave's inter-node all_to_alls of the busiest rank's cross-node bytes."""

    cross: list[float]
    intra: list[float]
    busiest_inter: float


def _fused_traffic(own: Sequence[float], L: int) -> _Traffic:
    S, B = len(own), sum(own)
    O, _ = _node_sums(own, L)
    size = [min(L, S - n * L) for n in range(len(O))]  # ranks of each node (the last may be short)
    out_of_node = [B - O[r // L] for r in range(S)]  # to-home sent, from-home received, across nodes
    home_far = [(S - size[r // L]) * o for r, o in enumerate(own)]  # to-home received, from-home sent, across
    return _Traffic(
        cross=[a + b for a, b in zip(out_of_node, home_far)],
        intra=[(O[r // L] - o) + (size[r // L] - 1) * o for r, o in enumerate(own)],
        busiest_inter=2 * max(max(a, b) for a, b in zip(out_of_node, home_far)),
    )


def _node_aware_traffic(own: Sequence[float], L: int) -> _Traffic:
    N, B = len(own) // L, sum(own)
    O, C = _node_sums(own, L)
    h = _node_aware_hops(own, L)
    return _Traffic(
        cross=[L * (C[r % L] - o) + (N - 1) * O[r // L] for r, o in enumerate(own)],
        intra=[(B - C[r % L]) + (L - 1) * N * o for r, o in enumerate(own)],
        busiest_inter=h.to2 + h.back2,
    )


def _peers(homes: set[int], S: int, L: int, node_aware: bool) -> tuple[int, float]:
    """``(max, mean)`` over a replica's ranks of the peers of the step's exchanges, ``homes``: every wave's."""
    if not homes or S == 1:
        return 0, 0.0
    if not node_aware:
        k = len(homes)
        return S - 1, (k * (S - 1) + (S - k) * k) / S
    N = S // L
    locals_, nodes = {h % L for h in homes}, {h // L for h in homes}
    intra = [L - 1 if l in locals_ else len(locals_) for l in range(L)]
    inter = [N - 1 if n in nodes else len(nodes) for n in range(N)]
    return max(intra) + max(inter), sum(intra) / L + sum(inter) / N


def _exchange_stats(cfg: SimConfig, waves: Sequence[Any], shapes: Sequence[tuple[int, int]]) -> ExchangeStats:
    """:class:`ExchangeStats` of the planned waves: per-wave aggregates, ``O(S)`` per wave and replica."""
    S, D, L = cfg.domain_size, cfg.dp_slots, cfg.ranks_per_node
    node_aware = _node_aware(cfg)
    traffic = _node_aware_traffic if node_aware else _fused_traffic
    cross, intra = [0.0] * (S * D), [0.0] * (S * D)
    homes: list[set[int]] = [set() for _ in range(D)]
    busiest = 0.0
    for w in waves:
        own = [[0.0] * S for _ in range(D)]
        for i in w.params:
            d, h = divmod(w.homes[i], S)
            own[d][h] += shapes[i][0] * shapes[i][1] * _WIRE_BYTES / S
            homes[d].add(h)
        wave_busiest = 0.0
        for d in {w.homes[i] // S for i in w.params}:
            t = traffic(own[d], L)
            for r in range(S):
                cross[d * S + r] += t.cross[r]
                intra[d * S + r] += t.intra[r]
            wave_busiest = max(wave_busiest, t.busiest_inter)
        busiest += wave_busiest
    peers = [_peers(h, S, L, node_aware) for h in homes]
    return ExchangeStats(
        kind=cfg.node_exchange,
        node_homes=cfg.uses_node_homes,
        ranks_per_node=L,
        nodes=-(-S // L),
        peers_max=max(p[0] for p in peers),
        peers_mean=sum(p[1] for p in peers) / D,
        cross_node_bytes_max=max(cross),
        cross_node_bytes_total=sum(cross) / D,
        intra_node_bytes_max=max(intra),
        busiest_inter_bytes=busiest,
        collectives_per_step=len(waves) * _collectives_per_wave(cfg),
    )


# ----------------------------------------------------------------------------------------------------------
# The event model


@dataclass(frozen=True, slots=True)
class _WavePlan:
    params: tuple[int, ...]
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


def _lane_work(plans: list[_WavePlan], num_homes: int) -> list[list[float]]:
    """Per wave, the NS work of each simulated lane: every home with work in some wave, then one idle home (if
    any) for all the others."""
    busy = sorted({r for p in plans for r, w in enumerate(p.ns_work) if w > 0})
    idle = [0.0] if len(busy) < num_homes else []
    return [[p.ns_work[r] for r in busy] + idle for p in plans]


def _run(cfg: SimConfig, plans: list[_WavePlan], overlap: bool, barrier: bool = False) -> _RunOut:
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
        for i in p.params:
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
    from ..scheduler.surplus import SurplusCostModel

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
    from ..scheduler.surplus import _dup_served, _Nodes

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


def _plan(cfg: SimConfig) -> tuple[list[Any], list[float], list[_WavePlan], float]:
    """Waves, per-matrix NS seconds, per-wave lane items, and the bf16 bytes a rank sends to homes per step."""
    from ..scheduler.cost import ns_flops
    from ..scheduler.surplus import _estimate_parts, _Nodes, plan_surplus
    from ..scheduler.waves import plan_waves

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
            _WavePlan(
                params=w.params,
                ns_work=tuple(work),
                to_home_s=check + pack + ex_to,
                from_home_s=ex_back + dp_gather + apply,
                launch_layer=min(layers),
                first_layer=min(layers),
                last_layer=max(layers),
            )
        )
    return waves, ns_s, plans, sent_total


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
        elems = sum(shapes[i][0] * shapes[i][1] / S for i in p.params)
        pack = elems * _PACK_BYTES / elem_bw if elem_bw else 0.0
        apply = elems * _APPLY_BYTES / elem_bw if elem_bw else 0.0
        exchange += (p.to_home_s - pack) + (p.from_home_s - apply)
    local_elems = sum(sh[0] * sh[1] / S for sh in shapes)
    content = (local_elems * _CONTENT_BYTES / elem_bw if elem_bw else 0.0) + _CONTENT_SYNC_S

    timings = tuple(
        WaveTiming(
            index=k,
            num_params=len(p.params),
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
    from ..scheduler.cost import ns_flops
    from ..scheduler.homes import load_report
    from ..scheduler.waves import plan_waves

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
    from ..scheduler.surplus import SurplusCostModel, plan_surplus

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
    from ..layout import gram_wins
    from ..scheduler.cost import gram_ns_flops, ns_cost, ns_flops

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
            from ..scheduler.surplus import SurplusCostModel

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


if __name__ == "__main__":
    sys.exit(main())
