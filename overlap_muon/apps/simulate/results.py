"""The simulator's output: per-wave timings, exchange statistics, the step's result, the wave question's rows."""

from __future__ import annotations

from dataclasses import dataclass



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
    ``overlap_muon/_wave_state.py``): ``_CONTENT_BYTES`` per element of this rank's Muon shards at
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
