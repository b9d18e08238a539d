"""Robustness: tied weights, activation checkpointing, non-finite gradients.

Every check compares with ``torch.optim.Muon`` + ``torch.optim.AdamW`` on an unsharded copy (or with a run that
differs only in the feature under test), bitwise: ``torch.equal``, or ``assert_close(rtol=0, atol=0,
equal_nan=True)`` where NaNs are expected. The distributed checks of one world size share one spawn.
"""

from __future__ import annotations

import math
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import (
    ADAMW_KW,
    HP,
    PARTITION,
    PlainShardNet,
    TinyNet,
    block,
    build_dtensor_model,
    local,
    plain_opt,
    set_grad,
)



# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _exact(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal values, NaN == NaN (same positions)."""
    try:
        torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)
        return True
    except AssertionError:
        return False


def _ns_total(opt) -> int:
    """Matrices NS'd so far over the whole domain."""
    n = torch.tensor([opt.stats["ns_matrices"]])
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(n)
    return int(n.item())


def _guard(fn, *args) -> list[str]:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test
        return [f"raised:\n{traceback.format_exc()}"]


def _full_grads(step: int) -> dict[str, torch.Tensor]:
    """PlainShardNet's full gradients of a step (the same on every rank)."""
    return PlainShardNet(1, 1, 0, 0).local_grads(step)[1]


def _local_grads(full: dict, R, T, g, t) -> dict[str, torch.Tensor]:
    locs = {n: block(full[n], pd, R, T, g, t).contiguous() for n, (_, pd) in PlainShardNet.SHAPES.items()}
    locs["scale"] = full["scale"].clone()
    return locs


def _reference_plain(grads, skip_steps=(), tie=None):
    """torch.optim.Muon + AdamW on PlainShardNet's full matrices. ``grads[s]``: full grads of step s; steps in
    ``skip_steps`` are not taken at all; ``tie=(a, b)``: b's weight is a's (gradient = the sum of both uses)."""
    net = PlainShardNet(1, 1, 0, 0)
    names = [n for n in net.SHAPES if not (tie and n == tie[1])]
    fulls = {n: nn.Parameter(net.full[n].clone()) for n in names}
    scale = nn.Parameter(torch.ones(5))
    mu = torch.optim.Muon(list(fulls.values()), **HP)
    aw = torch.optim.AdamW([scale], **ADAMW_KW)
    for s, fg in enumerate(grads):
        if s in skip_steps:
            continue
        for n, p in fulls.items():
            p.grad = fg[n] + fg[tie[1]] if tie and n == tie[0] else fg[n].clone()
        scale.grad = fg["scale"].clone()
        mu.step()
        aw.step()
    return fulls, scale, mu, aw


def _compare_plain(net, opt, ref, R, T, g, t, tag, names=None) -> list[str]:
    fulls, scale, mu, aw = ref
    bad = []
    for n in names or fulls:
        pd = PlainShardNet.SHAPES[n][1]
        w = getattr(net, n).weight
        if not _exact(w.detach(), block(fulls[n].detach(), pd, R, T, g, t)):
            bad.append(f"{tag}: param {n}")
        if not _exact(opt.state[w]["momentum_buffer"], block(mu.state[fulls[n]]["momentum_buffer"], pd, R, T, g, t)):
            bad.append(f"{tag}: momentum {n}")
    if not _exact(net.scale.detach(), scale.detach()):
        bad.append(f"{tag}: AdamW param scale")
    for k, v in aw.state[scale].items():
        if not _exact(opt.state[net.scale][k], v):
            bad.append(f"{tag}: AdamW state scale.{k}")
    return bad


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    opt.synchronize()
    out = {}
    for n, p in model.named_parameters():
        out[f"param {n}"] = local(p).detach().clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state {n}.{k}"] = local(v).detach().clone()
    return out


def _same_snapshot(a, b, tag) -> list[str]:
    if a.keys() != b.keys():
        return [f"{tag}: state keys changed: {sorted(set(a) ^ set(b))}"]
    return [f"{tag}: {k} changed" for k in a if not torch.equal(a[k], b[k])]


# ---------------------------------------------------------------------------------------------------------------
# tied weights
# ---------------------------------------------------------------------------------------------------------------
class _Tied(nn.Module):
    """``a`` and ``b`` share one weight Parameter; ``c`` is called twice per forward."""

    def __init__(self, d=10) -> None:
        super().__init__()
        self.a = nn.Linear(d, d, bias=False)
        self.c = nn.Linear(d, d)
        self.b = nn.Linear(d, d, bias=False)
        self.b.weight = self.a.weight
        self.last = nn.Linear(d, 6, bias=False)  # not named "head": an output head goes to AdamW by default

    def forward(self, x):
        x = torch.tanh(self.a(x))
        x = torch.tanh(self.c(x))
        x = torch.tanh(self.c(x))
        x = torch.tanh(self.b(x))
        return self.last(x)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("overlap", [True, False])
