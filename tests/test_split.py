"""Split QKV, fused gate/up and per-head blocks: Muon on each part, bitwise equal to ``torch.optim.Muon`` on the parts
as separate params, for MHA and GQA, blocked and grouped row orders, sharded over TP (column-parallel by rows) and
remat, in sync and overlap mode."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlap_muon import GateUpSplit, HeadSplit, OverlapMuon, QKVSplit
from tests.dist_utils import run_ranks
from tests.models import HP, block, explicit_groups

D = 16
SPECS = {
    "mha_grouped": (QKVSplit(n_heads=4, n_kv_heads=4, head_dim=4, layout="grouped"), (48, D)),
    "gqa_blocked": (QKVSplit(n_heads=4, n_kv_heads=2, head_dim=4, layout="blocked"), (32, D)),
    "gqa_grouped": (QKVSplit(n_heads=4, n_kv_heads=2, head_dim=4, layout="grouped"), (32, D)),
    "gate_up": (GateUpSplit(), (64, D)),
    "heads": (HeadSplit(head_dim=8), (32, D)),
}


def test_qkv_parts_row_sets():
    assert QKVSplit(2, 1, 2, "blocked").parts((8, 4)) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    # grouped: per group (h/g q heads, k, v); g = h is this project's model.py layout [q0 k0 v0 | q1 k1 v1]
    assert QKVSplit(2, 2, 1, "grouped").parts((6, 4)) == [[0, 3], [1, 4], [2, 5]]
    assert QKVSplit(4, 2, 1, "grouped").parts((8, 4)) == [[0, 1, 4, 5], [2, 6], [3, 7]]
    with pytest.raises(ValueError, match="rows"):
        QKVSplit(4, 2, 4).parts((31, 16))


def test_bad_split_is_an_error_naming_the_param():
    model = nn.Sequential(nn.Linear(D, 30, bias=False))
    with pytest.raises(ValueError, match=r"'0.weight'.*30"):
        OverlapMuon(model, split={"0.weight": QKVSplit(4, 2, 4)})
    # a typo would silently leave the fused weight one matrix (a different optimizer): an error instead
    with pytest.raises(ValueError, match=r"split patterns \['0.wieght'\] match no Muon param"):
        OverlapMuon(model, split={"0.wieght": QKVSplit(4, 2, 4)})


def _full_grads(shape, steps):
    return [torch.randn(shape, generator=torch.Generator().manual_seed(100 + s)) for s in range(steps)]


def _reference(w0: torch.Tensor, spec, grads):
    """torch.optim.Muon on each part of ``w0`` as its own param; returns the reassembled full weight."""
    parts = spec.parts(tuple(w0.shape))
    ps = [nn.Parameter(w0[r].clone()) for r in parts]
    mu = torch.optim.Muon(ps, **HP)
    for gr in grads:
        for p, r in zip(ps, parts):
            p.grad = gr[r].clone()
        mu.step()
    out = torch.empty_like(w0)
    for p, r in zip(ps, parts):
        out[r] = p.detach()
    return out


def _run(R, T, g, t, spec, full_shape, overlap, steps=3, dtype=torch.float32):
    torch.manual_seed(0)
    w0 = torch.randn(full_shape).to(dtype)
    net = nn.Module()
    net.w = nn.Parameter(block(w0, 0, R, T, g, t).clone())
    net.w.partition_dim, net.w.full_shape = 0, full_shape
    extra = {}
    if R * T > 1:
        extra["tp_group"], extra["remat_group"] = explicit_groups(R, T, g, t)
    opt = OverlapMuon(net, muon_filter=lambda n, p: True, split={"w": spec}, overlap=overlap, **HP, **extra)
    grads = [gr.to(dtype) for gr in _full_grads(full_shape, steps)]
    for gr in grads:
        net.w.grad = block(gr, 0, R, T, g, t).contiguous()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    got = net.w.detach().clone()
    opt.close()
    return torch.equal(got, block(_reference(w0, spec, grads), 0, R, T, g, t))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_split_world1_bitwise(name, overlap, dtype):
    spec, shape = SPECS[name]
    assert _run(1, 1, 0, 0, spec, shape, overlap, dtype=dtype)


def test_unsplit_differs_from_split():
    """The split is a different optimizer: Muon on the fused matrix is not Muon on its parts."""
    spec, shape = SPECS["gqa_grouped"]
    torch.manual_seed(0)
    w0 = torch.randn(shape)
    p = nn.Parameter(w0.clone())
    mu = torch.optim.Muon([p], **HP)
    p.grad = _full_grads(shape, 1)[0]
    mu.step()
    assert not torch.equal(p.detach(), _reference(w0, spec, _full_grads(shape, 1)))


def _grid_body(rank, world, R, T):
    g, t = divmod(rank, T)
    return {(name, ov, dt): _run(R, T, g, t, *SPECS[name], ov, dtype=dt) for name in SPECS for ov in (False, True)
            for dt in (torch.float32, torch.bfloat16)}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("R,T", [pytest.param(1, 2, marks=pytest.mark.slow), pytest.param(1, 4, marks=pytest.mark.slow),
                                 pytest.param(2, 1, marks=pytest.mark.slow), (2, 2)])  # all but 2 x 2: long tier
def test_split_sharded_bitwise(R, T):
    """Column-parallel (partition_dim 0) shards over TP and remat: the home assembles the fused matrix, splits it,
    orthogonalizes the parts and scatters the result; each rank scales its rows by their part's lr ratio."""
    for res in run_ranks(_grid_body, R * T, R, T, timeout=150):
        bad = [k for k, ok in res.items() if not ok]
        assert not bad, bad


def _fsdp_body(rank, world, R, T):
    """A fused qkv / gate-up ``nn.Linear`` column-parallel over ``tp`` (ColwiseParallel) and FSDP2-sharded over
    ``remat`` (fully_shard), split into its parts, sync and overlap."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    from tests.models import set_grad

    out = {}
    for name in ("gqa_grouped", "mha_grouped", "gate_up"):
        spec, shape = SPECS[name]
        for overlap in (False, True):
            torch.manual_seed(0)
            w0 = torch.randn(shape)
            mesh = init_device_mesh("cpu", (R, T), mesh_dim_names=("remat", "tp"))
            net = nn.Module()
            net.lin = nn.Linear(shape[1], shape[0], bias=False)
            with torch.no_grad():
                net.lin.weight.copy_(w0)
            parallelize_module(net, mesh["tp"], {"lin": ColwiseParallel()})
            fully_shard(net, mesh=mesh["remat"])
            opt = OverlapMuon(net, device_mesh=mesh, split={"lin.weight": spec}, overlap=overlap, **HP)
            grads = _full_grads(shape, 3)
            g, t = divmod(rank, T)
            for gr in grads:
                set_grad(net.lin.weight, gr, 0, R, T, g, t)
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            out[(name, overlap)] = torch.equal(net.lin.weight.full_tensor(), _reference(w0, spec, grads))
            opt.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("R,T", [(2, 1), (2, 2)])
def test_split_fsdp2_tp_dtensor_bitwise(R, T):
    """FSDP2 remat 2 (and TP 2): DTensor weights ``(_StridedShard(0), Shard(0))``, split parts bitwise
    torch.optim.Muon on each part."""
    for res in run_ranks(_fsdp_body, R * T, R, T, timeout=200):
        bad = [k for k, ok in res.items() if not ok]
        assert not bad, bad
