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
has a top-k mixture-of-experts MLP (:class:`MoE`) instead: ``router`` (E, D) (Muon, an ``nn.Linear``) and the
experts' grouped weights ``experts.w_in`` (E_local, F_e, D) and ``experts.w_out`` (E_local, D, F_e), each expert
``e`` computing ``w_out[e] @ gelu(w_in[e] @ x)``; see [Note: MoE dispatch] for how tokens reach experts that
live on other ranks.

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

__all__ = [
    "GPT", "MLP", "VOCAB", "Attention", "Block", "Experts", "MoE", "ModelConfig", "OutputHead", "expert_params",
    "full_experts", "muon_params", "parallelize",
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


class _EP:
    """The expert-parallel layout of one :class:`MoE` (set by :func:`parallelize`; ``None`` in one process).

    ``world`` ranks hold ``E / world`` experts each (rank ``r``: global experts ``[r * E_local, (r + 1) *
    E_local)``); the ``dp`` ranks with this rank's TP index hold the ``dp`` distinct token sets (``dp_index`` is
    this rank's), the TP ranks of one remat index the same tokens.
    """

    def __init__(self, world_group, dp_group, world: int, dp: int, dp_index: int, rank: int) -> None:
        self.world_group, self.dp_group = world_group, dp_group
        self.world, self.dp, self.dp_index, self.rank = world, dp, dp_index, rank


class _Dispatch(torch.autograd.Function):
    """``(N, C)`` this rank's tokens -> ``(dp * N, C)`` the tokens of every remat index (all_gather over the
    ranks with this rank's TP index). Backward: every rank's gradient of those tokens summed (all_reduce over the
    world), this rank's rows. See [Note: MoE dispatch]. Collective: every rank's forward runs it in the same
    order with the same ``N`` (the training job's micro-batches and validation batches are equal on every rank).
    """

    @staticmethod
    def forward(ctx, z: torch.Tensor, ep: _EP) -> torch.Tensor:
        import torch.distributed as dist

        ctx.ep, ctx.n = ep, z.shape[0]
        z = z.contiguous()
        if ep.dp == 1:
            return z.clone()
        parts = [torch.empty_like(z) for _ in range(ep.dp)]
        dist.all_gather(parts, z, group=ep.dp_group)
        return torch.cat(parts)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous().clone()
        dist.all_reduce(grad, group=ctx.ep.world_group)
        i, n = ctx.ep.dp_index, ctx.n
        return grad[i * n : (i + 1) * n], None


class _Combine(torch.autograd.Function):
    """``(dp * N, D)`` this rank's experts' outputs for every token -> ``(N, D)`` every expert's summed output
    for this rank's tokens (all_reduce over the world, this rank's rows). Backward: the output gradients of every
    remat index (all_gather over the ranks with this rank's TP index). See [Note: MoE dispatch]."""

    @staticmethod
    def forward(ctx, part: torch.Tensor, ep: _EP) -> torch.Tensor:
        import torch.distributed as dist

        ctx.ep = ep
        total = part.contiguous().clone()
        dist.all_reduce(total, group=ep.world_group)
        n = total.shape[0] // ep.dp
        return total[ep.dp_index * n : (ep.dp_index + 1) * n].clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist

        grad = grad.contiguous()
        if ctx.ep.dp == 1:
            return grad.clone(), None
        parts = [torch.empty_like(grad) for _ in range(ctx.ep.dp)]
        dist.all_gather(parts, grad, group=ctx.ep.dp_group)
        return torch.cat(parts), None


class Experts(nn.Module):
    """This rank's experts as grouped weights ``w_in`` (E_local, F_e, D) and ``w_out`` (E_local, D, F_e), plain
    ``nn.Parameter`` s (not DTensors, not FSDP-sharded: expert parallelism is their sharding).

    ``forward(x (M, D), gates (M, E_local)) -> (M, D)``: ``sum_e gates[:, e] * w_out[e] @ gelu(w_in[e] @ x)`` over
    the tokens whose gate for ``e`` is non-zero (the top-k ones), expert by expert.
    """

    def __init__(self, n_experts: int, d_model: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.empty(n_experts, hidden, d_model))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_model, hidden))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e in range(self.w_in.shape[0]):
            g = gates[:, e]
            idx = g.nonzero().squeeze(1)  # may be empty: the expert still joins the graph (a zero gradient)
            y = F.linear(F.gelu(F.linear(x[idx], self.w_in[e])), self.w_out[e])
            out = out.index_add(0, idx, y * g[idx, None])
        return out


