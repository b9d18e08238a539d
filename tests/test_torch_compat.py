"""torch.optim compatibility (issue 11): what a user porting ``torch.optim.Muon`` + ``torch.optim.AdamW`` code does,
each compared with ``torch.equal`` against those two optimizers on an unsharded copy, in sync (``overlap=False``)
and overlap mode, or checked for the exact error.

Distributed cases (bf16 apply layouts, replicated params on a mesh, hand-built DTensors) are at the end; they spawn
gloo ranks with hard timeouts.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, TinyNet, local

X = [torch.randn(4, 12, generator=torch.Generator().manual_seed(200 + s)) for s in range(12)]
MODES = [pytest.param(False, id="sync"), pytest.param(True, id="overlap")]


def _linear_split(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    lin = {id(m.weight) for m in model.modules() if isinstance(m, nn.Linear)}
    return [p for p in model.parameters() if id(p) in lin], [p for p in model.parameters() if id(p) not in lin]


def _pair(overlap: bool, *, muon_kw=None, ref_muon_kw=None, adamw_kw=None, model_fn=TinyNet):
    """(model, OverlapMuon, reference model, torch Muon, torch AdamW) on identical weights.

    ``ref_muon_kw`` defaults to ``muon_kw``; pass it separately when a kwarg holds a tensor the two optimizers must
    not share (a tensor lr that a scheduler fills in place)."""
    muon_kw = dict(muon_kw or {})
    ref_muon_kw = dict(muon_kw if ref_muon_kw is None else ref_muon_kw)
    adamw_kw = dict(ADAMW_KW if adamw_kw is None else adamw_kw)
    torch.manual_seed(0)
    model = model_fn()
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=adamw_kw, overlap=overlap, **muon_kw)
    mu_p, aw_p = _linear_split(ref)
    mu = torch.optim.Muon(mu_p, **ref_muon_kw)
    aw = torch.optim.AdamW(aw_p, **adamw_kw)
    return model, opt, ref, mu, aw


def _diff(a: nn.Module, b: nn.Module) -> list[str]:
    return [n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(local(p).detach(), q)]


def _step_both(model, opts, ref, ref_opts, s, scheds=(), ref_scheds=()):
    for m, os_, ss in ((model, opts, scheds), (ref, ref_opts, ref_scheds)):
        m(X[s % len(X)].to(next(m.parameters()).dtype)).float().pow(2).mean().backward()
        for o in os_:
            o.step()
        for o in os_:
            o.zero_grad()
        for sc in ss:
            sc.step()


# ---------------------------------------------------------------------------------------------------------------
# 1. tensor lr, with and without a scheduler filling it in place
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", MODES)
def test_tensor_lr_bitwise(overlap):
    """Bug: a 0-d tensor lr was turned into a float; torch computes ``1 - lr*wd`` and the adjusted lr in float32
    (max diff 9e-10 after 5 steps). Now the group keeps the tensor and the apply uses it as torch does."""
    model, opt, ref, mu, aw = _pair(overlap, muon_kw=dict(lr=torch.tensor(1e-3)),
                                    ref_muon_kw=dict(lr=torch.tensor(1e-3)))
    assert isinstance(opt.param_groups[0]["lr"], torch.Tensor)
    for s in range(5):
        _step_both(model, [opt], ref, [mu, aw], s)
    opt.synchronize()
    assert not _diff(model, ref)
    opt.close()


@pytest.mark.parametrize("overlap", MODES)
def test_tensor_lr_with_step_lr_scheduler_bitwise(overlap):
    """Bug: with ``StepLR`` over 12 steps params differed by 1.5e-8. The scheduler fills the tensor in place right
    after ``step()``; in overlap mode the apply still pending then must use the lr of its own ``step()``."""
    model, opt, ref, mu, aw = _pair(overlap, muon_kw=dict(lr=torch.tensor(1e-2)),
                                    ref_muon_kw=dict(lr=torch.tensor(1e-2)))
    lr_t = opt.param_groups[0]["lr"]
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    ref_scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=3, gamma=0.5) for o in (mu, aw)]
    for s in range(12):
        _step_both(model, [opt], ref, [mu, aw], s, [sched], ref_scheds)
    opt.synchronize()
    assert opt.param_groups[0]["lr"] is lr_t  # filled in place, still the user's tensor
    assert torch.equal(lr_t, mu.param_groups[0]["lr"])
    assert not _diff(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 2. an AdamW state whose step is a plain number
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", MODES)
def test_load_nontensor_adamw_step(overlap):
    """Bug: loading a state dict whose AdamW ``step`` is a Python number (older checkpoints; torch's
    ``test_load_nontensor_step``) made the next ``step()`` raise "API has changed, state_steps ... singleton
    tensors". Plain AdamW converts it in ``__setstate__``; so does OverlapMuon now, the same way."""
    model, opt, ref, mu, aw = _pair(overlap)
    for s in range(3):
        _step_both(model, [opt], ref, [mu, aw], s)
    for o, where in ((opt, None), (aw, None)):
        sd = copy.deepcopy(o.state_dict())
        n = 0
        for st in sd["state"].values():
            if "step" in st and torch.is_tensor(st["step"]):
                st["step"] = st["step"].item()
                n += 1
        assert n > 0
        o.load_state_dict(sd)
    steps = [opt.state[p]["step"] for g in opt.param_groups[1:] for p in g["params"]]
    assert all(torch.is_tensor(s) and s.dtype == torch.float32 and s.ndim == 0 for s in steps)
    for s in range(3, 6):
        _step_both(model, [opt], ref, [mu, aw], s)
    opt.synchronize()
    assert not _diff(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 3. deepcopy
# ---------------------------------------------------------------------------------------------------------------
def test_deepcopy_raises_with_reason():
    """Bug: ``copy.deepcopy(opt)`` returned a hollow object whose ``step()`` raised AttributeError."""
    model, opt, *_ = _pair(True)
    with pytest.raises(TypeError, match="cannot be deep-copied.*hooks, process groups and lane threads.*state_dict"):
        copy.deepcopy(opt)
    # the original still works
    model(X[0]).pow(2).mean().backward()
    opt.step()
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 4. complex weights
# ---------------------------------------------------------------------------------------------------------------
class _Complex(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(3, 2, dtype=torch.complex64)
        self.real = nn.Linear(3, 2)


def test_complex_weight_rejected_at_construction():
    """Bug: a complex Muon weight was accepted; its imaginary part was dropped. torch.optim.Muon raises (at
    step()); OverlapMuon raises at construction, naming the param."""
    with pytest.raises(ValueError, match=r"'lin.weight' has shape \(2, 3\) and dtype torch.complex64; Muon needs a "
                                         "real 2-D matrix"):
        OverlapMuon(_Complex())


def _complex_body(rank, world):
    model = _Complex() if rank == 1 else nn.Sequential(nn.Linear(3, 2))  # only rank 1 has the complex weight
    try:
        OverlapMuon(model)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(90)
def test_complex_weight_rejected_on_every_rank():
    msgs = run_ranks(_complex_body, 2, timeout=60)
    assert all(m is not None and "'lin.weight'" in m and "complex64" in m for m in msgs), msgs
    assert msgs[0].count("(rank 1)") == 1


# ---------------------------------------------------------------------------------------------------------------
# 5. params frozen at construction, unfrozen later
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", MODES)
def test_frozen_at_construction_then_unfrozen(overlap):
    """Bug: params with ``requires_grad=False`` when the optimizer was built were dropped for good (progressive
    unfreezing never trained them). torch keeps them; so does OverlapMuon: Muon and AdamW params alike are updated
    once they have a gradient."""
    torch.manual_seed(0)
    frozen = ("up.weight", "up.bias", "out.weight")

    def build():
        torch.manual_seed(0)
        m = TinyNet()
        for n, p in m.named_parameters():
            if n in frozen:
                p.requires_grad_(False)
        return m

    model, opt, ref, mu, aw = _pair(overlap, model_fn=build, muon_kw=dict(lr=0.02))
    mu.param_groups[0]["lr"] = 0.02
    assert "up.weight" in opt.muon_param_names and "out.weight" in opt.muon_param_names
    before = {n: p.detach().clone() for n, p in model.named_parameters() if n in frozen}
    for s in range(2):
        _step_both(model, [opt], ref, [mu, aw], s)
    opt.synchronize()
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters() if n in frozen)
    for m in (model, ref):
        for n, p in m.named_parameters():
            p.requires_grad_(True)
    for s in range(2, 5):
        _step_both(model, [opt], ref, [mu, aw], s)
    opt.synchronize()
    assert not any(torch.equal(before[n], p) for n, p in model.named_parameters() if n in frozen)
    assert not _diff(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 7. bf16 params with nesterov=False: torch 2.13 divides its NS input (the momentum itself) in place
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", MODES)
def test_bf16_no_nesterov_against_cloning_reference(overlap, monkeypatch):
    """torch 2.13's ``_zeropower_via_newtonschulz`` runs ``ortho_grad.div_(norm)`` on ``grad.bfloat16()``, which is
    the momentum buffer itself when the params are bf16 and ``nesterov=False``: torch re-normalizes its momentum
    every step (an upstream bug). OverlapMuon leaves the momentum alone; the reference here is torch's Muon with
    the NS input cloned, i.e. the algorithm as documented."""
    import torch.optim._muon as tm

    kw = dict(lr=0.02, nesterov=False)
    model, opt, ref, mu, aw = _pair(overlap, muon_kw=kw, model_fn=lambda: TinyNet().bfloat16())
    orig = tm._zeropower_via_newtonschulz
    monkeypatch.setattr(tm, "_zeropower_via_newtonschulz", lambda g, *a: orig(g.clone(), *a))
    for s in range(4):
        _step_both(model, [opt], ref, [mu, aw], s)
    opt.synchronize()
    assert not _diff(model, ref)
    for p, q in zip(opt.param_groups[0]["params"], mu.param_groups[0]["params"]):
        assert torch.equal(opt.state[p]["momentum_buffer"], mu.state[q]["momentum_buffer"])
    opt.close()


def test_bf16_no_nesterov_torch_2_13_renormalizes_momentum():
    """Documents the upstream behaviour the previous test excludes (skipped once torch stops doing it)."""
    w = torch.randn(6, 4).bfloat16().requires_grad_()
    mu = torch.optim.Muon([w], nesterov=False)
    w.grad = torch.randn(6, 4).bfloat16() * 10
    mu.step()
    buf = mu.state[w]["momentum_buffer"]
    if not torch.allclose(buf.float().norm(), torch.tensor(1.0), atol=1e-2):
        pytest.skip("this torch no longer divides the momentum in place")
    assert not torch.equal(buf, (w.grad * 0.05).bfloat16())


# ---------------------------------------------------------------------------------------------------------------
# 9. one LR scheduler over both algorithms
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", MODES)
def test_lambda_lr_one_function_per_group(overlap):
    """The recipe for one scheduler over both algorithms: ``LambdaLR(opt, [f_muon, f_adamw, ...])`` (group 0 is
    Muon, groups 1.. the AdamW groups), equal to one ``LambdaLR`` per torch optimizer."""
    f_mu = lambda s: 1.0 / (1 + s)  # noqa: E731
    f_aw = lambda s: 0.9 ** s  # noqa: E731
    model, opt, ref, mu, aw = _pair(overlap, muon_kw=dict(lr=0.02))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, [f_mu] + [f_aw] * (len(opt.param_groups) - 1))
    ref_s = [torch.optim.lr_scheduler.LambdaLR(mu, f_mu), torch.optim.lr_scheduler.LambdaLR(aw, f_aw)]
    for s in range(6):
        _step_both(model, [opt], ref, [mu, aw], s, [sched], ref_s)
    opt.synchronize()
    assert not _diff(model, ref)
    opt.close()


@pytest.mark.parametrize("overlap", MODES)
def test_one_cycle_lr_over_both(overlap):
    """``OneCycleLR(opt, max_lr=[muon, adamw...])`` cycles the lr of every group and, since ``opt.defaults`` are
    Muon's, the ``momentum`` of the Muon group: equal to ``OneCycleLR`` on ``torch.optim.Muon`` plus one with
    ``cycle_momentum=False`` on ``torch.optim.AdamW`` (AdamW's ``betas`` do not cycle; it only gains an unused
    ``momentum`` key). Momentum changed after backward re-runs the waves: still exact."""
    model, opt, ref, mu, aw = _pair(overlap, muon_kw=dict(lr=0.02))
    n_aw = len(opt.param_groups) - 1
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.04] + [6e-3] * n_aw, total_steps=8)
    ref_s = [torch.optim.lr_scheduler.OneCycleLR(mu, max_lr=0.04, total_steps=8),
             torch.optim.lr_scheduler.OneCycleLR(aw, max_lr=6e-3, total_steps=8, cycle_momentum=False)]
    for s in range(6):
        _step_both(model, [opt], ref, [mu, aw], s, [sched], ref_s)
    opt.synchronize()
    assert opt.param_groups[0]["momentum"] == mu.param_groups[0]["momentum"] != 0.95
    assert [g["betas"] for g in opt.param_groups[1:]] == [g["betas"] for g in aw.param_groups]
    assert not _diff(model, ref)
    opt.close()
