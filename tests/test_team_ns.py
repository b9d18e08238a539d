"""Team Newton-Schulz (``overlap_muon._team_ns``): k gloo ranks share one matrix's NS, split by columns.

Exactness, measured on an AMX bf16 Xeon (torch 2.13, oneDNN, one thread per rank). Alone (``group=None``) it runs
the reference's very operations and is bitwise equal to ``zeropower`` (``torch.equal``). Over 2, 3 or 4 ranks:
never bitwise (each member's partial Gram is rounded to bf16 before the sum, [Note: team NS by columns]); relative
Frobenius 0.75% to 2.4% (largest: (50, 13) at 2 ranks), max abs difference 0.0137, over the shapes below -- the
size of any one-ulp change of the Gram after five bf16 NS steps. So the test bounds the difference at the measured
size (3%: a statement of what was measured, not parity) and checks exactly what is exact: every member returns the
same bits, each member's block equals its part of the gathered result, and the team norm is within one bf16 ulp
of ``Tensor.norm``.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_muon.apps.bench.ns import ns_float64
from overlap_muon._ns import zeropower
from overlap_muon._team_ns import team_norms, team_row_counts, team_zeropower_blocks, team_zeropower_full
from tests.dist_utils import run_ranks

# Uneven row splits at every team size: m = 7, 13 (tall: transposed), 3 (an empty member at 4), 5, 64, 130.
_SHAPES = [(7, 30), (50, 13), (3, 20), (40, 5), (64, 64), (130, 257), (257, 130), (256, 1024)]


def _team_body(rank, world, shapes):
    out = []
    for i, s in enumerate(shapes):
        X = torch.randn(s, generator=torch.Generator().manual_seed(100 + i))
        cols = team_zeropower_full(X, dist.group.WORLD)
        tall = s[0] > s[1]
        x = X.mT if tall else X
        # the column split: this member's block, normalized by the whole matrix's norm, is its columns of `cols`
        ccounts = team_row_counts(x.size(1), world)
        clo = sum(ccounts[:rank])
        xb = x.bfloat16()
        block = team_zeropower_blocks([x[:, clo:clo + ccounts[rank]]], [xb.norm()], dist.group.WORLD)[0]
        norm = team_norms([xb[:, clo:clo + ccounts[rank]]], dist.group.WORLD)[0]
        ref = zeropower(X)
        out.append({"cols": cols, "ref": ref, "norm": norm, "ref_norm": xb.norm(),
                    "cols_block_ok": torch.equal(block, (cols.mT if tall else cols)[:, clo:clo + ccounts[rank]])})
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3, pytest.param(4, marks=pytest.mark.slow)])
def test_team_split_over_ranks(world):
    res = run_ranks(_team_body, world, _SHAPES, timeout=150)
    for i, s in enumerate(_SHAPES):
        full0 = res[0][i]["cols"]
        assert full0.shape == s and full0.dtype == torch.bfloat16
        for r in range(world):
            assert torch.equal(res[r][i]["cols"], full0), (s, r)  # every member holds the same bits
        ref = res[0][i]["ref"].float()
        rel = ((full0.float() - ref).norm() / ref.norm()).item()
        assert rel < 3e-2, (s, world, rel)  # measured, see the docstring
        for r in range(world):
            assert res[r][i]["cols_block_ok"], (s, r)
            # the team norm: the same fp32 sum in another order, rounded to bf16: within one bf16 ulp
            n, ref_n = res[r][i]["norm"].float(), res[r][i]["ref_norm"].float()
            assert n.dtype == torch.float32 and abs(n - ref_n) <= ref_n * 2 ** -7, (s, r, n, ref_n)


@pytest.mark.parametrize("shape", [(16, 16), (33, 7), (64, 200), (300, 96)])
def test_team_of_one_is_bitwise_zeropower(shape):
    X = torch.randn(shape, generator=torch.Generator().manual_seed(9))
    assert torch.equal(team_zeropower_full(X, None), zeropower(X))


def test_team_per_step_coefficients_and_zero_steps():
    X = torch.randn(24, 40, generator=torch.Generator().manual_seed(4))
    sched = [(3.4445, -4.7750, 2.0315), (3.0, -3.2, 1.2)]
    assert torch.equal(team_zeropower_full(X, None, ns_coefficients=sched, ns_steps=2),
                       zeropower(X, ns_coefficients=sched, ns_steps=2))
    assert torch.equal(team_zeropower_full(X, None, ns_steps=0), zeropower(X, ns_steps=0))


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="shape"):
        team_zeropower_full(torch.randn(5), None)
    with pytest.raises(ValueError, match="ns_steps"):
        team_zeropower_full(torch.randn(6, 10), None, ns_steps=-1)


# (P, Q, partition_dim): uneven blocks, tall and wide, both partition dims and TP copies (None).
_LAYOUTS = [(7, 30, 0), (50, 13, 1), (9, 9, None), (5, 22, 1), (31, 6, 0), (2, 40, None)]


def _relayout_body(rank, world, R, T):
    from overlap_muon._domain import Domain
    from overlap_muon._layout import block
    from overlap_muon.layer_sharded_a2a import from_team, team_block, to_team

    dom = Domain(remat_size=R, tp_size=T, remat_rank=rank // T, tp_rank=rank % T, flat_group=dist.group.WORLD)
    fulls = [torch.randn(P, Q, generator=torch.Generator().manual_seed(P * Q)) for P, Q, _ in _LAYOUTS]
    pds, shapes = [pd for *_, pd in _LAYOUTS], [(P, Q) for P, Q, _ in _LAYOUTS]

    def cut(x, b):
        return x[b[0]:b[0] + b[1], b[2]:b[2] + b[3]]

    shards = [cut(f, block(s, pd, R, T, dom.remat_rank, dom.tp_rank)) for f, s, pd in zip(fulls, shapes, pds)]
    plan = {}
    for _ in range(2):  # the second call reuses the cached metadata
        got = to_team(shards, pds, shapes, dom, plan)
        want = [cut(f, team_block(s, world, dom.flat_rank)) for f, s in zip(fulls, shapes)]
        team_ok = all(torch.equal(a, b) for a, b in zip(got, want))
        back = from_team([g.bfloat16() for g in got], pds, shapes, dom, {})
        back_ok = all(torch.equal(a, b.bfloat16()) for a, b in zip(back, shards))
    return team_ok, back_ok


@pytest.mark.timeout(180)
@pytest.mark.parametrize("R,T", [(1, 2), (2, 1), (1, 3), (2, 2)])
def test_team_relayout_round_trip(R, T):
    """``to_team`` gives every rank exactly its team block of each full matrix (copies: ``torch.equal``), and
    ``from_team`` puts the blocks back into every rank's shard (TP copies of ``partition_dim`` None included)."""
    assert all(a and b for a, b in run_ranks(_relayout_body, R * T, R, T, timeout=150))


