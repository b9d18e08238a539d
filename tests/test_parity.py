"""Bitwise parity of OverlapMuon (synchronous path) with torch.optim.Muon + torch.optim.AdamW (docs/design.md, invariant 1).

Every rank trains an unsharded reference copy with the same gradients and compares its own shards of every
param and momentum buffer with ``torch.equal``. Gradients are set directly (not computed by a TP forward),
because a RowwiseParallel forward splits a reduction and is not bitwise equal to the unsharded forward: this
test isolates the optimizer's math, which must be exact.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, PARTITION, TinyNet, block, build_dtensor_model, build_plain_model, local, set_grad

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)
STEPS = 3


def _grads(full: TinyNet, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in full.named_parameters()}


def _reference(adjust_lr_fn, steps=STEPS, skip=()):
    torch.manual_seed(0)
    ref = TinyNet()
    init = {k: v.clone() for k, v in ref.state_dict().items()}
    muon_p = [p for n, p in ref.named_parameters() if n in PARTITION]
    other = [p for n, p in ref.named_parameters() if n not in PARTITION]
    mu = torch.optim.Muon(muon_p, adjust_lr_fn=adjust_lr_fn, **HP)
    aw = torch.optim.AdamW(other, **ADAMW_KW)
    for s in range(steps):
        gs = _grads(ref, s)
        for n, p in ref.named_parameters():
            p.grad = None if (s, n) in skip else gs[n].clone()
        mu.step()
        aw.step()
    return init, ref, mu


def _compare(model, ref, mu, R, T, g, t, tag):
    ref_params = dict(ref.named_parameters())
    bad = []
    for n, p in model.named_parameters():
        fp = ref_params[n].detach()
        if n in PARTITION:
            exp = block(fp, PARTITION[n], R, T, g, t)
        else:
            exp = None
        loc = local(p).detach()
        if exp is None:
            # 1-D / AdamW params: compare via the full tensor
            from torch.distributed.tensor import DTensor

            got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            if not torch.equal(got, fp):
                bad.append(f"{tag}: param {n}")
            continue
        if not torch.equal(loc, exp):
            bad.append(f"{tag}: param {n} max diff {(loc.float() - exp.float()).abs().max().item()}")
    return bad


def _run_grid(rank, world, R, T, configs):
    torch.manual_seed(0)
    g, t = divmod(rank, T)
    failures = []
    for form, fused, mode, adj in configs:
        init, ref, mu = _reference(adj)
        full = TinyNet()
        full.load_state_dict(init)
        if form == "dtensor":
            model, mesh = build_dtensor_model(full, R, T)
            opt = OverlapMuon(model, adjust_lr_fn=adj, adamw_kwargs=ADAMW_KW, device_mesh=mesh, overlap=False,
                              fused_a2a=fused, mode=mode, **HP)
        else:
            model = build_plain_model(full, R, T, g, t)
            import torch.distributed as dist

            # explicit groups: TP = ranks sharing g, remat = ranks sharing t (Megatron convention)
            tp_groups = [dist.new_group([gg * T + tt for tt in range(T)]) for gg in range(R)]
            remat_groups = [dist.new_group([gg * T + tt for gg in range(R)]) for tt in range(T)]
            opt = OverlapMuon(model, adjust_lr_fn=adj, adamw_kwargs=ADAMW_KW, tp_group=tp_groups[g] if T > 1 else None,
                              remat_group=remat_groups[t] if R > 1 else None, overlap=False, fused_a2a=fused,
                              mode=mode, **HP)
        tag = f"{R}x{T} {form} fused={fused} {mode} {adj}"
        for s in range(STEPS):
            gs = _grads(full, s)
            for n, p in model.named_parameters():
                set_grad(p, gs[n], PARTITION.get(n), R, T, g, t)
            opt.step()
        failures += _compare(model, ref, mu, R, T, g, t, tag)
        # momentum buffers
        ref_params = dict(ref.named_parameters())
        for n, p in model.named_parameters():
            if n in PARTITION:
                exp = block(mu.state[ref_params[n]]["momentum_buffer"], PARTITION[n], R, T, g, t)
                got = local(opt.state[p]["momentum_buffer"])
                if not torch.equal(got, exp):
                    failures.append(f"{tag}: momentum {n}")
        # each matrix NS'd exactly once per step across the domain
        counts = torch.tensor([opt.stats["ns_matrices"]])
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(counts)
        if counts.item() != STEPS * len(PARTITION) * (world if mode == "duplicated" else 1):
            failures.append(f"{tag}: {counts.item()} NS'd matrices in {STEPS} steps")
        opt.close()
    return failures


GRIDS = [(1, 1), (1, 2), (2, 1), (2, 2), (1, 3), (3, 1), (1, 4)]
ALL_CONFIGS = [
    (form, fused, mode, adj)
    for form, fused, mode, adj in itertools.product(
        ("dtensor", "plain"), (True, False), ("layer_sharded", "duplicated"), ("original", "match_rms_adamw")
    )
]


# The default tier keeps one process, a square grid and an odd TP size; the others join the long tier (-m slow).
_DEFAULT_GRIDS = {(1, 1), (2, 2), (1, 3)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("R,T", [pytest.param(*g, marks=() if g in _DEFAULT_GRIDS else pytest.mark.slow) for g in GRIDS],
                         ids=[f"{r}x{t}" for r, t in GRIDS])
def test_parity_grid(R, T):
    """Params and momentum equal torch.optim.Muon + AdamW bitwise, for every input form and toggle."""
    results = run_ranks(_run_grid, R * T, R, T, ALL_CONFIGS, timeout=280)
    failures = [f for r in results for f in r]
    assert not failures, "\n".join(failures[:20])


def _single_process(rank, world):
    """One process, no groups, no mesh: the same code path (world size 1)."""
    return _run_single()


def _run_single():
    failures = []
    for adj in ("original", "match_rms_adamw"):
        init, ref, mu = _reference(adj)
        model = TinyNet()
        model.load_state_dict(init)
        opt = OverlapMuon(model, adjust_lr_fn=adj, adamw_kwargs=ADAMW_KW, overlap=False, **HP)
        for s in range(STEPS):
            gs = _grads(model, s)
            for n, p in model.named_parameters():
                p.grad = gs[n].clone()
            opt.step()
        for (n, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
            if not torch.equal(p, q):
                failures.append(f"single {adj}: {n}")
        opt.close()
    return failures


def test_single_process_without_dist():
    assert _run_single() == []


def test_update_differs_from_sgd_and_counts_ns():
    """Guards against a no-op NS: the update must not be plain SGD, and NS runs once per Muon matrix."""
    torch.manual_seed(0)
    model = TinyNet()
    sgd = TinyNet()
    sgd.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, lr=0.02, weight_decay=0.0, momentum=0.0, nesterov=False, overlap=False,
                      batch_ns=True, adamw_kwargs=ADAMW_KW)
    gs = _grads(model, 0)
    for n, p in model.named_parameters():
        p.grad = gs[n].clone()
    opt.step()
    assert opt.stats["ns_matrices"] == len(PARTITION)
    assert opt.stats["ns_calls"] <= len(PARTITION)  # same-shape matrices batched (up and gate)
    for n, p in sgd.named_parameters():
        if n in PARTITION:
            with torch.no_grad():
                p.sub_(0.02 * gs[n])
            assert not torch.equal(p, dict(model.named_parameters())[n])
    opt.close()
