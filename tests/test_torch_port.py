"""torch's own ``OptimizerInfo`` for ``torch.optim.Muon``, ported: its inputs and its error inputs.

Source: ``torch/testing/_internal/common_optimizers.py`` (torch 2.13), ``optim_inputs_func_muon`` and
``optim_error_inputs_func_muon`` (plus ``get_error_inputs_for_all_optims``, which the latter extends). The configs
are transcribed below (that module imports ``expecttest``, which a plain install lacks);
:func:`test_transcription_matches_torch` compares the transcription with torch's lists when it can import them.

Every input config trains ``OverlapMuon`` and ``torch.optim.Muon`` + ``torch.optim.AdamW`` side by side and compares
with ``torch.equal``: in one process (sync and overlap, real backward) and on a 2x2 FSDP2 + TP mesh (gradients set
directly, as ``tests/test_parity.py`` does, since a TP forward is not bitwise the unsharded one).

Error inputs and how each applies (OverlapMuon takes a model, not a params list, and builds its param groups
itself: one Muon group, then the inner AdamW's groups):

===================================================  ==========================================================
torch error input                                    here
===================================================  ==========================================================
invalid param type (a Parameter, TypeError)          applies: a Parameter instead of a module, TypeError
a param group with duplicate params (UserWarning)    adapted: a module registers a shared (tied) weight twice;
                                                     ``named_parameters`` yields it once, so no warning, and it is
                                                     updated once, equal to torch's Muon given it once
duplicate params across groups (ValueError)          not applicable: there are no user-given param groups
Tensor lr must be 1-element (ValueError)             applies, same message
params with/without names (ValueError), and          not applicable: names come from the model, never from a
param groups with/without names (ValueError)         params argument
only support 2D parameters (ValueError, at           adapted: a 3-D param chosen by ``muon_filter`` raises
construction)                                        ValueError at construction, with our message (names the
                                                     param, its shape and dtype)
adjust_lr_fn "arbitrary" (ValueError, construction)  applies, same message
complex parameters (RuntimeError, at step())         adapted: ValueError at construction, on every rank
                                                     (``tests/test_torch_compat.py`` also checks 2 ranks)
===================================================  ==========================================================

``OptimizerInfo(Muon)`` also declares ``supported_impls=()`` (no foreach/fused/differentiable variants: nothing to
port) and skips the compiled-optimizer parity test (bf16 NS under ``torch.compile`` is not eager-bitwise).
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, TinyNet, local

# optim_inputs_func_muon(device) of torch 2.13: (desc, kwargs). A tensor lr is built per use (schedulers and
# optimizers must not share it), so it is stored as a factory.
MUON_INPUTS = [
    ("default", {}),
    ("non-default lr", {"lr": 0.01}),
    ("Tensor lr", {"lr": lambda: torch.tensor(0.001)}),
    ("non-default weight_decay", {"weight_decay": 0.2}),
    ("non-default momentum", {"momentum": 0.8}),
    ("passing alternative ns_steps", {"ns_steps": 6}),
    ("passing alternative ns_coefficients", {"ns_coefficients": (3.4, -4.7, 2.0)}),
]
IDS = [d.replace(" ", "_") for d, _ in MUON_INPUTS]
X = [torch.randn(4, 12, generator=torch.Generator().manual_seed(300 + s)) for s in range(4)]


def _kwargs(kw: dict) -> dict:
    return {k: (v() if callable(v) else v) for k, v in kw.items()}


def test_transcription_matches_torch():
    """The configs above are torch's (skipped where torch's test helpers cannot be imported)."""
    try:
        from torch.testing._internal.common_optimizers import optim_error_inputs_func_muon, optim_inputs_func_muon
    except ImportError as e:  # expecttest missing
        pytest.skip(f"torch.testing._internal.common_optimizers not importable: {e}")
    theirs = [(o.desc, o.kwargs) for o in optim_inputs_func_muon("cpu")]
    assert [d for d, _ in theirs] == [d for d, _ in MUON_INPUTS]
    for (_, a), (_, b) in zip(theirs, MUON_INPUTS):
        b = _kwargs(b)
        assert a.keys() == b.keys() and all(
            torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a)
    descs = [e.optimizer_error_input.desc for e in optim_error_inputs_func_muon("cpu", torch.float32)]
    assert descs == [
        "invalid param type", "a param group cannot have duplicate parameters",
        "duplicate parameters should not occur across param groups either", "Tensor lr must be 1-element",
        "all optimizer params should be with/without names",
        "all optimizer param groups should be with/without names.", "only support 2D parameters",
        "only support `original` and `match_rms_adamw`", "does not support complex parameters",
    ]


# ---------------------------------------------------------------------------------------------------------------
# inputs, one process
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
@pytest.mark.parametrize("desc,kw", MUON_INPUTS, ids=IDS)
def test_muon_input_world1(desc, kw, overlap):
    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, overlap=overlap, **_kwargs(kw))
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    mu = torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **_kwargs(kw))
    aw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)
    for s in range(4):
        for m, os_ in ((model, [opt]), (ref, [mu, aw])):
            m(X[s]).pow(2).mean().backward()
            for o in os_:
                o.step()
                o.zero_grad()
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    assert not bad, f"{desc}: {bad}"
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# inputs, 2x2 FSDP2 + TP
# ---------------------------------------------------------------------------------------------------------------
def _inputs_body(rank, world):
    from tests.models import PARTITION, block, build_dtensor_model, set_grad
    from tests.test_parity import _grads

    R, T = 2, 2
    g, t = divmod(rank, T)
    failures = []
    for desc, kw in MUON_INPUTS:
        for overlap in (False, True):
            torch.manual_seed(0)
            ref = TinyNet()
            full = TinyNet()
            full.load_state_dict(ref.state_dict())
            mu = torch.optim.Muon([p for n, p in ref.named_parameters() if n in PARTITION], **_kwargs(kw))
            aw = torch.optim.AdamW([p for n, p in ref.named_parameters() if n not in PARTITION], **ADAMW_KW)
            model, mesh = build_dtensor_model(full, R, T)
            opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, **_kwargs(kw))
            for s in range(3):
                gs = _grads(full, s)
                for n, p in ref.named_parameters():
                    p.grad = gs[n].clone()
                for n, p in model.named_parameters():
                    set_grad(p, gs[n], PARTITION.get(n), R, T, g, t)
                opt.step()
                mu.step()
                aw.step()
            opt.synchronize()
            refp = dict(ref.named_parameters())
            for n, p in model.named_parameters():
                if n in PARTITION:
                    ok = torch.equal(local(p).detach(), block(refp[n].detach(), PARTITION[n], R, T, g, t))
                else:
                    ok = torch.equal(p.full_tensor().detach(), refp[n].detach())
                if not ok:
                    failures.append(f"{desc} overlap={overlap}: {n}")
            opt.close()
    return failures


@pytest.mark.timeout(300)
def test_muon_inputs_fsdp_tp_2x2():
    """Every input config on a 2x2 ("remat", "tp") mesh (FSDP2 + ColwiseParallel/RowwiseParallel), sync and overlap,
    each rank's shards equal to its own unsharded torch reference."""
    res = run_ranks(_inputs_body, 4, timeout=280)
    failures = [f for r in res for f in r]
    assert not failures, failures[:10]


