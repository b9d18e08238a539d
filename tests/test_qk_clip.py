"""QK-clip ([Note: QK-clip] in ``overlap_muon/qk_clip.py``): bitwise one process running ``torch.optim.Muon`` +
``AdamW`` and then :func:`qk_clip_reference` below, the rule on whole weights.

World 1 with a real forward (SDPA attention recording its logits with ``record_max_logits``), MHA, GQA and a fused
QKV; TP 2 and FSDP 2 x TP 2 with synthetic gradients and recorded logits that differ by data-parallel rank (the max
over every rank's batch is what counts), in both step modes.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overlap_muon import OverlapMuon
from overlap_muon.qk_clip import ATTR, QKClip, _row_factors, record_max_logits
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP

D, HD, STEPS = 16, 4, 3
MODES = [pytest.param({}, id="default"), pytest.param({"async_step": True}, id="async_step")]


def qk_clip_reference(spec: QKClip, s: torch.Tensor, weights: list[tuple[str, torch.Tensor]]) -> None:
    """The rule on whole weights, in place: ``weights`` are ``("q" | "k" | "qkv", full weight)`` of one layer,
    ``s`` its heads' max logits (the library's own per-row factors, applied to whole weights)."""
    for which, w in weights:
        w.mul_(_row_factors(spec, s, which, w.shape[0]).to(w.device)[:, None])


class Attn(nn.Module):
    """Causal attention over SDPA with separate or fused projections; records its heads' max logits."""

    def __init__(self, h: int, g: int, fused: bool) -> None:
        super().__init__()
        self.h, self.g, self.fused = h, g, fused
        if fused:  # QKVSplit "blocked" rows [Q; K; V]
            self.qkv = nn.Linear(D, (h + 2 * g) * HD, bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(D, n * HD, bias=False) for n in (h, g, g))
        self.o = nn.Linear(h * HD, D, bias=False)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        B, S, _ = x.shape
        y = self.norm(x)
        if self.fused:
            q, k, v = self.qkv(y).split([self.h * HD, self.g * HD, self.g * HD], dim=-1)
        else:
            q, k, v = self.q(y), self.k(y), self.v(y)
        q, k, v = (t.view(B, S, -1, HD).transpose(1, 2) for t in (q, k, v))
        record_max_logits(self, q, k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.g != self.h)
        return x + self.o(out.transpose(1, 2).reshape(B, S, -1))


class Net(nn.Module):
    def __init__(self, h: int = 4, g: int = 4, fused: bool = False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Attn(h, g, fused) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _spec(tau: float, h: int, g: int, fused: bool) -> QKClip:
    if fused:
        return QKClip(tau, h, HD, n_kv_heads=g, qkv="layers.*.qkv.weight")
    return QKClip(tau, h, HD, n_kv_heads=g, query="layers.*.q.weight", key="layers.*.k.weight")


def _ref_weights(layer: Attn) -> list:
    return [("qkv", layer.qkv.weight)] if layer.fused else [("q", layer.q.weight), ("k", layer.k.weight)]


def _torch_opts(ref: nn.Module) -> list[torch.optim.Optimizer]:
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    return [torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **HP),
            torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)]


def _train_world1(tau: float, h: int, g: int, fused: bool, **kw):
    torch.manual_seed(0)
    model = Net(h, g, fused)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(4.0)  # large weights: large logits, so that a moderate tau bites
    ref = copy.deepcopy(model)
    spec = _spec(tau, h, g, fused)
    opt = OverlapMuon(model, qk_clip=spec, adamw_kwargs=ADAMW_KW, **HP, **kw)
    ref_opts = _torch_opts(ref)
    gen = torch.Generator().manual_seed(1)
    seen = []
    for _ in range(STEPS):
        x = torch.randn(2, 6, D, generator=gen)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).mean().backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for layer in ref.layers:
                s = getattr(layer, ATTR)
                seen.append(s.clone())
                qk_clip_reference(spec, s, _ref_weights(layer))
                setattr(layer, ATTR, None)
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    clipped = opt.stats["qk_clipped_heads"]
    opt.close()
    return bad, clipped, torch.stack(seen)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("h,g,fused", [(4, 4, False), (4, 2, False), (4, 2, True)], ids=["mha", "gqa", "fused"])
def test_world1_bitwise_against_torch_then_the_rule(h, g, fused, mode):
    bad, clipped, seen = _train_world1(2.0, h, g, fused, **mode)
    assert bad == [], bad
    assert clipped > 0 and seen.max() > 2.0  # the threshold bites on some heads


def test_no_head_over_tau_changes_nothing():
    """tau above every logit: bitwise plain torch Muon + AdamW (the reference's rule is then the identity)."""
    bad, clipped, seen = _train_world1(1e6, 4, 2, False)
    assert bad == [] and clipped == 0 and seen.max() < 1e6


def test_every_head_over_tau():
    """tau below every logit of the first step: every head of both layers clipped there (later steps see the
    clipped weights, some heads then below tau), bitwise throughout."""
    bad, clipped, seen = _train_world1(1e-3, 4, 2, False)
    assert bad == [] and bool((seen[:2] > 1e-3).all())
    assert clipped >= 2 * 4


