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

from .cli import main
from .config import SimConfig
from .results import ExchangeStats, SimResult, WaveQuestion, WaveTiming
from .shapes import MODEL_PRESETS, NODE_EXCHANGES, ModelShape
from .step import plan_question, simulate

__all__ = [
    "ModelShape",
    "MODEL_PRESETS",
    "NODE_EXCHANGES",
    "SimConfig",
    "SimResult",
    "WaveTiming",
    "ExchangeStats",
    "WaveQuestion",
    "simulate",
    "plan_question",
    "main",
]