def test_team_block_follows_torch_chunk_on_the_long_dim():
    from overlap_muon.layer_sharded_a2a import team_block

    assert [team_block((4, 10), 3, j) for j in range(3)] == [(0, 4, 0, 4), (0, 4, 4, 4), (0, 4, 8, 2)]
    assert [team_block((10, 4), 3, j) for j in range(3)] == [(0, 4, 0, 4), (4, 4, 0, 4), (8, 2, 0, 4)]
    assert team_block((3, 3), 4, 3) == (0, 3, 3, 0)  # torch.chunk: 3 columns over 4 members, the last is empty


def _accuracy_body(rank, world, cases):
    out = []
    for (P, Q), B in cases:
        gen = torch.Generator().manual_seed(P + Q + (B or 0))
        X = torch.randn(P, Q, generator=gen) if B is None else (
            torch.randn(B, P, generator=gen).T @ torch.randn(B, Q, generator=gen))  # rank B
        exact = ns_float64(X)
        team = (team_zeropower_full(X, dist.group.WORLD).double() - exact).norm()
        ref = (zeropower(X).double() - exact).norm()
        out.append((team / ref).item())
    return out


@pytest.mark.bf16_heavy
@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_team_is_as_accurate_as_the_bitwise_path(world):
    """What the column split's exactness statement says: against NS in float64 (what both bf16 paths approximate),
    the team's error is at most 1.25x the bitwise path's own, for full-rank and low-rank inputs (gradients of rank
    1 to 256). Measured on the Intel AMX machine at 2 and 4 ranks, shapes 640^2, 1536x384, 384x1536, 701x333: at
    most 1.17x (full rank), 1.01x (low rank), where the bitwise path itself is 1.1% (full rank) to 164% (rank 1)
    away from float64 in relative Frobenius norm, so the two differ from each other by up to 17% on low-rank
    inputs here (23% at rank 2 in a break test): the bf16 rounding noise that NS amplifies outside the input's span,
    not a loss of accuracy. The statement is for matrices of hundreds of rows (what the cost model teams); below 64
    rows the ratio reached 2.9x in a break test (20 seeds, 5x7 to 24x24)."""
    cases = [((384, 1536), 1), ((384, 1536), None), ((701, 333), 4), ((701, 333), 256), ((333, 701), None)]
    ratios = run_ranks(_accuracy_body, world, cases, timeout=150)[0]
    assert all(r <= 1.25 for r in ratios), list(zip(cases, ratios))


