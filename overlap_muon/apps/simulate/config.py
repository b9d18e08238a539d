"""The simulator's input: :class:`SimConfig`, everything :func:`simulate` needs, checked."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from .shapes import MODEL_PRESETS, ModelShape, NODE_EXCHANGES



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
        from ..._scheduler.surplus import POLICIES

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
        return cls(**{**dict(name=model.name, layer_shapes=shapes, layer_forward_s=tuple(fwd),
                              layer_backward_s=tuple(2.0 * f for f in fwd), tp_size=tp_size, remat_size=remat_size,
                              dp_size=dp_size, grad_accum=grad_accum, ns_flops_per_s=matmul_flops_per_s),
                          **overrides})

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