def test_tied_weight_and_module_called_twice_single_process(overlap):
    """A tied weight (two modules) and a module used twice: NS once per distinct matrix per step, on the full
    (summed) gradient: params equal torch.optim.Muon's."""
    steps = 3
    torch.manual_seed(0)
    model = _Tied()
    ref = _Tied()
    ref.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, overlap=overlap, **HP)
    assert opt.muon_param_names == ["a.weight", "c.weight", "last.weight"]
    mu = torch.optim.Muon([ref.a.weight, ref.c.weight, ref.last.weight], **HP)
    aw = torch.optim.AdamW([ref.c.bias], **ADAMW_KW)
    gen = torch.Generator().manual_seed(7)
    for s in range(steps):
        x = torch.randn(5, 10, generator=gen)
        model(x).pow(2).sum().backward()
        opt.step()
        opt.zero_grad()
        ref(x).pow(2).sum().backward()
        mu.step()
        aw.step()
        mu.zero_grad()
        aw.zero_grad()
    opt.synchronize()
    assert opt.stats["ns_matrices"] == 3 * steps
    assert model.a.weight is model.b.weight
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        assert torch.equal(p, q), f"overlap={overlap}: {n} differs from torch.optim.Muon/AdamW"
    assert torch.equal(opt.state[model.a.weight]["momentum_buffer"], mu.state[ref.a.weight]["momentum_buffer"])
    opt.close()


def _check_tied_plain(R, T, g, t):
    """PlainShardNet with l4's weight tied to l0's (same full shape and partition_dim)."""
    steps = 3
    grads = [_full_grads(s) for s in range(steps)]
    ref = _reference_plain(grads, tie=("l0", "l4"))
    bad = []
    for overlap in (True, False):
        net = PlainShardNet(R, T, g, t)
        net.l4.weight = net.l0.weight
        opt = plain_opt(net, R, T, g, t, overlap=overlap)
        for s in range(steps):
            net(_local_grads(grads[s], R, T, g, t)).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        tag = f"tied {R}x{T} overlap={overlap}"
        if _ns_total(opt) != 5 * steps:
            bad.append(f"{tag}: {_ns_total(opt)} matrices NS'd in {steps} steps, expected {5 * steps}")
        bad += _compare_plain(net, opt, ref, R, T, g, t, tag)
        opt.close()
    return bad


# ---------------------------------------------------------------------------------------------------------------
# activation checkpointing
# ---------------------------------------------------------------------------------------------------------------
class _Deep(nn.Module):
    """``n`` tanh(Linear) layers; ``segments`` (tuples of consecutive layer indices) run under
    ``torch.utils.checkpoint``. With ``replicated_tp``, the weights carry ``partition_dim=None`` (each TP peer
    holds the full matrix), so the same unsharded forward runs on every rank of a 1xT domain."""

    def __init__(self, n=6, d=16, segments=(), reentrant=True, replicated_tp=False) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(d, d) for _ in range(n)])
        self.starts = {seg[0]: seg for seg in segments}
        self.reentrant = reentrant
        if replicated_tp:
            for layer in self.layers:
                layer.weight.partition_dim = None

    def _run(self, idx):
        def f(x):
            for i in idx:
                x = torch.tanh(self.layers[i](x))
            return x

        return f

    def forward(self, x):
        i = 0
        while i < len(self.layers):
            seg = self.starts.get(i)
            if seg is not None:
                x = checkpoint(self._run(seg), x, use_reentrant=self.reentrant)
                i = seg[-1] + 1
            else:
                x = torch.tanh(self.layers[i](x))
                i += 1
        return x


CKPT_CONFIGS = [
    ("middle", ((1, 2), (3, 4))),
    ("all", ((0, 1, 2), (3, 4, 5))),
    ("last", ((4, 5),)),
]
CKPT_STEPS = 3


