"""Learning-rate adjustment: torch.optim.Muon's two functions bit for bit, on the full logical shape."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from overlap_muon.ns import adjusted_lr

_SHAPES = [(256, 256), (1024, 256), (256, 1024), (688, 256), (128, 256), (3, 7), (0, 5)]


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw", "not_a_function"])
@pytest.mark.parametrize("shape", _SHAPES)
def test_torch_adjustments_equal_torch(fn, shape):
    from torch.optim._muon import _adjust_lr

    assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


@pytest.mark.parametrize("fn", ["spectral_unclamped", "not_a_function"])
def test_unknown_adjust_lr_fn_is_refused_as_torch_refuses_it(fn):
    """torch 2.13's Muon knows only None, "original" and "match_rms_adamw"; so does OverlapMuon, with torch's
    message."""
    p = nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match=fn):
        torch.optim.Muon([p], adjust_lr_fn=fn)
    with pytest.raises(ValueError, match=fn):
        OverlapMuon(nn.Linear(8, 4), adjust_lr_fn=fn)
