"""A small decoder-only transformer over bytes, and how it is laid out on a ``("remat", "tp")`` DeviceMesh.

Shapes (``B`` batch, ``S`` sequence, ``D`` width, ``H`` heads, ``hd = D / H``, ``F`` MLP width, ``V = 256``)::

    tokens (B, S) int64
      -> tok_emb (V, D) + pos_emb (S_max, D)                       AdamW
      -> L x Block:
           x + attn.proj(SDPA(attn.qkv(norm1(x))))   qkv (3D, D) fused or q/k/v (D, D) each   Muon
           x + mlp.fc2(gelu(mlp.fc1(norm2(x))))      fc1 (F, D), fc2 (D, F)                    Muon
      -> norm_f -> head (V, D)                                         AdamW
    logits (B, S, V) float32

With ``moe_experts = E > 0`` every ``moe_every``-th block (blocks ``moe_every - 1``, ``2 * moe_every - 1``, ...)
has a top-k mixture-of-experts MLP (``moe.MoE``) instead: ``router`` (E, D) (Muon, an ``nn.Linear``) and the
experts' grouped weights ``experts.w_in`` (E_local, F_e, D) and ``experts.w_out`` (E_local, D, F_e), each expert
``e`` computing ``w_out[e] @ gelu(w_in[e] @ x)``; see [Note: MoE dispatch] for how tokens reach experts that
live on other ranks (``moe.py``).

The Muon matrices are exactly the weights of the ``nn.Linear`` modules (no biases anywhere); the embeddings,
the norms and the output head (an :class:`OutputHead`, deliberately *not* an ``nn.Linear``) use AdamW, the
usual Muon recipe for the first and last layers (Keller Jordan, "Muon: An optimizer for hidden layers in neural
networks", 2024). :func:`muon_params` states that rule in one place, for the single-process reference.

Parallel layout (:func:`parallelize`): the attention input projections and ``fc1`` are ``ColwiseParallel``
(TP ``partition_dim`` 0), ``attn.proj`` and ``fc2`` ``RowwiseParallel`` (``partition_dim`` 1), Megatron
style with the activations between blocks replicated over TP; the embeddings, norms and head stay replicated
over TP. Then FSDP2 ``fully_shard`` shards every block and the root over the ``remat`` dim, which is also the
data-parallel dim.

[Note: fused QKV row order] The fused ``qkv`` weight stores its ``3D`` rows head by head,
``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``hd`` rows each), not ``[Q | K | V]``. A ``ColwiseParallel`` split
into ``T`` row blocks then hands every TP rank whole heads with their own q, k and v (``H % T == 0``), and
the module's forward is the same code for any ``T``: it reads the local head count off the local output
width. The layout does not depend on ``T``, so checkpoints and parameter checksums compare across TP sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from overlap_muon.qk_clip import record_max_logits

from .moe import MoE, expert_params, full_experts, shard_experts

__all__ = [
    "GPT", "MLP", "VOCAB", "Attention", "Block", "ModelConfig", "OutputHead", "muon_params", "parallelize",
    "MoE", "expert_params", "full_experts",  # from moe.py
]

VOCAB = 256  #: byte-level vocabulary


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """Sizes of :class:`GPT`."""

    d_model: int = 128  #: width D
    n_layers: int = 4  #: number of blocks L
    n_heads: int = 4  #: attention heads H (D % H == 0)
    mlp_ratio: int = 4  #: F = mlp_ratio * D
    seq_len: int = 128  #: S_max, the longest sequence (positions are learned)
    fused_qkv: bool = True  #: one (3D, D) qkv matrix instead of three (D, D)
    moe_experts: int = 0  #: E experts per MoE MLP; 0: no MoE, every MLP dense
    moe_top_k: int = 2  #: experts per token
    moe_every: int = 2  #: an MoE MLP in every moe_every-th block (blocks moe_every-1, 2*moe_every-1, ...)
    moe_hidden: int = 0  #: F_e, each expert's width; 0: mlp_ratio * d_model // moe_top_k (the dense MLP's FLOPs)

    def __post_init__(self) -> None:
        for name in ("d_model", "n_layers", "n_heads", "mlp_ratio", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.moe_experts < 0:
            raise ValueError(f"moe_experts must be >= 0 (0: no MoE), got {self.moe_experts}")
        if self.moe_experts:
            if not 1 <= self.moe_top_k <= self.moe_experts:
                raise ValueError(f"moe_top_k={self.moe_top_k} must be in [1, moe_experts={self.moe_experts}]; "
                                 "pick --moe-top-k at most --moe-experts")
            if self.moe_every <= 0 or self.moe_hidden < 0:
                raise ValueError(f"moe_every must be positive and moe_hidden >= 0, got {self.moe_every}, "
                                 f"{self.moe_hidden}")
            if not self.moe_layers():
                raise ValueError(f"n_layers={self.n_layers} < moe_every={self.moe_every}: no block would be MoE; "
                                 "lower --moe-every")
            if self.expert_hidden <= 0:
                raise ValueError("the expert width mlp_ratio * d_model // moe_top_k is 0; pass --moe-hidden")
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model={self.d_model} is not divisible by n_heads={self.n_heads}; "
                "pick --d-model a multiple of --n-heads"
            )

    def check_tp(self, tp: int) -> None:
        """Raise ``ValueError`` unless the model splits over ``tp`` tensor-parallel ranks (whole heads, whole
        MLP columns per rank)."""
        if self.n_heads % tp:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by tp={tp}; pick --n-heads a multiple of --tp")
        if (self.mlp_ratio * self.d_model) % tp:
            raise ValueError(
                f"MLP width {self.mlp_ratio * self.d_model} is not divisible by tp={tp}; "
                "change --d-model or --mlp-ratio"
            )

    def check_ep(self, ep: int) -> None:
        """Raise ``ValueError`` unless the experts split evenly over ``ep`` expert-parallel ranks."""
        if self.moe_experts and self.moe_experts % ep:
            raise ValueError(f"moe_experts={self.moe_experts} is not divisible by the world size {ep} (experts are "
                             "sharded over all ranks); pick --moe-experts a multiple of the number of processes")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def expert_hidden(self) -> int:
        """F_e, the width of one expert."""
        return self.moe_hidden or self.mlp_ratio * self.d_model // self.moe_top_k

    def moe_layers(self) -> list[int]:
        """Indices of the blocks whose MLP is an :class:`MoE` (none without ``moe_experts``)."""
        if not self.moe_experts:
            return []
        return [i for i in range(self.n_layers) if (i + 1) % self.moe_every == 0]


class Attention(nn.Module):
    """Causal multi-head self-attention. ``(B, S, D) -> (B, S, D)``; see [Note: fused QKV row order]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.fused = cfg.fused_qkv
        if self.fused:
            self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        else:
            self.q = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.k = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
            self.v = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.record_logits = False  # QK-clip: record each head's max logit while training (overlap_muon.qk_clip)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, _ = x.shape
        hd = self.head_dim
        if self.fused:
            qkv = self.qkv(x)  # (B, S, 3 * H_local * hd), head-major
            h = qkv.shape[-1] // (3 * hd)
            q, k, v = qkv.view(B, S, h, 3, hd).permute(3, 0, 2, 1, 4).unbind(0)  # each (B, h, S, hd)
        else:
            q, k, v = (m(x) for m in (self.q, self.k, self.v))  # each (B, S, H_local * hd)
            h = q.shape[-1] // hd
            q, k, v = (t.view(B, S, h, hd).transpose(1, 2) for t in (q, k, v))
        if self.record_logits and self.training:
            record_max_logits(self, q, k)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, h, S, hd)
        return self.proj(y.transpose(1, 2).reshape(B, S, h * hd))


