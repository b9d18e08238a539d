"""The symmetric-Gram (SYRK) Newton-Schulz path and its toggles.

What is exact and what is not (see ``overlap_muon._ns`` [Note: symmetric Gram]):

- ``syrk=False`` (the default) is bitwise equal to ``torch.optim.Muon``'s NS: tested here with ``torch.equal``.
- ``sym_gram`` / ``sym_poly`` are exactly symmetric by construction, and each block row is bit for bit the GEMM it
  names (the same ``@`` / ``addmm`` call on the same slices).
- ``syrk=True`` is NOT bitwise equal to the plain NS: a GEMM library picks its kernel, and with it the order of
  the fp32 accumulation, from the operand shapes, so a ``(block, n) @ (n, w)`` block row can round differently
  from the same rows of the ``(m, n) @ (n, m)`` product. Measured on an AMX bf16 Xeon (torch 2.13, oneDNN), whole
  ``zeropower`` with block 256: relative Frobenius difference 0.49% at 1024^2, 0.32% at 2048x8192, 0.43% at
  4096^2 (max abs 0.002, the bf16 rounding of one Gram entry amplified by 5 steps). The test below bounds it at
  2% -- a statement of the measured size, not a parity claim; this is why the toggle is off by default.
"""

from __future__ import annotations

import pytest
import torch
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from overlap_muon.config import resolve_config
from overlap_muon._ns import SYRK_BLOCK, sym_gram, sym_poly, zeropower

COEF = (3.4445, -4.7750, 2.0315)


def _x(*shape, seed=0):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).bfloat16()


@pytest.mark.parametrize("shape", [(16, 16), (33, 7), (64, 200), (300, 96)])
def test_syrk_off_is_bitwise_torch_muon(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(5))
    ref = torch_zeropower(g, COEF, 5, 1e-7)
    assert torch.equal(zeropower(g, syrk=False), ref)
    assert torch.equal(zeropower(g, syrk=False, syrk_block=3), ref)  # the block size is ignored when off


@pytest.mark.parametrize("m,n,block", [(64, 64, 16), (70, 130, 32), (100, 40, 7), (5, 9, 1), (8, 8, 3)])
def test_sym_gram_is_symmetric_and_each_block_row_is_its_gemm(m, n, block):
    x = _x(m, n)
    a = sym_gram(x, block)
    assert a.shape == (m, m) and a.dtype == torch.bfloat16
    assert torch.equal(a, a.mT)
    for i in range(0, m, block):
        j = min(i + block, m)
        row = x[i:j] @ x[i:].mT
        # the block row's strictly-upper part is the GEMM's, bit for bit; the diagonal block keeps its upper triangle
        assert torch.equal(a[i:j, j:], row[:, j - i:])
        assert torch.equal(a[i:j, i:j].triu(), row[:, : j - i].triu())


@pytest.mark.parametrize("m,block", [(64, 16), (70, 32), (9, 4)])
def test_sym_poly_is_symmetric_and_each_block_row_is_its_addmm(m, block):
    a = sym_gram(_x(m, 2 * m, seed=1), block)
    b, c = COEF[1], COEF[2]
    out = sym_poly(a, b, c, block)
    assert torch.equal(out, out.mT)
    for i in range(0, m, block):
        j = min(i + block, m)
        row = torch.addmm(a[i:j, i:], a[i:j], a[:, i:], beta=b, alpha=c)
        assert torch.equal(out[i:j, j:], row[:, j - i:])


def test_block_at_least_m_is_the_plain_product():
    x = _x(48, 80)
    assert torch.equal(sym_gram(x, 48), x @ x.mT)
    a = x @ x.mT
    assert torch.equal(sym_poly(a, -4.775, 2.0315, 64), torch.addmm(a, a, a, beta=-4.775, alpha=2.0315))
    g = torch.randn(48, 80, generator=torch.Generator().manual_seed(2))
    assert torch.equal(zeropower(g, syrk=True, syrk_block=48), torch_zeropower(g, COEF, 5, 1e-7))


def test_batched_syrk_equals_per_matrix_syrk():
    x = _x(3, 40, 72, seed=3)
    a = sym_gram(x, 16)
    for k in range(3):
        assert torch.equal(a[k], a[k].mT)
    out = zeropower(x, syrk=True, syrk_block=16)
    assert out.shape == x.shape and out.dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(256, 256), (192, 512), (512, 160)])
def test_syrk_zeropower_is_close_not_bitwise(shape):
    """Measured bound, not parity: see the module docstring (0.3-0.5% relative Frobenius at 1024^2..4096^2)."""
    g = torch.randn(shape, generator=torch.Generator().manual_seed(7))
    ref = torch_zeropower(g, COEF, 5, 1e-7).float()
    out = zeropower(g, syrk=True, syrk_block=64).float()
    assert out.shape == ref.shape
    assert ((out - ref).norm() / ref.norm()).item() < 2e-2


def test_bad_block_is_a_value_error():
    x = _x(8, 8)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ValueError, match="block"):
            sym_gram(x, bad)
        with pytest.raises(ValueError, match="block"):
            zeropower(x, syrk=True, syrk_block=bad)
    with pytest.raises(ValueError, match="square"):
        sym_poly(_x(4, 5), 1.0, 1.0)
    with pytest.raises(ValueError, match="shape"):
        sym_gram(_x(4), 2)
    assert isinstance(SYRK_BLOCK, int) and SYRK_BLOCK >= 1


# ---------------------------------------------------------------------------------------------------------------
# toggles: OVERLAP_MUON_SYRK (bool, default off)
# ---------------------------------------------------------------------------------------------------------------
def test_syrk_toggle():
    cfg = resolve_config({})
    assert cfg.syrk is False and cfg.sources["syrk"] == "default"
    for raw, val in [("1", True), ("off", False), ("YES", True), ("false", False)]:
        cfg = resolve_config({"OVERLAP_MUON_SYRK": raw})
        assert cfg.syrk is val and cfg.sources["syrk"] == "env"
    for raw in ["2", "y", "sym"]:
        with pytest.raises(ValueError, match="OVERLAP_MUON_SYRK"):
            resolve_config({"OVERLAP_MUON_SYRK": raw})
    assert resolve_config({"OVERLAP_MUON_SYRK": "1"}, syrk=False).syrk is False
    with pytest.raises(TypeError, match="syrk"):
        resolve_config(syrk="yes")


