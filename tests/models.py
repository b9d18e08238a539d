"""Test models and the sharding helpers the parity tests share.

``TinyNet`` has several distinct Muon shapes (non-square, odd, one tall), a ``partition_dim=None`` matrix, and
1-D params (norm, biases) for AdamW. It is built three ways: unsharded (the reference), as DTensors on a
``("remat", "tp")`` DeviceMesh (ColwiseParallel / RowwiseParallel + FSDP2 ``fully_shard``), and as plain local
shards carrying ``partition_dim`` / ``full_shape`` attributes (the Megatron convention).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

# name -> partition_dim (TP split of the full matrix), for the Muon matrices of TinyNet
PARTITION = {"up.weight": 0, "down.weight": 1, "proj.weight": None, "out.weight": 0, "gate.weight": 0}
ADAMW_KW = dict(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.01)


class TinyNet(nn.Module):
    def __init__(self, d: int = 12, h: int = 20, r: int = 7, o: int = 13) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.up = nn.Linear(d, h)  # (20, 12), colwise
        self.gate = nn.Linear(d, h, bias=False)  # (20, 12), colwise: a second matrix of the same shape
        self.down = nn.Linear(h, d, bias=False)  # (12, 20), rowwise
        self.proj = nn.Linear(d, r, bias=False)  # (7, 12), replicated over TP
        self.out = nn.Linear(r, o, bias=False)  # (13, 7): tall, colwise with replicated output

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        y = self.down(torch.nn.functional.gelu(self.up(y)) * self.gate(y)) + x
        return self.out(self.proj(y))


def block(full: torch.Tensor, pd: int | None, R: int, T: int, g: int, t: int) -> torch.Tensor:
    """Rank (g, t)'s block of a full (P, Q) tensor (docs/design.md §2), written with torch.chunk directly."""

    def pick(x: torch.Tensor, parts: int, i: int, dim: int) -> torch.Tensor:
        chunks = torch.chunk(x, parts, dim=dim)
        if i < len(chunks):
            return chunks[i]
        shape = list(x.shape)
        shape[dim] = 0
        return x.new_empty(shape)

    if pd == 0:
        return pick(pick(full, T, t, 0), R, g, 0)
    if pd == 1:
        return pick(pick(full, R, g, 0), T, t, 1)
    return pick(full, R, g, 0)


def build_dtensor_model(full: TinyNet, R: int, T: int):
    """TinyNet on a (R, T) ("remat", "tp") CPU mesh: TP plan + FSDP2, params copied from ``full``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (R, T), mesh_dim_names=("remat", "tp"))
    model = TinyNet()
    model.load_state_dict(full.state_dict())
    parallelize_module(
        model,
        mesh["tp"],
        {
            "up": ColwiseParallel(),
            "gate": ColwiseParallel(),
            "down": RowwiseParallel(),
            "out": ColwiseParallel(output_layouts=Replicate()),
        },
    )
    fully_shard(model, mesh=mesh["remat"])
    return model, mesh


def build_plain_model(full: TinyNet, R: int, T: int, g: int, t: int) -> TinyNet:
    """TinyNet whose Muon weights are plain local blocks with ``partition_dim`` and ``full_shape`` attributes;
    the other params are full copies (they are updated by AdamW elementwise on every rank)."""
    model = TinyNet()
    model.load_state_dict(full.state_dict())
    for name, pd in PARTITION.items():
        mod = model.get_submodule(name.rsplit(".", 1)[0])
        w = mod.weight
        loc = nn.Parameter(block(w.detach(), pd, R, T, g, t).clone())
        loc.partition_dim = pd
        loc.full_shape = tuple(w.shape)
        mod.weight = loc
    return model


def local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t._local_tensor if isinstance(t, DTensor) else t


def set_grad(p: torch.Tensor, full_grad: torch.Tensor, pd, R, T, g, t) -> None:
    """Give ``p`` (DTensor or plain block) the gradient whose full value is ``full_grad``."""
    from torch.distributed.tensor import DTensor

    if isinstance(p, DTensor):
        # Replicate -> p's placements is a local chunking (no communication), _StridedShard included.
        from torch.distributed.tensor import Replicate

        mesh = p.device_mesh
        rep = DTensor.from_local(full_grad.clone(), mesh, [Replicate()] * mesh.ndim, run_check=False)
        p.grad = rep.redistribute(mesh, p.placements)
    elif p.dim() == 2 and hasattr(p, "partition_dim"):
        p.grad = block(full_grad, p.partition_dim, R, T, g, t).contiguous()
    else:
        p.grad = full_grad.clone()


def coords(R: int, T: int) -> tuple[int, int]:
    r = dist.get_rank() if dist.is_initialized() else 0
    return divmod(r, T)


class ShardLinear(nn.Module):
    """Owns one Muon weight (a plain local block); ``forward(c) = (weight * c).sum()`` so its gradient is ``c``
    exactly, and calling it fires the module's forward pre-hooks like any layer."""

    def __init__(self, w: torch.Tensor, pd, full_shape) -> None:
        super().__init__()
        self.weight = nn.Parameter(w)
        self.weight.partition_dim = pd
        self.weight.full_shape = tuple(full_shape)

    def forward(self, c: torch.Tensor) -> torch.Tensor:
        return (self.weight * c).sum()