def test_bad_spec_is_a_clear_error():
    with pytest.raises(ValueError, match="match no Muon weight"):
        OverlapMuon(Net(), qk_clip=QKClip(1.0, 4, HD, query="*.nope", key="*.nada"), **HP)
    with pytest.raises(ValueError, match="should have 8 rows"):
        OverlapMuon(Net(4, 4), qk_clip=QKClip(1.0, 2, HD, query="layers.*.q.weight", key="layers.*.k.weight"), **HP)


# ---------------------------------------------------------------------------------------------------------------
# TP 2 and FSDP 2 x TP 2: synthetic gradients, recorded logits set per rank
# ---------------------------------------------------------------------------------------------------------------
_PD = {"q": 0, "k": 0, "v": 0, "o": 1}  # Megatron's layout: column-parallel q, k, v; row-parallel o


def _dist_body(rank, world, tp, h, g, mode, plain=False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import distribute_tensor
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from tests.models import block, explicit_groups

    R = world // tp
    g_rank, t_rank = divmod(rank, tp)
    torch.manual_seed(0)
    full = Net(h, g)
    ref = copy.deepcopy(full)
    model = copy.deepcopy(full)
    spec = _spec(3.0, h, g, False)
    if plain:  # plain row/column blocks carrying partition_dim, explicit groups
        for layer in model.layers:
            for name, pd in _PD.items():
                w = getattr(layer, name).weight
                loc = nn.Parameter(block(w.detach(), pd, R, tp, g_rank, t_rank).clone())
                loc.partition_dim, loc.full_shape = pd, tuple(w.shape)
                getattr(layer, name).weight = loc
        tp_group, remat_group = explicit_groups(R, tp, g_rank, t_rank)
        where = dict(tp_group=tp_group, remat_group=remat_group)
    else:
        mesh = init_device_mesh("cpu", (R, tp), mesh_dim_names=("remat", "tp"))
        for layer in model.layers:
            parallelize_module(layer, mesh["tp"], {"q": ColwiseParallel(), "k": ColwiseParallel(),
                                                   "v": ColwiseParallel(), "o": RowwiseParallel()})
            if R > 1:
                fully_shard(layer, mesh=mesh["remat"])
        where = dict(device_mesh=mesh)
    opt = OverlapMuon(model, qk_clip=spec, adamw_kwargs=ADAMW_KW, **where, **HP, **mode)
    ref_opts = _torch_opts(ref)
    gen = torch.Generator().manual_seed(2)
    for _ in range(STEPS):
        grads = [torch.randn(p.shape, generator=gen) for p in full.parameters()]
        s_full = [torch.rand(h, generator=gen) * 6.0 for _ in model.layers]  # about half the heads over 3.0
        for p, gr in zip(model.parameters(), grads):
            if hasattr(p, "device_mesh"):
                p.grad = distribute_tensor(gr, p.device_mesh, p.placements, src_data_rank=None)
            else:
                p.grad = block(gr, p.partition_dim, R, tp, g_rank, t_rank).clone() if hasattr(p, "partition_dim") \
                    else gr.clone()
        for layer, s in zip(model.layers, s_full):
            mine = s.view(tp, -1)[t_rank]  # this TP rank's heads
            setattr(layer, ATTR, mine * (1.0 if g_rank == 0 else 0.5))  # the max over DP ranks is rank 0's
        opt.step()
        opt.zero_grad()
        for p, gr in zip(ref.parameters(), grads):
            p.grad = gr.clone()
        for o in ref_opts:
            o.step()
            o.zero_grad()
        with torch.no_grad():
            for layer, s in zip(ref.layers, s_full):
                qk_clip_reference(spec, s, _ref_weights(layer))
    opt.synchronize()
    got = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in model.parameters()]
    want = [block(q.detach(), p.partition_dim, R, tp, g_rank, t_rank) if hasattr(p, "partition_dim") else q
            for p, q in zip(model.parameters(), ref.parameters())]  # a plain shard: its block of the reference
    bad = [n for (n, _), a, b in zip(ref.named_parameters(), got, want) if not torch.equal(a, b)]
    clipped = opt.stats["qk_clipped_heads"]
    opt.close()
    return bad, clipped


@pytest.mark.timeout(200)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("world,tp,h,g", [(2, 2, 4, 2), (4, 2, 4, 4)], ids=["tp2_gqa", "fsdp2xtp2_mha"])
def test_distributed_bitwise(world, tp, h, g, mode):
    for bad, clipped in run_ranks(_dist_body, world, tp, h, g, mode, timeout=180):
        assert bad == [], bad
        assert 0 < clipped < STEPS * 2 * h


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world,tp,h,g", [(2, 2, 4, 2), (4, 2, 4, 4)], ids=["tp2_gqa", "remat2xtp2_mha"])
def test_plain_shards_bitwise(world, tp, h, g):
    """Megatron-style plain blocks with ``partition_dim`` and explicit groups: each rank scales its own rows."""
    for bad, clipped in run_ranks(_dist_body, world, tp, h, g, {}, True, timeout=180):
        assert bad == [], bad
        assert 0 < clipped < STEPS * 2 * h