def _ckpt_runs(R, T, g, t) -> list[str]:
    """Overlap on; every checkpointed variant == the run without checkpointing == torch.optim.Muon, bitwise."""
    xs = [torch.randn(8, 16, generator=torch.Generator().manual_seed(20 + s)) for s in range(CKPT_STEPS)]

    def run(segments=(), reentrant=True):
        torch.manual_seed(0)
        model = _Deep(segments=segments, reentrant=reentrant, replicated_tp=T > 1)
        opt = plain_opt(model, R, T, g, t, all_2d=False, overlap=True)
        for s in range(CKPT_STEPS):
            x = xs[s].clone().requires_grad_(True)  # a reentrant segment at layer 0 needs an input that requires grad
            model(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
        snap = _snapshot(model, opt)
        n = _ns_total(opt)
        opt.close()
        return snap, n

    bad = []
    base, n_base = run()
    # the baseline against torch.optim.Muon + AdamW on an unsharded copy
    torch.manual_seed(0)
    ref = _Deep()
    mu = torch.optim.Muon([m.weight for m in ref.layers], **HP)
    aw = torch.optim.AdamW([m.bias for m in ref.layers], **ADAMW_KW)
    for s in range(CKPT_STEPS):
        ref(xs[s].clone().requires_grad_(True)).pow(2).mean().backward()
        mu.step()
        aw.step()
        mu.zero_grad()
        aw.zero_grad()
    for n, p in ref.named_parameters():
        if not torch.equal(base[f"param {n}"], p.detach()):
            bad.append(f"{R}x{T} no checkpointing: {n} differs from torch.optim.Muon/AdamW")
    if n_base != 6 * CKPT_STEPS:
        bad.append(f"{R}x{T} no checkpointing: {n_base} matrices NS'd")
    for name, segments in CKPT_CONFIGS:
        for reentrant in (True, False):
            tag = f"{R}x{T} checkpoint {name} use_reentrant={reentrant}"
            snap, n = run(segments, reentrant)
            bad += _same_snapshot(base, snap, tag)
            if n != 6 * CKPT_STEPS:
                bad.append(f"{tag}: {n} matrices NS'd in {CKPT_STEPS} steps, expected {6 * CKPT_STEPS}")
    return bad


@pytest.mark.timeout(60)
def test_activation_checkpointing_single_process():
    bad = _ckpt_runs(1, 1, 0, 0)
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# non-finite gradients
# ---------------------------------------------------------------------------------------------------------------
BAD_STEP = 2
NF_STEPS = 4
# (param, full-matrix position, value): each position lies in rank 1's block only on a 1x2 domain
POISON = {"inf": ("l1", (3, 15), math.inf), "nan": ("l3", (10, 2), math.nan)}


def _poisoned_grads(kind):
    grads = [_full_grads(s) for s in range(NF_STEPS)]
    n, pos, val = POISON[kind]
    grads[BAD_STEP][n][pos] = val
    return grads


def _check_nonfinite_plain(R, T, g, t):
    bad = []
    for kind in ("inf", "nan"):
        grads = _poisoned_grads(kind)
        n_bad = POISON[kind][0]
        holds = not bool(torch.isfinite(_local_grads(grads[BAD_STEP], R, T, g, t)[n_bad]).all())
        if holds != (g * T + t == R * T - 1):
            bad.append(f"{R}x{T} {kind}: the non-finite value is not on the last rank only (test setup)")
        for overlap in (True, False):
            # skip_nonfinite=True: the bad step is skipped on every rank, the others match a reference without it
            net = PlainShardNet(R, T, g, t)
            opt = plain_opt(net, R, T, g, t, overlap=overlap, skip_nonfinite=True)
            tag = f"{R}x{T} {kind} overlap={overlap} skip"
            for s in range(NF_STEPS):
                if s == BAD_STEP:
                    before = _snapshot(net, opt)
                net(_local_grads(grads[s], R, T, g, t)).backward()
                opt.step()
                opt.zero_grad()
                if s == BAD_STEP:
                    bad += _same_snapshot(before, _snapshot(net, opt), f"{tag} (holds the bad value: {holds})")
            opt.synchronize()
            if opt.stats["skipped_steps"] != 1:
                bad.append(f"{tag}: stats['skipped_steps'] == {opt.stats['skipped_steps']}")
            bad += _compare_plain(net, opt, _reference_plain(grads, skip_steps=(BAD_STEP,)), R, T, g, t, tag)
            opt.close()
            # skip_nonfinite=False: NaN/inf propagate exactly as in torch.optim.Muon
            net = PlainShardNet(R, T, g, t)
            opt = plain_opt(net, R, T, g, t, overlap=overlap, skip_nonfinite=False)
            for s in range(NF_STEPS):
                net(_local_grads(grads[s], R, T, g, t)).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            tag = f"{R}x{T} {kind} overlap={overlap} no-skip"
            ref = _reference_plain(grads)
            if not torch.isnan(ref[0][n_bad]).any():
                bad.append(f"{tag}: the reference did not propagate the {kind} (test setup)")
            bad += _compare_plain(net, opt, ref, R, T, g, t, tag)
            opt.close()
    return bad


@pytest.mark.timeout(60)
def test_nonfinite_single_process():
    bad = _check_nonfinite_plain(1, 1, 0, 0)
    assert not bad, "\n".join(bad)


# DTensor 2x2: down.weight (12, 20) rowwise: rank 3 = (g=1, t=1) holds rows 6..11, cols 10..19
DT_BAD = ("down.weight", (8, 15))
DT_STEPS, DT_BAD_STEP = 3, 1


def _dt_grads():
    torch.manual_seed(0)
    shapes = {n: p.shape for n, p in TinyNet().named_parameters()}
    out = []
    for s in range(DT_STEPS):
        gen = torch.Generator().manual_seed(1000 + s)
        out.append({n: torch.randn(shape, generator=gen) for n, shape in shapes.items()})
    out[DT_BAD_STEP][DT_BAD[0]][DT_BAD[1]] = math.inf
    return out


def _dt_reference(grads, skip_steps):
    torch.manual_seed(0)
    ref = TinyNet()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    mu = torch.optim.Muon([p for n, p in ref.named_parameters() if n in PARTITION], **HP)
    aw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in PARTITION], **ADAMW_KW)
    for s, gs in enumerate(grads):
        if s in skip_steps:
            continue
        for n, p in ref.named_parameters():
            p.grad = gs[n].clone()
        mu.step()
        aw.step()
    return init, ref, mu