class MoE(nn.Module):
    """Top-k mixture-of-experts MLP. ``(B, S, D) -> (B, S, D)``.

    ``router`` (an ``nn.Linear`` D -> E) gives each token softmax probabilities over the E experts; the k largest,
    renormalized to sum to 1, weight the outputs of those k experts. In training the forward also stores
    ``aux_loss``, the Switch-Transformer load-balancing loss ``E * sum_e f_e * p_e`` of this rank's tokens
    (``f_e`` the fraction of routing slots that went to expert ``e``, ``p_e`` its mean probability; 1 when
    balanced), which the training loop may add to the loss.

    [Note: MoE dispatch] ``experts`` holds this rank's ``E / W`` experts (expert parallelism over all ``W`` ranks of
    the ``("remat", "tp")`` mesh, expert TP 1). TP ranks of one remat index see the same tokens, so the distinct
    tokens are those of the ``R`` remat indices. Forward: ``_Dispatch`` all-gathers each rank's tokens with their
    gates over the remat group of its TP index (``R * N`` distinct tokens, no TP duplicate), this rank's experts
    run on the tokens routed to them, and ``_Combine`` all-reduces those partial outputs over the world (each
    expert lives on exactly one rank, so the sum is every chosen expert's output once) and keeps this rank's rows.
    Backward, the adjoints, so gradients mean what they mean for the dense params: ``_Combine`` all-gathers the
    output gradients over the remat group (each remat index's ``dL_g/dy_g`` once: the TP ranks of an index hold
    the same one), so an expert's gradient is ``sum_g dL_g/dw``; a hook divides it by ``R``, which makes it
    ``d(mean_g L_g)/dw`` as FSDP's averaging makes the dense gradients. ``_Dispatch`` all-reduces the token (and
    gate) gradients over the world (every expert's contribution, each counted once because each expert lives on
    one rank) and keeps this rank's rows: ``dL_g/dx_g`` on every TP rank of index ``g``, as the replicated
    activations of TP expect, and through the gates the router's full gradient. With one process (no
    :func:`parallelize`) the same code runs without collectives on all ``E`` experts.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_experts, self.top_k = cfg.moe_experts, cfg.moe_top_k
        self.router = nn.Linear(cfg.d_model, cfg.moe_experts, bias=False)
        self.experts = Experts(cfg.moe_experts, cfg.d_model, cfg.expert_hidden)
        self.ep: _EP | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        xf = x.reshape(B * S, D)
        probs = self.router(xf).float().softmax(-1)  # (N, E)
        top_p, top_i = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, top_i, top_p / top_p.sum(-1, keepdim=True))
        self.aux_loss = None
        if self.training:
            slots = torch.zeros_like(probs).scatter(1, top_i, 1.0).mean(0) / self.top_k  # f_e
            self.aux_loss = self.n_experts * (slots * probs.mean(0)).sum()
        z = torch.cat([xf, gates.to(xf.dtype)], 1)
        ep = self.ep
        if ep is not None:
            z = _Dispatch.apply(z, ep)
        tokens, gates = z.split([D, self.n_experts], 1)
        n_local = self.experts.w_in.shape[0]
        first = ep.rank * n_local if ep is not None else 0
        out = self.experts(tokens, gates[:, first : first + n_local])
        if ep is not None:
            out = _Combine.apply(out, ep)
        return out.view(B, S, D)


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


def expert_params(model: nn.Module) -> dict[str, nn.Parameter]:
    """The grouped expert weights ``(E_local, P, Q)`` by name (``blocks.{i}.mlp.experts.w_in`` / ``w_out``), in
    ``named_parameters`` order: each is ``E_local`` matrices for Muon, on this rank only."""
    return {f"{n}.{k}": p for n, m in model.named_modules() if isinstance(m, Experts)
            for k, p in m.named_parameters(recurse=False)}


def full_experts(model: nn.Module, p: torch.Tensor) -> torch.Tensor:
    """All ``E`` experts ``(E, P, Q)`` of the grouped expert weight ``p`` (one of :func:`expert_params`), in
    global expert order: an all-gather over the expert-parallel ranks after :func:`parallelize` (collective:
    every rank calls it for the same weight), ``p`` itself in one process."""
    import torch.distributed as dist

    ep = next((m.ep for m in model.modules() if isinstance(m, MoE)), None)
    if ep is None or ep.world == 1:
        return p.detach()
    parts = [torch.empty_like(p) for _ in range(ep.world)]
    dist.all_gather(parts, p.detach().contiguous(), group=ep.world_group)
    return torch.cat(parts)


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
        _shard_experts(model, mesh)
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


def _shard_experts(model: GPT, mesh) -> None:
    """Keep this rank's experts and give every :class:`MoE` its :class:`_EP` (see :func:`parallelize`)."""
    import torch.distributed as dist

    world, (R, T) = mesh.size(), (mesh["remat"].size(), mesh["tp"].size())
    g, t = mesh.get_coordinate()
    ranks = mesh.mesh.reshape(R, T).tolist()
    # Groups of the MoE's own (so its collectives never interleave with another user's on a shared group): one
    # over the world, and one per TP index over the remat dim (every rank creates every group, in one order).
    world_group = dist.new_group([r for row in ranks for r in row])
    dp_group = None
    for tt in range(T):
        grp = dist.new_group([ranks[gg][tt] for gg in range(R)])
        if tt == t:
            dp_group = grp
    # Positions in the groups' collectives: the world group's order is the experts' order, the remat group's the
    # token blocks' (the same on every TP index: row-major mesh, groups ordered by global rank).
    rank, dp_index = dist.get_rank(world_group), dist.get_rank(dp_group)
    if dp_index != g:
        raise ValueError(f"the mesh is not row-major: rank {dist.get_rank()} at remat {g} is {dp_index} in its group")
    ep = _EP(world_group, dp_group, world, R, dp_index, rank)
    n_local = model.cfg.moe_experts // world
    for block in model.blocks:
        if isinstance(block.mlp, MoE):
            block.mlp.ep = ep
            ex = block.mlp.experts
            for name in ("w_in", "w_out"):
                full = getattr(ex, name)
                p = nn.Parameter(full.detach()[rank * n_local : (rank + 1) * n_local].clone())
                if R > 1:
                    # sum over the remat indices' losses -> their mean, as FSDP averages ([Note: MoE dispatch])
                    p.register_hook(lambda grad, R=R: grad / R)
                setattr(ex, name, p)
