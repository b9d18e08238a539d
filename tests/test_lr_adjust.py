"""Learning-rate adjustment: torch.optim.Muon's functions bit for bit, on the full logical shape."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from overlap_muon._ns import adjusted_lr

_SHAPES = [(256, 256), (1024, 256), (256, 1024), (688, 256), (128, 256), (3, 7), (0, 5)]


def _torch_knows(fn: str) -> bool:
    """Whether the installed torch.optim.Muon accepts ``adjust_lr_fn=fn`` (torch 2.14 added "spectral_unclamped")."""
    try:
        torch.optim.Muon([nn.Parameter(torch.zeros(4, 8))], adjust_lr_fn=fn)
    except ValueError:
        return False
    return True


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw", "spectral_unclamped", "not_a_function"])
@pytest.mark.parametrize("shape", _SHAPES)
def test_torch_adjustments_equal_torch(fn, shape):
    from torch.optim._muon import _adjust_lr

    if fn == "spectral_unclamped" and not _torch_knows(fn):  # torch 2.13: its _adjust_lr gives 1.0 for it
        assert adjusted_lr(0.02, fn, shape) == 0.02 * (shape[0] / shape[1]) ** 0.5
        return
    assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


def test_unknown_adjust_lr_fn_is_refused_as_torch_refuses_it():
    """An adjustment torch.optim.Muon does not know is refused, with torch's message."""
    p = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="not_a_function"):
        torch.optim.Muon([p], adjust_lr_fn="not_a_function")
    with pytest.raises(ValueError, match="not_a_function"):
        OverlapMuon(nn.Linear(8, 4), adjust_lr_fn="not_a_function")


@pytest.mark.parametrize("overlap", [False, True])
def test_spectral_unclamped_trains_as_torch(overlap):
    """``adjust_lr_fn="spectral_unclamped"`` (torch 2.14: ``lr * sqrt(A/B)``, below 1 for wide matrices) trains
    ``torch.equal`` to torch.optim.Muon + AdamW. On a torch without it (2.13) the reference is one torch Muon per
    matrix, its ``lr`` pre-scaled by ``sqrt(A/B)`` and an adjustment torch maps to ratio 1: the same float product
    (and no weight decay there, which torch scales by the unadjusted ``lr``)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 4))
    reference = copy.deepcopy(model)
    lr, adamw_kw = 0.02, dict(lr=3e-3, weight_decay=0.1)
    wd = 0.1 if _torch_knows("spectral_unclamped") else 0.0
    opt = OverlapMuon(model, lr=lr, weight_decay=wd, adjust_lr_fn="spectral_unclamped", overlap=overlap,
                      adamw_kwargs=adamw_kw)
    named = dict(reference.named_parameters())
    mats = [named[n] for n in opt.muon_param_names]
    assert {tuple(p.shape) for p in mats} >= {(16, 8), (8, 16)}  # tall (ratio > 1) and wide (ratio < 1)
    if _torch_knows("spectral_unclamped"):
        refs = [torch.optim.Muon(mats, lr=lr, weight_decay=wd, adjust_lr_fn="spectral_unclamped")]
    else:
        refs = [torch.optim.Muon([p], lr=adjusted_lr(lr, "spectral_unclamped", p.shape), weight_decay=wd)
                for p in mats]
        for m in refs:
            m.param_groups[0]["adjust_lr_fn"] = "ratio_one"  # torch's _adjust_lr: 1.0 for a name it does not know
    refs.append(torch.optim.AdamW([p for n, p in named.items() if n not in opt.muon_param_names], **adamw_kw))
    for s in range(3):
        x = torch.randn(5, 8, generator=torch.Generator().manual_seed(s))
        for m, opts in ((model, [opt]), (reference, refs)):
            m(x).pow(2).mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
    opt.synchronize()
    opt.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