class PlainShardNet(nn.Module):
    """Muon weights as plain local blocks of TinyNet-like full shapes, plus one 1-D AdamW param.

    ``forward(cs, order=None, skip=())`` sums each layer's loss, ``cs[name]`` being that layer's local gradient;
    ``order`` permutes the layers (so backward reaches them in another order) and ``skip`` leaves some unused.
    """

    SHAPES = {"l0": ((20, 12), 0), "l1": ((12, 20), 1), "l2": ((7, 12), None), "l3": ((13, 7), 0),
              "l4": ((20, 12), 0), "l5": ((9, 9), 1)}

    def __init__(self, R: int, T: int, g: int, t: int, seed: int = 0) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.full = {}
        for name, (shape, pd) in self.SHAPES.items():
            full = torch.randn(shape, generator=gen)
            self.full[name] = full
            self.add_module(name, ShardLinear(block(full, pd, R, T, g, t).clone(), pd, shape))
        self.scale = nn.Parameter(torch.ones(5))
        self.coords = (R, T, g, t)

    def forward(self, cs, order=None, skip=()):
        names = list(order) if order is not None else list(self.SHAPES)
        loss = (self.scale * cs["scale"]).sum()
        for n in names:
            if n not in skip:
                loss = loss + getattr(self, n)(cs[n])
        return loss

    def local_grads(self, step: int, micro: int = 0) -> tuple[dict, dict]:
        """(local grads for forward, full grads for the reference) of a step/micro-batch, same on every rank."""
        R, T, g, t = self.coords
        gen = torch.Generator().manual_seed(10_000 + 100 * step + micro)
        fulls = {n: torch.randn(shape, generator=gen) for n, (shape, _) in self.SHAPES.items()}
        fulls["scale"] = torch.randn(5, generator=gen)
        locs = {n: block(fulls[n], pd, R, T, g, t).contiguous() for n, (_, pd) in self.SHAPES.items()}
        locs["scale"] = fulls["scale"]
        return locs, fulls


# ---------------------------------------------------------------------------------------------------------------
# shared by the optimizer tests
# ---------------------------------------------------------------------------------------------------------------
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
MUON_2D = dict(muon_filter=lambda name, p: p.ndim == 2)


def explicit_groups(R: int, T: int, g: int, t: int):
    """Explicit TP (ranks sharing g) and remat (ranks sharing t) groups; every rank creates all of them
    (``new_group`` is collective), then keeps its own. ``None`` for a size-1 dim."""
    tp = [dist.new_group([gg * T + tt for tt in range(T)]) for gg in range(R)] if T > 1 else None
    rm = [dist.new_group([gg * T + tt for gg in range(R)]) for tt in range(T)] if R > 1 else None
    return (tp[g] if tp else None), (rm[t] if rm else None)


def plain_opt(model: nn.Module, R: int, T: int, g: int, t: int, *, all_2d: bool = True, **kw):
    """OverlapMuon over plain local blocks on an R x T domain with explicit groups (Muon on every 2-D param when
    ``all_2d``, else on nn.Linear weights), the shared hyper-parameters and AdamW settings."""
    from tests.seams import SeamedOverlapMuon as OverlapMuon

    extra = dict(MUON_2D) if all_2d else {}
    if R * T > 1:
        extra["tp_group"], extra["remat_group"] = explicit_groups(R, T, g, t)
    return OverlapMuon(model, adamw_kwargs=ADAMW_KW, **extra, **HP, **kw)


class Deep(nn.Module):
    """``n`` square bias-free linears with tanh: a stack whose backward produces gradients last-layer first."""

    def __init__(self, n: int = 6, d: int = 16) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d, bias=False) for _ in range(n)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return x


def train_pair(model, opt, ref, ref_opts, xs, steps, between=None, after_step=None) -> None:
    """The same loop on a model and its reference: forward on ``xs[s]``, backward, ``between(m, opts, s)``, every
    optimizer's step, then every optimizer's zero_grad, then ``after_step(m, opts, s)``, for each ``s`` in
    ``steps``."""
    for s in steps:
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            m(xs[s]).pow(2).mean().backward()
            if between is not None:
                between(m, opts, s)
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad()
            if after_step is not None:
                after_step(m, opts, s)


