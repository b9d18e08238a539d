"""The training job's mixture of experts: top-k routing over expert-parallel grouped weights, and how the experts
are laid out over the ranks ([Note: MoE dispatch]). ``model.py`` builds the blocks that hold them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn
import torch.nn.functional as F

if TYPE_CHECKING:
    from .model import ModelConfig

__all__ = ["Experts", "MoE", "expert_params", "full_experts", "shard_experts"]


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


def shard_experts(model: nn.Module, mesh: Any) -> None:
    """Keep this rank's experts and give every :class:`MoE` its :class:`_EP` (``model.parallelize``; collective)."""
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