def _split_poly_body(rank, world):
    from overlap_muon._team_ns import team_row_counts

    shapes = [(33, 70), (20, 41), (64, 64)]  # oriented (m <= n), uneven row and column splits at 2 and 3
    flags = [True, False, True]
    xs, norms = [], []
    for i, (m, n) in enumerate(shapes):
        X = torch.randn(m, n, generator=torch.Generator().manual_seed(40 + i))
        counts = team_row_counts(n, world)
        lo = sum(counts[:rank])
        xs.append(X[:, lo:lo + counts[rank]])
        norms.append(X.bfloat16().norm())
    together = team_zeropower_blocks(xs, norms, dist.group.WORLD, split_poly=flags)
    alone = [team_zeropower_blocks([x], [nrm], dist.group.WORLD, split_poly=f)[0]
             for x, nrm, f in zip(xs, norms, flags)]
    full = [team_zeropower_full(torch.randn(s, generator=torch.Generator().manual_seed(40 + i)), dist.group.WORLD,
                                split_poly=True) for i, s in enumerate(shapes)]
    # 2 members: a + b is one rounding whatever the buffer; 3: gloo's ring sums each chunk of the flat buffer in
    # an order set by the chunk's position, so a matrix reduced with others may round otherwise (not an error)
    return [torch.equal(a, b) if world == 2 else ((a.float() - b.float()).norm() / b.float().norm()).item() < 3e-2
            for a, b in zip(together, alone)], full


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_split_poly_assembles_each_matrix(world):
    """``split_poly``: each member computes its rows of ``b*A + c*A@A`` and one all-gather carries every split
    matrix's rows; a call with several matrices (split or not, different ``m``) gives each the bits it gets alone
    (2 members; 3: within 3%, the all-reduce's summation order depends on the buffer), every member ends with the
    same result, within the column split's measured 3% of ``zeropower``."""
    res = run_ranks(_split_poly_body, world, timeout=150)
    for same, _ in res:
        assert all(same), same
    for i, s in enumerate([(33, 70), (20, 41), (64, 64)]):
        got = res[0][1][i]
        assert all(torch.equal(r[1][i], got) for r in res)
        ref = zeropower(torch.randn(s, generator=torch.Generator().manual_seed(40 + i))).float()
        assert ((got.float() - ref).norm() / ref.norm()).item() < 3e-2
