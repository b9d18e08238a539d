"""QK-clip (MuonClip): scale down the query and key weights of the heads whose attention logits grew too large.

[Note: QK-clip] The rule is the Kimi K2 technical report's (arXiv 2507.20534, section 2.1, "MuonClip"): after the
optimizer update, for every head ``h`` whose max pre-softmax logit ``S_h = max_{i,j} q_i . k_j * scale`` over the
step's batch exceeds the threshold ``tau``, ``gamma_h = tau / S_h`` and the head's query rows are multiplied by
``gamma_h ** alpha`` and its key rows by ``gamma_h ** (1 - alpha)`` (``alpha = 0.5``), so that the same inputs give
a max logit of ``tau``; heads at or below ``tau`` are left alone, and the momentum is not touched. The report states
it for multi-head attention (and its MLA split). Under grouped-query attention a key head serves a group of query
heads, so the group shares one factor, the smallest of its heads' (``tau / max_{h in group} S_h``): every query
head of the group and its key head are scaled by it (as Megatron-Core's ``clip_qk`` does for query groups), which
brings every head of the group to ``tau`` or below.

Exactness: ``S`` is an exact max (over the heads' rows on every rank and over every data-parallel rank's batch:
one all-reduce of ``max``), ``gamma`` and its powers are computed from it by the same torch ops on every rank, and a
weight row is multiplied by its head's factor in place, element by element: bitwise what one process holding the
whole weights gets from the same rule, whatever the TP/FSDP layout.

The model reports the logits: the attention module whose weights are clipped (the parent of the query projection)
calls :func:`record_max_logits` in its forward with its ``q`` and ``k`` (SDPA never materializes the logits, so the
helper computes them once more, without gradient). ``step()`` reads and clears the record.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ._domain import Domain

from ._layout import block
from ._sorting import name_matches
from .split import QKVSplit

try:
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
except Exception:  # pragma: no cover
    DTensor = ()  # type: ignore[assignment]

__all__ = ["QKClip", "record_max_logits", "max_logits", "ATTR"]

#: The attribute of the attention module that holds its recorded per-head max logits (float32, ``(local heads,)``).
ATTR = "max_attn_logits"


@dataclass(frozen=True)
class QKClip:
    """Which weights QK-clip scales, and its threshold ([Note: QK-clip]).

    Args:
        tau: the max-logit threshold (> 0); Kimi K2 used 100.
        n_heads: query heads ``h`` of every attention layer clipped.
        head_dim: rows per head.
        n_kv_heads: key heads ``g`` (``h % g == 0``; default ``h``: multi-head attention).
        query, key: ``fnmatch`` patterns of separate query and key projection weights (``(out, in)``, head-major
            rows); the i-th query match is paired with the i-th key match, and both must sit in the same module.
        qkv: instead, a pattern of fused QKV weights, with ``layout`` as :class:`~overlap_muon.split.QKVSplit`'s
            (``"blocked"`` or ``"grouped"``).
        alpha: the query's share of the scaling exponent (the report's 0.5).

    Raises:
        ValueError: at ``OverlapMuon`` construction, for a malformed spec or patterns that match no Muon weight.
    """

    tau: float
    n_heads: int
    head_dim: int
    n_kv_heads: int | None = None
    query: str | None = None
    key: str | None = None
    qkv: str | None = None
    layout: str = "blocked"
    alpha: float = 0.5

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    def errors(self) -> list[str]:
        """What is wrong with the spec itself (empty: nothing)."""
        errs = []
        if not (self.tau > 0 and math.isfinite(self.tau)):
            errs.append(f"qk_clip tau must be a positive number, got {self.tau}")
        if self.n_heads < 1 or self.head_dim < 1 or self.n_heads % self.kv_heads:
            errs.append(f"qk_clip needs n_heads >= 1, head_dim >= 1 and n_heads % n_kv_heads == 0, got {self}")
        if (self.qkv is None) == (self.query is None or self.key is None):
            errs.append("qk_clip names either query= and key= (separate weights) or qkv= (fused), not both")
        if not 0.0 <= self.alpha <= 1.0:
            errs.append(f"qk_clip alpha must be in [0, 1], got {self.alpha}")
        return errs

    def rows(self) -> tuple[list[int], list[int], int]:
        """``(query rows, key rows, rows of the weight)`` of one fused weight, head-major (separate weights: the
        query rows of the query weight and the key rows of the key weight, each all of its own rows)."""
        h, g, hd = self.n_heads, self.kv_heads, self.head_dim
        if self.qkv is None:
            return list(range(h * hd)), list(range(g * hd)), 0
        q, k, _ = QKVSplit(n_heads=h, n_kv_heads=g, head_dim=hd, layout=self.layout).parts(((h + 2 * g) * hd, 1))
        return q, k, (h + 2 * g) * hd


@torch.no_grad()
def max_logits(q: Tensor, k: Tensor, scale: float | None = None, causal: bool = True) -> Tensor:
    """Each query head's max pre-softmax attention logit.

    Args:
        q: ``(B, h, S, hd)`` queries; k: ``(B, g, S, hd)`` keys (``h % g == 0``: each key head serves ``h/g``
            consecutive query heads, as SDPA's ``enable_gqa``).
        scale: the logits' scale (default ``1/sqrt(hd)``, SDPA's); causal: mask ``j > i`` as ``is_causal=True``.

    Returns:
        ``(h,)`` float32.
    """
    h, g, hd = q.shape[1], k.shape[1], q.shape[-1]
    k = k.repeat_interleave(h // g, dim=1) if g != h else k
    s = (q.float() @ k.float().transpose(-2, -1)) * (scale if scale is not None else 1.0 / math.sqrt(hd))
    if causal:
        n, m = s.shape[-2], s.shape[-1]
        s = s.masked_fill(torch.ones(n, m, dtype=torch.bool, device=s.device).triu(m - n + 1), float("-inf"))
    return s.amax(dim=(0, 2, 3))


@torch.no_grad()
def record_max_logits(module: nn.Module, q: Tensor, k: Tensor, scale: float | None = None,
                      causal: bool = True) -> None:
    """Record ``max_logits(q, k, scale, causal)`` on ``module`` (its running max until the next ``step()``, so
    gradient accumulation counts every micro-batch). ``q`` and ``k`` hold this rank's heads (under TP, its shard of
    them); call it from the attention module's forward."""
    m = max_logits(q, k, scale, causal)
    prev = getattr(module, ATTR, None)
    setattr(module, ATTR, m if prev is None else torch.maximum(prev, m))


