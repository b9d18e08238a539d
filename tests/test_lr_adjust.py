"""Learning-rate adjustment: torch.optim.Muon's two functions bit for bit, and the ``spectral_unclamped``
extension (not in torch 2.13; the formula and torchtitan's DistMuon are its references)."""

from __future__ import annotations

import math

import pytest
import torch

from overlap_muon.ns import ADJUST_LR_EXTENSIONS, adjusted_lr, spectral_unclamped_ratio

_SHAPES = [(256, 256), (1024, 256), (256, 1024), (688, 256), (128, 256), (3, 7), (0, 5)]


@pytest.mark.parametrize("fn", [None, "original", "match_rms_adamw", "not_a_function"])
@pytest.mark.parametrize("shape", _SHAPES)
def test_torch_adjustments_equal_torch(fn, shape):
    from torch.optim._muon import _adjust_lr

    assert adjusted_lr(0.02, fn, shape) == _adjust_lr(0.02, fn, torch.Size(shape))


def test_torch_2_13_rejects_spectral_unclamped():
    """Why it is an extension: torch.optim.Muon in this torch refuses the name. If a later torch accepts it,
    this test fails and the extension should be checked against torch's definition (and made bitwise equal)."""
    if "spectral_unclamped" not in ADJUST_LR_EXTENSIONS:
        pytest.fail("spectral_unclamped is no longer listed as an extension")
    p = torch.nn.Parameter(torch.zeros(4, 8))
    with pytest.raises(ValueError, match="spectral_unclamped"):
        torch.optim.Muon([p], adjust_lr_fn="spectral_unclamped")


@pytest.mark.parametrize("shape", _SHAPES)
def test_spectral_unclamped_formula(shape):
    P, Q = shape
    assert spectral_unclamped_ratio(shape) == math.sqrt(P / Q)
    assert adjusted_lr(0.02, "spectral_unclamped", shape) == 0.02 * math.sqrt(P / Q)
    # "original" is the same ratio clamped below at 1.
    assert adjusted_lr(0.02, "original", shape) == 0.02 * max(1.0, spectral_unclamped_ratio(shape))


def test_spectral_unclamped_values():
    assert spectral_unclamped_ratio((1024, 256)) == 2.0
    assert spectral_unclamped_ratio((256, 1024)) == 0.5
    assert spectral_unclamped_ratio((256, 256)) == 1.0


def test_spectral_unclamped_matches_torchtitan_dist_muon():
    try:
        from torchtitan.distributed.flex_shard.dist_muon import _adjust_muon_learning_rate
    except Exception:  # noqa: BLE001 - optional peer
        pytest.skip("torchtitan is not installed")
    for shape in _SHAPES:
        if shape[1] > 0:
            assert adjusted_lr(0.02, "spectral_unclamped", shape) == _adjust_muon_learning_rate(
                0.02, "spectral_unclamped", shape)


@pytest.mark.parametrize("shape", [(4,), (4, 0), (-1, 4)])
def test_spectral_unclamped_bad_shape(shape):
    with pytest.raises(ValueError, match="spectral_unclamped"):
        spectral_unclamped_ratio(shape)