def _check_nonfinite_dtensor(R, T, g, t):
    from torch.distributed.tensor import DTensor

    grads = _dt_grads()
    bad = []
    for skip in (True, False):
        init, ref, mu = _dt_reference(grads, (DT_BAD_STEP,) if skip else ())
        for overlap in (True, False):
            full = TinyNet()
            full.load_state_dict(init)
            model, mesh = build_dtensor_model(full, R, T)
            opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, skip_nonfinite=skip,
                              **HP)
            tag = f"dtensor {R}x{T} overlap={overlap} skip_nonfinite={skip}"
            for s in range(DT_STEPS):
                for n, p in model.named_parameters():
                    set_grad(p, grads[s][n], PARTITION.get(n), R, T, g, t)
                if s == DT_BAD_STEP:
                    holds = not bool(torch.isfinite(local(dict(model.named_parameters())[DT_BAD[0]].grad)).all())
                    if holds != (dist.get_rank() == 3):
                        bad.append(f"{tag}: the non-finite value is not on rank 3 only (test setup)")
                    before = _snapshot(model, opt)
                opt.step()
                opt.zero_grad()
                if s == DT_BAD_STEP and skip:
                    bad += _same_snapshot(before, _snapshot(model, opt), tag)
            opt.synchronize()
            if opt.stats["skipped_steps"] != int(skip):
                bad.append(f"{tag}: stats['skipped_steps'] == {opt.stats['skipped_steps']}")
            ref_params = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                fp = ref_params[n].detach()
                if n in PARTITION:
                    ok = _exact(local(p).detach(), block(fp, PARTITION[n], R, T, g, t))
                    ok = ok and _exact(
                        local(opt.state[p]["momentum_buffer"]),
                        block(mu.state[ref_params[n]]["momentum_buffer"], PARTITION[n], R, T, g, t),
                    )
                else:
                    ok = _exact(p.full_tensor() if isinstance(p, DTensor) else p.detach(), fp)
                if not ok:
                    bad.append(f"{tag}: {n}")
            opt.close()
    return bad


# ---------------------------------------------------------------------------------------------------------------
# distributed runs (one spawn per world size)
# ---------------------------------------------------------------------------------------------------------------
def _world2(rank, world):
    g, t = 0, rank
    return {
        "tied": _guard(_check_tied_plain, 1, 2, g, t),
        "ckpt": _guard(_ckpt_runs, 1, 2, g, t),
        "nonfinite": _guard(_check_nonfinite_plain, 1, 2, g, t),
    }


@pytest.fixture(scope="module")
def world2():
    return run_ranks(_world2, 2, timeout=110)


def _failures(res, key):
    return [f"rank {r}: {f}" for r, d in enumerate(res) for f in d[key]]


@pytest.mark.timeout(120)
def test_tied_weight_plain_1x2(world2):
    bad = _failures(world2, "tied")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
def test_activation_checkpointing_plain_1x2(world2):
    bad = _failures(world2, "ckpt")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
def test_nonfinite_gradient_on_one_rank_plain_1x2(world2):
    """inf / NaN in one Muon gradient on rank 1 only: with skip_nonfinite the step is skipped on both ranks
    (params, momentum, AdamW state untouched, skipped_steps == 1) and the run matches torch's without that
    step; without it the values propagate exactly as in torch.optim.Muon."""
    bad = _failures(world2, "nonfinite")
    assert not bad, "\n".join(bad[:20])


def _world4(rank, world):
    g, t = divmod(rank, 2)
    return {"nonfinite": _guard(_check_nonfinite_dtensor, 2, 2, g, t)}


@pytest.mark.timeout(120)
def test_nonfinite_gradient_on_one_rank_dtensor_2x2():
    res = run_ranks(_world4, 4, timeout=110)
    bad = _failures(res, "nonfinite")
    assert not bad, "\n".join(bad[:20])