def torch_ref_opts(ref: nn.Module) -> list[torch.optim.Optimizer]:
    """``torch.optim.Muon`` on ``ref``'s ``nn.Linear`` weights and ``torch.optim.AdamW`` on the rest (``HP``,
    ``ADAMW_KW``): the reference of the default split."""
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    return [torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **HP),
            torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)]


def fully_shard_tiny(model: TinyNet, mesh) -> None:
    """FSDP2 on a ``TinyNet``: ``up``, ``gate``, ``down`` each their own group, then the root."""
    from torch.distributed.fsdp import fully_shard

    for name in ("up", "gate", "down"):
        fully_shard(model.get_submodule(name), mesh=mesh)
    fully_shard(model, mesh=mesh)


def snapshot_mismatches(ours: list[list[torch.Tensor]], ref: list[list[torch.Tensor]], steps: int) -> list[str]:
    """The steps after which two runs' param snapshots (one list of tensors per step) differ, and a line if either
    run does not have ``steps`` snapshots."""
    bad = [f"step {s + 1}" for s, (a, b) in enumerate(zip(ours, ref))
           if not all(torch.equal(x, y) for x, y in zip(a, b))]
    if len(ours) != steps or len(ref) != steps:
        bad.append(f"{len(ours)} and {len(ref)} snapshots, expected {steps}")
    return bad


def full_mismatches(model: nn.Module, ref: nn.Module) -> list[str]:
    """Names of ``model``'s params whose full tensors (``full_tensor()`` of a DTensor; collective) differ from
    ``ref``'s, compared with ``torch.equal``."""
    got = [p.full_tensor().detach() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()]
    return [n for (n, _), a, b in zip(ref.named_parameters(), got, ref.parameters()) if not torch.equal(a, b)]


class MuonAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` + ``torch.optim.AdamW`` as one optimizer: the reference a framework's ``Trainer`` is given
    (Hugging Face's, Lightning's)."""

    def __init__(self, muon: list[nn.Parameter], adamw: list[nn.Parameter]) -> None:
        self.inner = (torch.optim.Muon(muon, **HP), torch.optim.AdamW(adamw, **ADAMW_KW))
        super().__init__([{"params": muon + adamw}], {})
        self.param_groups = [g for o in self.inner for g in o.param_groups]

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:  # Lightning passes its forward and backward as the closure
            with torch.enable_grad():
                loss = closure()
        for o in self.inner:
            o.step()
        return loss

    # Accelerate reloads the optimizer's state when it wraps it; the base class would then replace the groups with
    # copies the inner optimizers never see (an lr schedule would stop reaching them).
    def state_dict(self):
        return {"inner": [o.state_dict() for o in self.inner]}

    def load_state_dict(self, state_dict):
        for o, sd in zip(self.inner, state_dict["inner"]):
            o.load_state_dict(sd)
        self.param_groups = [g for o in self.inner for g in o.param_groups]


class PlainTPPair:
    """Full matrices ``specs`` (name -> ``((P, Q), TP partition_dim)``) as plain TP shards of this rank (``net``,
    carrying ``partition_dim`` and ``full_shape``) beside their unsharded copies (``ref``, for ``torch.optim.Muon``)."""

    def __init__(self, specs: dict, world: int, rank: int) -> None:
        self.specs, self.world, self.rank = specs, world, rank
        gen = torch.Generator().manual_seed(0)
        fulls = {n: torch.randn(*shape, generator=gen) * 0.1 for n, (shape, _) in specs.items()}
        self.net, self.ref = nn.Module(), {}
        for n, (shape, pd) in specs.items():
            w = nn.Parameter(self._mine(fulls[n], pd).clone())
            w.partition_dim, w.full_shape = pd, shape
            setattr(self.net, n, w)
            self.ref[n] = nn.Parameter(fulls[n].clone())

    def _mine(self, full: torch.Tensor, pd: int) -> torch.Tensor:
        size = full.shape[pd] // self.world
        return full.narrow(pd, self.rank * size, size)

    def train(self, opt, steps: int = 3, hook: bool = False) -> list[float]:
        """``steps`` steps of ``opt`` on the shards and ``torch.optim.Muon`` on the copies, the same gradients
        (``hook``: each param's grad-ready hook called by hand); per param, the largest difference after."""
        mu = torch.optim.Muon(list(self.ref.values()), **HP)
        for s in range(steps):
            g = torch.Generator().manual_seed(100 + s)
            for n, (shape, pd) in self.specs.items():
                full = torch.randn(*shape, generator=g)
                getattr(self.net, n).grad = self._mine(full, pd).clone()
                self.ref[n].grad = full
                if hook:
                    opt._rt.on_ready(opt._rt.index.first[id(getattr(self.net, n))])
            opt.step()
            mu.step()
            opt.zero_grad()
        opt.synchronize()
        return [float((getattr(self.net, n).detach() - self._mine(self.ref[n].detach(), pd)).abs().max())
                for n, (_, pd) in self.specs.items()]