class MLP(nn.Module):
    """``(B, S, D) -> (B, S, D)``: ``fc2(gelu(fc1(x)))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model, bias=False)
        self.fc2 = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


class Block(nn.Module):
    """Pre-norm transformer block. ``(B, S, D) -> (B, S, D)``; its MLP an :class:`MoE` when ``moe``."""

    def __init__(self, cfg: ModelConfig, moe: bool = False) -> None:
        super().__init__()
        self.norm1 = nn.RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.norm2 = nn.RMSNorm(cfg.d_model)
        self.mlp = MoE(cfg) if moe else MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class OutputHead(nn.Module):
    """Logits ``(B, S, D) -> (B, S, V)`` with a ``(V, D)`` weight. Not an ``nn.Linear`` on purpose: the head is
    an AdamW parameter, and the Muon filter selects ``nn.Linear`` weights."""

    def __init__(self, d_model: int, vocab: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, d_model))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class GPT(nn.Module):
    """The byte-level decoder. ``forward(tokens (B, S) int64) -> logits (B, S, 256) float32`` with
    ``S <= cfg.seq_len``. Initialisation is a pure function of the global torch seed (the experts too: the
    model holds all ``E`` of them until :func:`parallelize` keeps this rank's, so every world size starts from
    the same global experts)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(VOCAB, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        moe = set(cfg.moe_layers())
        self.blocks = nn.ModuleList(Block(cfg, moe=i in moe) for i in range(cfg.n_layers))
        self.norm_f = nn.RMSNorm(cfg.d_model)
        self.head = OutputHead(cfg.d_model, VOCAB)
        self._init_weights()

    def _init_weights(self) -> None:
        # GPT-2 style: N(0, 0.02), the residual-branch outputs scaled by 1/sqrt(2L) so the residual stream's
        # variance does not grow with depth (Radford et al. 2019).
        out_std = 0.02 / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():
            if name.endswith("norm1.weight") or name.endswith("norm2.weight") or name == "norm_f.weight":
                nn.init.ones_(p)
            elif name.endswith(("attn.proj.weight", "mlp.fc2.weight", "experts.w_out")):
                nn.init.normal_(p, std=out_std)
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        S = tokens.shape[1]
        pos = torch.arange(S, device=tokens.device)
        x = self.tok_emb(tokens) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm_f(x)).float()

    def moe_aux_loss(self) -> torch.Tensor | None:
        """The sum of the MoE layers' load-balancing losses of the last training forward (``None`` without MoE)."""
        losses = [b.mlp.aux_loss for b in self.blocks if isinstance(b.mlp, MoE) and b.mlp.aux_loss is not None]
        return torch.stack(losses).sum() if losses else None