# ---------------------------------------------------------------------------------------------------------------
# error inputs
# ---------------------------------------------------------------------------------------------------------------
def test_error_invalid_param_type():
    with pytest.raises(TypeError, match=r"expects the model \(an nn.Module\), got a Parameter: pass the model, not its"):
        OverlapMuon(nn.Parameter(torch.randn(1, 1)))


def test_error_tensor_lr_must_be_one_element():
    with pytest.raises(ValueError, match="Tensor lr must be 1-element"):
        OverlapMuon(TinyNet(), lr=torch.tensor([0.001, 0.001]))


def test_error_adjust_lr_fn():
    with pytest.raises(ValueError, match="Adjust learning rate function arbitrary is not supported"):
        OverlapMuon(TinyNet(), adjust_lr_fn="arbitrary")


class _ThreeD(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(2, 3, 4))


def test_error_only_2d_params():
    with pytest.raises(ValueError, match=r"Muon param 'w' has shape \(2, 3, 4\) and dtype torch.float32; Muon needs "
                                         "a real 2-D matrix"):
        OverlapMuon(_ThreeD(), muon_filter=lambda n, p: True)


def test_error_complex_params_at_construction():
    class C(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(3, 2, bias=False, dtype=torch.complex64)

    with pytest.raises(ValueError, match="complex64; Muon needs a real 2-D matrix"):
        OverlapMuon(C())


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6, bias=False)
        self.b = nn.Linear(6, 6, bias=False)
        self.b.weight = self.a.weight  # the same param registered twice

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


@pytest.mark.parametrize("overlap", [False, True], ids=["sync", "overlap"])
def test_duplicate_param_is_one_param(overlap):
    """torch warns about a param listed twice in a group; a module that registers one twice (tied weights) gives
    it once, without a warning, and it is updated once per step, equal to torch's Muon given it once."""
    torch.manual_seed(0)
    model = _Tied()
    ref = copy.deepcopy(model)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = OverlapMuon(model, overlap=overlap)
    assert opt.muon_param_names == ["a.weight"]
    mu = torch.optim.Muon([ref.a.weight])
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(1))
    for _ in range(3):
        for m, o in ((model, opt), (ref, mu)):
            m(x).pow(2).sum().backward()
            o.step()
            o.zero_grad()
    opt.synchronize()
    assert torch.equal(model.a.weight, ref.a.weight) and model.b.weight is model.a.weight
    opt.close()