def _factors(spec: QKClip, s: Tensor) -> tuple[Tensor, Tensor]:
    """Per query head and per key head factors from the heads' max logits ``s`` (``(h,)`` float32)."""
    tau = torch.tensor(spec.tau, dtype=torch.float32)
    group = s.view(spec.kv_heads, -1).amax(dim=1)  # a key head's group: its query heads' max
    gamma = torch.where(group > tau, tau / group, torch.ones_like(group))
    return (torch.pow(gamma, spec.alpha).repeat_interleave(spec.n_heads // spec.kv_heads),
            torch.pow(gamma, 1.0 - spec.alpha))


def _row_factors(spec: QKClip, s: Tensor, which: str, n_rows: int) -> Tensor:
    """``(n_rows,)`` float32: each row of a query (``"q"``), key (``"k"``) or fused (``"qkv"``) weight times its
    head's factor (1 elsewhere)."""
    fq, fk = _factors(spec, s)
    q_rows, k_rows, _ = spec.rows()
    out = torch.ones(n_rows, dtype=torch.float32)
    if which in ("q", "qkv"):
        out[q_rows] = fq.repeat_interleave(spec.head_dim)
    if which in ("k", "qkv"):
        out[k_rows] = fk.repeat_interleave(spec.head_dim)
    return out


class QKClipper:
    """The clip of one optimizer: its layers' weights, their recorded logits, and the step-time scaling.

    Args:
        spec: the :class:`QKClip`.
        model: the model (the attention modules are found from the weights' names).
        muon: the optimizer's Muon params (``_placement.MuonParam``), for names, shapes and layouts.
        domain: this rank's place in the weight-shard domain (``_domain.Domain``): a TP shard of the attention
            records heads ``[t*h/T, (t+1)*h/T)``, and a plain shard holds the rows ``_layout.block`` gives.
        group: the group over which the max is taken (every rank of the stage: TP peers and data-parallel
            ranks), or ``None`` in one process.

    Raises:
        ValueError: a malformed spec, patterns matching no Muon weight or weights that do not fit it.
    """

    def __init__(self, spec: QKClip, model: nn.Module, muon: Sequence[Any], domain: Domain, group: Any) -> None:
        self.spec, self.group, self.domain, self.tp_rank = spec, group, domain, domain.tp_rank
        # the max over every layer and head: the last step's, and the peak so far
        self.last_max_logit = self.peak_max_logit = float("-inf")
        by_name = {m.name: m for m in muon}
        errors = spec.errors()
        pick = (lambda pat: [m for n, m in by_name.items() if name_matches(n, pat)])  # noqa: E731
        if spec.qkv is not None:
            layers = [[("qkv", m)] for m in pick(spec.qkv)]
        else:
            qs, ks = pick(spec.query or ""), pick(spec.key or "")
            if len(qs) != len(ks):
                errors.append(f"qk_clip: query={spec.query!r} matches {len(qs)} Muon weights, key={spec.key!r} "
                              f"{len(ks)}; they must pair up")
            layers = [[("q", a), ("k", b)] for a, b in zip(qs, ks)]
        if not layers:
            errors.append(f"qk_clip: the patterns of {spec} match no Muon weight")
        q_rows, k_rows, fused_rows = spec.rows()
        self.layers: list[tuple[nn.Module, list[tuple[str, Any]]]] = []
        for layer in layers:
            owners = {m.name.rsplit(".", 2)[0] if m.name.count(".") >= 2 else "" for _, m in layer}  # the parent
            for which, m in layer:
                want = {"q": len(q_rows), "k": len(k_rows), "qkv": fused_rows}[which]
                if m.full_shape[0] != want or m.transposed or m.expert is not None:
                    errors.append(f"qk_clip: Muon param {m.name!r} of shape {m.full_shape} should have {want} rows "
                                  f"({spec.n_heads} heads, {spec.kv_heads} key heads, head_dim {spec.head_dim}) "
                                  "and be an (out, in) linear weight")
            if len(owners) != 1:
                errors.append(f"qk_clip: {[m.name for _, m in layer]} are not in one module (the attention module "
                              "that records the logits)")
                continue
            self.layers.append((model.get_submodule(owners.pop()), layer))
        if errors:
            raise ValueError("; ".join(errors))

    def params(self) -> list[Tensor]:
        """The clipped weights."""
        return [m.param for _, layer in self.layers for _, m in layer]

    def _gathered(self) -> Tensor:
        """``(layers, h)`` float32 on the host: every head's max over this rank's record (placed at its TP shard's
        heads) and then over the group; ``-inf`` where nothing was recorded."""
        h = self.spec.n_heads
        out = torch.full((len(self.layers), h), float("-inf"))
        for i, (module, layer) in enumerate(self.layers):
            rec = getattr(module, ATTR, None)
            setattr(module, ATTR, None)
            if rec is None:
                continue
            rec = rec.detach().float().cpu().reshape(-1)
            if h % rec.numel():
                raise ValueError(f"qk_clip: {type(module).__name__} recorded {rec.numel()} heads; expected {h} or "
                                 "a TP shard of them")
            start = rec.numel() * self.tp_rank if rec.numel() < h else 0  # TP shard t: heads [t*h/T, ...)
            out[i, start:start + rec.numel()] = rec
        if self.group is not None:
            dist.all_reduce(out, op=dist.ReduceOp.MAX, group=self.group)
        return out

    @torch.no_grad()
    def apply(self) -> int:
        """Scale the weights of the heads over ``tau`` (the updates of the step must have landed). Returns the
        number of heads clipped (on this stage)."""
        s_all = self._gathered()
        self.last_max_logit = float(s_all.max()) if s_all.numel() else float("-inf")
        self.peak_max_logit = max(self.peak_max_logit, self.last_max_logit)
        clipped = 0
        for s, (_, layer) in zip(s_all, self.layers):
            if not bool((s > self.spec.tau).any()):
                continue
            clipped += int((s > self.spec.tau).sum())
            for which, m in layer:
                f = _row_factors(self.spec, s, which, m.full_shape[0])[:, None]
                p = m.param
                if isinstance(p, DTensor):  # the factor column laid out as the weight's rows
                    pl = [Replicate() if isinstance(x, Shard) and x.dim == 1 else x for x in p.placements]
                    f = distribute_tensor(f, p.device_mesh, pl, src_data_rank=None).to_local()
                    p.to_local().mul_(f.to(p.device))
                else:  # a plain block or a whole matrix: this rank's rows of the factor column
                    d = self.domain
                    R, T, g, t = (1, 1, 0, 0) if m.replicated else (d.remat_size, d.tp_size, d.remat_rank, d.tp_rank)
                    row0, rows, _, _ = block(m.full_shape, m.partition_dim, R, T, g, t)
                    p.mul_(f[row0:row0 + rows].to(p.device))
        return clipped