def muon_params(model: nn.Module) -> list[nn.Parameter]:
    """The parameters Muon updates: the 2-D weights of ``nn.Linear`` modules, in ``named_modules`` order.

    For this model (embeddings are ``nn.Embedding``, the head an :class:`OutputHead`) it is what ``OverlapMuon``'s
    default split picks; the single-process ``torch.optim.Muon`` reference uses this list and gives every other
    parameter to AdamW.
    """
    return [m.weight for m in model.modules() if isinstance(m, nn.Linear) and m.weight.ndim == 2]


def parallelize(model: GPT, mesh) -> GPT:
    """Lay ``model`` out on a 2-D ``DeviceMesh`` named ``("remat", "tp")``, in place.

    Tensor parallel over ``mesh["tp"]`` (skipped when its size is 1): ``ColwiseParallel`` for the attention
    input projections and ``fc1``, ``RowwiseParallel`` for ``attn.proj`` and ``fc2``. Then FSDP2
    ``fully_shard`` over ``mesh["remat"]`` (skipped when its size is 1) for every block and the root.

    MoE blocks: the router is left out of the TP plan (replicated over TP, FSDP-sharded over remat like every
    other dense weight); the experts are sharded over all ``W`` ranks of the mesh (rank ``r = g * T + t`` keeps
    global experts ``[r * E / W, (r + 1) * E / W)`` of the ``E`` the model was built with) and left out of
    ``fully_shard``, and the ranks create the MoE's process groups (collective). See [Note: MoE dispatch].

    Returns:
        ``model`` (its parameters are now DTensors where a parallel dim has size > 1).

    Raises:
        ValueError: the mesh is not named ``("remat", "tp")`` or the model does not split over its TP size.
    """
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    if tuple(mesh.mesh_dim_names or ()) != ("remat", "tp"):
        raise ValueError(f"expected a 2-D DeviceMesh named ('remat', 'tp'), got dims {mesh.mesh_dim_names}")
    tp = mesh["tp"].size()
    model.cfg.check_tp(tp)
    model.cfg.check_ep(mesh.size())
    if model.cfg.moe_experts:
        shard_experts(model, mesh)
    if tp > 1:
        attn_in = ("qkv",) if model.cfg.fused_qkv else ("q", "k", "v")
        attn = {f"attn.{n}": ColwiseParallel() for n in attn_in}
        attn["attn.proj"] = RowwiseParallel()
        mlp = {"mlp.fc1": ColwiseParallel(), "mlp.fc2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh["tp"], attn if isinstance(block.mlp, MoE) else {**attn, **mlp})
    if mesh["remat"].size() > 1:
        experts = set(expert_params(model).values())
        for block in model.blocks:
            ignored = {p for p in block.parameters() if p in experts}
            fully_shard(block, mesh=mesh["remat"], **({"ignored_params": ignored} if ignored else {}))
        fully_shard(model, mesh=mesh["remat"], **({"ignored_params": experts} if experts else {}))
    return model
