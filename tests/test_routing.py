"""Routing to NS homes and back (overlap_muon.layer_sharded_a2a): exactness, layouts, collective counts, errors.

Every check is bitwise (torch.equal): routing only moves data. Distributed checks run on CPU gloo ranks, with many
configurations batched into one spawn per world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_muon._comm import domain_from_layouts
from overlap_muon._domain import Domain
from overlap_muon._layout import chunk_sizes
from overlap_muon.layer_sharded_a2a import (
    all_gather_full,
    from_homes,
    local_shard,
    params_by_home,
    route_from_ns_home,
    route_to_ns_home,
    to_homes,
)
from tests.dist_utils import run_ranks

GRIDS = {1: [(1, 1)], 2: [(1, 2), (2, 1)], 3: [(1, 3), (3, 1)], 4: [(2, 2), (1, 4)]}

# (P, Q, partition_dim): odd shapes, blocks that are uneven or empty on the grids above, every partition dim.
SPECS = [(5, 7, 0), (7, 5, 1), (3, 6, None), (1, 3, 0), (6, 1, 1), (2, 9, None), (9, 2, 0), (4, 4, 1), (0, 3, 0)]


class _Count:
    """Count collectives issued through torch.distributed inside the ``with`` block."""

    NAMES = ("all_to_all_single", "all_gather_single", "all_gather_into_tensor", "all_gather", "all_reduce")

    def __enter__(self):
        self.counts = dict.fromkeys(self.NAMES, 0)
        self.orig = {name: getattr(dist, name) for name in self.NAMES if hasattr(dist, name)}
        for name, fn in self.orig.items():
            setattr(dist, name, self._wrap(name, fn))
        return self

    def _wrap(self, name, fn):
        def counted(*args, **kwargs):
            self.counts[name] += 1
            return fn(*args, **kwargs)

        return counted

    def __exit__(self, *exc):
        for name, fn in self.orig.items():
            setattr(dist, name, fn)

    @property
    def a2a(self) -> int:
        return self.counts["all_to_all_single"]

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _full(i: int, shape, dtype=torch.float32) -> torch.Tensor:
    """Deterministic full tensor of param ``i`` (identical on every rank)."""
    g = torch.Generator().manual_seed(1234 + i)
    return torch.randn(tuple(shape), generator=g).to(dtype)


def _chunk(x: torch.Tensor, parts: int, dim: int = 0) -> list[torch.Tensor]:
    """torch.chunk padded with empty blocks to ``parts`` entries (torch.chunk may return fewer)."""
    out = list(torch.chunk(x, parts, dim=dim)) if x.shape[dim] > 0 else []
    while len(out) < parts:
        out.append(x.narrow(dim, x.shape[dim], 0))
    return out


def _domain(R: int, T: int) -> Domain:
    return domain_from_layouts([[[g * T + t for t in range(T)] for g in range(R)]])


def _world_sum_ok(rank: int, world: int) -> bool:
    """The default group still works: an all_reduce gives the expected sum."""
    x = torch.tensor([float(rank + 1)])
    dist.all_reduce(x)
    return x.item() == world * (world + 1) / 2


# ----------------------------------------------------------------------------------------------------------------
# Pure (no process group)
# ----------------------------------------------------------------------------------------------------------------


def test_params_by_home_uneven_and_errors():
    assert params_by_home(5, {0: 2, 1: 0, 2: 2, 3: 2, 4: 0}, 4) == [[1, 4], [], [0, 2, 3], []]
    assert params_by_home(0, {}, 3) == [[], [], []]
    with pytest.raises(ValueError, match="param 1 has no NS home"):
        params_by_home(2, {0: 0}, 2)
    with pytest.raises(ValueError, match=r"param 0 has NS home 2, expected an int in \[0, 2\)"):
        params_by_home(1, {0: 2}, 2)


def test_one_block_is_the_chunk_rule():
    """layout.block reads one block in O(1) (thousands of ranks ask for one block of every matrix): the same offsets
    and sizes as the whole chunk_sizes / chunk_offsets lists, uneven and empty blocks included."""
    from overlap_muon._layout import _chunk, chunk_offsets

    for n in list(range(0, 40)) + [1023, 1024, 8191, 28672]:
        for parts in (1, 2, 3, 4, 7, 8, 64, 1000, 8192):
            sizes, offs = chunk_sizes(n, parts), chunk_offsets(n, parts)
            assert [_chunk(n, parts, i) for i in range(parts)] == list(zip(offs, sizes)), (n, parts)


@pytest.mark.parametrize("R,T", [(1, 1), (1, 3), (3, 1), (2, 2), (2, 3), (4, 1), (1, 4)])
def test_local_shard_matches_layout_definition(R, T):
    """local_shard is exactly the torch.chunk layout of FSDP2 + TP (docs/design.md §2), and the blocks tile."""
    for P, Q in [(5, 7), (1, 3), (7, 1), (0, 4), (9, 2)]:
        full = torch.arange(P * Q, dtype=torch.float32).reshape(P, Q)
        for pd in (0, 1, None):
            cover = torch.zeros(P, Q, dtype=torch.int64)
            for g in range(R):
                for t in range(T):
                    dom = Domain(remat_size=R, tp_size=T, remat_rank=g, tp_rank=t)
                    got = local_shard(full, pd, dom)
                    if pd == 0:
                        exp = _chunk(_chunk(full, T)[t], R)[g]
                    elif pd == 1:
                        exp = _chunk(_chunk(full, R)[g], T, dim=1)[t]
                    else:
                        exp = _chunk(full, R)[g]
                    assert torch.equal(got, exp), (P, Q, pd, g, t)
                    if pd is not None or t == 0:
                        cover[got.long().flatten() // Q, got.long().flatten() % Q] += 1
            assert bool((cover == 1).all()), (P, Q, pd)


def test_trivial_group_and_single_domain_move_nothing():
    """group=None / a 1x1 domain: no process group needed, the inputs come back (as contiguous tensors)."""
    xs = [_full(0, (4, 3)), _full(1, (6, 2)).mT]
    full, idx = route_to_ns_home(xs, {0: 0, 1: 0}, None, shard_dim=[0, None], dim_sizes=[4, None])
    assert idx == [0, 1] and all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(full, xs))
    back = route_from_ns_home(full, idx, xs, {0: 0, 1: 0}, None)
    assert all(torch.equal(a, b) for a, b in zip(back, xs))
    dom = Domain.single()
    fulls = [_full(i, (P, Q)) for i, (P, Q, _) in enumerate(SPECS)]
    pds = [pd for *_, pd in SPECS]
    shapes = [(P, Q) for P, Q, _ in SPECS]
    homes = [0] * len(SPECS)
    for fused in (False, True):
        mats, idx = to_homes(fulls, homes, pds, shapes, dom, fused=fused, plan={})
        assert idx == list(range(len(SPECS))) and all(torch.equal(a, b) for a, b in zip(mats, fulls))
        back = from_homes(mats, idx, fulls, homes, pds, shapes, dom, fused=fused)
        assert all(torch.equal(a, b) for a, b in zip(back, fulls))
    assert all(torch.equal(a, b) for a, b in zip(all_gather_full(fulls, pds, shapes, dom), fulls))


# ----------------------------------------------------------------------------------------------------------------
# Seed API over one group
# ----------------------------------------------------------------------------------------------------------------


def _seed_body(rank, world):
    assert world == 3
    grp = dist.group.WORLD
    report = {}

    # 1. Rank 2 sends nothing (P = 4 over 3 ranks: row blocks [2, 2, 0]); rank 1 receives nothing (homes 0, 2).
    shapes = [(4, 3), (4, 2)]
    local = [(chunk_sizes(P, world)[rank], Q) for P, Q in shapes]
    xs = [torch.arange(P * Q, dtype=torch.float32).reshape(P, Q) + 1000 * rank for P, Q in local]
    homes = {0: 0, 1: 2}
    with _Count() as c_to:
        got, idx = route_to_ns_home(xs, homes, grp, 0, dim_sizes=[4, 4])
    exp_idx = [i for i in (0, 1) if homes[i] == rank]
    assert idx == exp_idx, (idx, exp_idx)
    for x, i in zip(got, idx):
        Q = shapes[i][1]
        pieces = [
            torch.arange(chunk_sizes(4, world)[s] * Q, dtype=torch.float32).reshape(-1, Q) + 1000 * s
            for s in range(world)
        ]
        assert torch.equal(x, torch.cat(pieces)), (rank, i, x)
    with _Count() as c_from:
        back = route_from_ns_home(got, idx, xs, homes, grp, 0, dim_sizes=[4, 4])
    assert all(torch.equal(a, b) for a, b in zip(back, xs))
    assert (c_to.a2a, c_to.total, c_from.a2a, c_from.total) == (1, 1, 1, 1)
    report["uneven_sends"] = True

    # 2. Heterogeneous shapes, per-param shard dims (0, 1, -1, None), uneven and empty blocks, homes where rank 1
    # owns nothing, bf16 and fp32, a plan reused for both directions and for a second step.
    specs = [((5, 7), 0), ((7, 5), 1), ((3, 4), None), ((1, 6), 0), ((4, 7), -1), ((2, 3, 4), 1), ((0, 3), 0)]
    dims = [d for _, d in specs]
    homes = {0: 2, 1: 0, 2: 2, 3: 0, 4: 0, 5: 2, 6: 0}
    for dtype in (torch.bfloat16, torch.float32):
        fulls = [_full(i, s, dtype) for i, (s, _) in enumerate(specs)]
        xs = [f if d is None else _chunk(f, world, d)[rank] for f, d in zip(fulls, dims)]
        sizes = [None if d is None else f.shape[d] for f, d in zip(fulls, dims)]
        plan = {}
        outs = []
        for _ in range(2):
            with _Count() as c:
                got, idx = route_to_ns_home(xs, homes, grp, dims, plan, dim_sizes=sizes)
                back = route_from_ns_home(got, idx, xs, homes, grp, dims, plan, dim_sizes=sizes)
            assert c.a2a == 2 and c.total == 2
            assert idx == [i for i in range(len(specs)) if homes[i] == rank]
            assert all(torch.equal(x, fulls[i]) and x.is_contiguous() for x, i in zip(got, idx))
            assert all(torch.equal(a, b) and a.dtype == dtype for a, b in zip(back, xs))
            outs.append((got, back))
        assert set(plan) == {"to", "from"}
        assert all(torch.equal(a, b) for a, b in zip(outs[0][0] + outs[0][1], outs[1][0] + outs[1][1]))
    report["heterogeneous"] = True

    # 3. bf16 results for fp32 shards: the from-direction dtype is explicit.
    fulls = [_full(i, (6, 5)) for i in range(3)]
    xs = [_chunk(f, world)[rank] for f in fulls]
    homes = {0: 1, 1: 1, 2: 0}
    got, idx = route_to_ns_home(xs, homes, grp)
    back = route_from_ns_home([x.bfloat16() for x in got], idx, xs, homes, grp, dtype=torch.bfloat16)
    assert all(b.dtype == torch.bfloat16 and torch.equal(b, x.bfloat16()) for b, x in zip(back, xs))
    report["dtype"] = True

    # 4. Non-contiguous shards (.mT views and column slices) route bit-identically to their contiguous copies.
    base = [_full(10 + i, (6, 2 * world)) for i in range(3)]
    views = [base[0].mT, base[1][:, 1:4], base[2].mT[1:, :]]  # (6, 6), (6, 3), (5, 6) with W = 3
    assert not any(v.is_contiguous() for v in views)
    homes = {0: 0, 1: 1, 2: 2}
    for d in (0, 1):
        for sd in (None, [0, 1, d]):
            got_v, idx_v = route_to_ns_home(views, homes, grp, d if sd is None else sd)
            got_c, idx_c = route_to_ns_home([v.contiguous() for v in views], homes, grp, d if sd is None else sd)
            assert idx_v == idx_c == [rank]
            assert all(torch.equal(a, b) for a, b in zip(got_v, got_c))
            back = route_from_ns_home(got_v, idx_v, views, homes, grp, d if sd is None else sd)
            assert all(torch.equal(a, b) for a, b in zip(back, views))
    report["non_contiguous"] = True

    # 5. All replicated: the home uses its own copy, nobody sends; from-home sends a full copy to every rank.
    fulls = [_full(20 + i, (3, 2)) for i in range(4)]
    homes = {0: 0, 1: 0, 2: 1, 3: 2}
    with _Count() as c:
        got, idx = route_to_ns_home(fulls, homes, grp, None)
    assert c.a2a == 1 and all(x is fulls[i] for x, i in zip(got, idx))  # contiguous input, no data moved
    res = [x * 2 for x in got]
    back = route_from_ns_home(res, idx, fulls, homes, grp, None)
    assert all(torch.equal(b, f * 2) for b, f in zip(back, fulls))
    report["replicated"] = True

    # 6. Nothing to route: no collective.
    with _Count() as c:
        assert route_to_ns_home([], {}, grp) == ([], [])
        assert route_from_ns_home([], [], [], {}, grp) == []
    assert c.total == 0
    assert _world_sum_ok(rank, world)
    return report


def test_seed_api_three_ranks():
    """Uneven splits (a rank that sends nothing, one that receives nothing) must not hang and must be exact."""
    for r in run_ranks(_seed_body, 3, timeout=90):
        assert r == dict.fromkeys(["uneven_sends", "heterogeneous", "dtype", "non_contiguous", "replicated"], True)


# ----------------------------------------------------------------------------------------------------------------
# Domain API
# ----------------------------------------------------------------------------------------------------------------


def _domain_body(rank, world):
    report = []
    if world == 4:
        # Seed level, P = 5 over 4 ranks: blocks [2, 2, 1, 0].
        fulls = [_full(30, (5, 3)), _full(31, (2, 5))]
        xs = [_chunk(fulls[0], 4)[rank], _chunk(fulls[1], 4, 1)[rank]]
        homes = {0: 3, 1: 3}
        got, idx = route_to_ns_home(xs, homes, dist.group.WORLD, [0, 1], dim_sizes=[5, 5])
        assert idx == ([0, 1] if rank == 3 else []) and all(torch.equal(x, f) for x, f in zip(got, fulls))
        back = route_from_ns_home(got, idx, xs, homes, dist.group.WORLD, [0, 1], dim_sizes=[5, 5])
        assert all(torch.equal(a, b) for a, b in zip(back, xs))
    for R, T in GRIDS[world]:
        dom = _domain(R, T)
        W = R * T
        me = dom.flat_rank
        shapes = [(P, Q) for P, Q, _ in SPECS]
        pds = [pd for *_, pd in SPECS]
        # The last rank owns nothing when W > 1; the others own uneven counts.
        homes = [(2 * i + 1) % max(W - 1, 1) for i in range(len(SPECS))]
        for dtype in (torch.float32, torch.bfloat16):
            fulls = [_full(i, s, dtype) for i, s in enumerate(shapes)]
            shards = [local_shard(f, pd, dom) for f, pd in zip(fulls, pds)]
            mine = [i for i, h in enumerate(homes) if h == me]
            per_mode = {}
            for fused in (False, True):
                plan = {}
                runs = []
                for _ in range(2):  # the second call reuses the plan
                    with _Count() as c_to:
                        mats, idx = to_homes(shards, homes, pds, shapes, dom, fused=fused, plan=plan)
                    ns = [m * 3 for m in mats]  # a stand-in for zeropower: exact in fp32 and bf16
                    with _Count() as c_from:
                        back = from_homes(ns, idx, shards, homes, pds, shapes, dom, fused=fused, plan=plan)
                    assert idx == mine, (R, T, fused, idx, mine)
                    for m, i in zip(mats, idx):
                        assert m.is_contiguous() and m.dtype == dtype and torch.equal(m, fulls[i]), (R, T, fused, i)
                    for i, b in enumerate(back):
                        exp = local_shard(fulls[i] * 3, pds[i], dom)
                        assert b.dtype == dtype and torch.equal(b, exp), (R, T, fused, i, b, exp)
                    if W == 1:
                        assert c_to.total == c_from.total == 0
                    elif fused:
                        assert c_to.a2a == c_to.total == 1 and c_from.a2a == c_from.total == 1
                    else:
                        assert c_to.a2a == c_to.total == c_from.a2a == c_from.total == (R > 1) + (T > 1)
                    runs.append(mats + back)
                assert all(torch.equal(a, b) for a, b in zip(*runs))
                per_mode[fused] = runs[0]
            assert all(torch.equal(a, b) for a, b in zip(per_mode[False], per_mode[True]))
            # NS results laid out as zeropower gives a tall one (the transpose of a contiguous matrix), with
            # reserved buffers, twice, two of them above the size copied whole first (_route._rows_first).
            big = SPECS + [(257, 131, 0), (131, 257, 1)]
            b_shapes, b_pds = [(P, Q) for P, Q, _ in big], [pd for *_, pd in big]
            b_fulls = [_full(i, s, dtype) for i, s in enumerate(b_shapes)]
            b_shards = [local_shard(f, pd, dom) for f, pd in zip(b_fulls, b_pds)]
            b_homes = [(2 * i + 1) % max(W - 1, 1) for i in range(len(big))]
            bufs: dict = {}
            for _ in range(2):
                mats, idx = to_homes(b_shards, b_homes, b_pds, b_shapes, dom, fused=True)
                ns = [(m * 3).mT.contiguous().mT for m in mats]
                back = from_homes(ns, idx, b_shards, b_homes, b_pds, b_shapes, dom, fused=True, buffers=bufs)
                assert all(torch.equal(b, local_shard(f * 3, pd, dom))
                           for b, f, pd in zip(back, b_fulls, b_pds)), (R, T)
            with _Count() as c:
                gathered = all_gather_full(shards, pds, shapes, dom)
            assert c.total == (len(SPECS) if W > 1 else 0)
            assert all(torch.equal(a, b) and a.is_contiguous() for a, b in zip(gathered, fulls))
        # bf16 results for fp32 shards with an explicit dtype.
        fulls = [_full(i, s) for i, s in enumerate(shapes)]
        shards = [local_shard(f, pd, dom) for f, pd in zip(fulls, pds)]
        for fused in (False, True):
            mats, idx = to_homes(shards, homes, pds, shapes, dom, fused=fused)
            ns = [m.bfloat16() for m in mats]
            back = from_homes(ns, idx, shards, homes, pds, shapes, dom, fused=fused, dtype=torch.bfloat16)
            assert all(torch.equal(b, s.bfloat16()) for b, s in zip(back, shards))
        report.append((R, T))
    assert _world_sum_ok(rank, world)
    return report


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_domain_routing_grids(world):
    """Every grid, fused and two-stage, pd 0/1/None, odd shapes: homes get exactly `full`, shards come back."""
    for r in run_ranks(_domain_body, world, timeout=90):
        assert r == GRIDS[world]


def _replay_body(rank, world):
    import overlap_muon.layer_sharded_a2a._domain_exchange as dx

    checked = []
    check = dx._check_domain_inputs
    dx._check_domain_inputs = lambda what, *a: checked.append(what) or check(what, *a)
    dom = _domain(1, world)
    shapes, pds = [(P, Q) for P, Q, _ in SPECS], [pd for *_, pd in SPECS]
    homes = [i % world for i in range(len(SPECS))]
    fulls = [_full(i, s, torch.bfloat16) for i, s in enumerate(shapes)]
    shards = [local_shard(f, pd, dom) for f, pd in zip(fulls, pds)]
    plan, outs = {}, []
    for _ in range(3):
        mats, idx = to_homes(shards, homes, pds, shapes, dom, fused=True, plan=plan)
        outs.append(mats + from_homes([m * 2 for m in mats], idx, shards, homes, pds, shapes, dom, fused=True,
                                      plan=plan))
    same = all(torch.equal(a, b) for run in outs[1:] for a, b in zip(outs[0], run))
    try:  # another call on the same plan is checked, and refused
        to_homes(shards, [(h + 1) % world for h in homes], pds, shapes, dom, fused=True, plan=plan)
        err = None
    except ValueError as e:
        err = str(e)
    return checked, same, err


def test_a_repeated_fused_call_replays_its_route():
    """[Note: replayed routes]: a fused call identical to the last validated one on its plan skips the checks and
    gives the same results; a different call on that plan is checked (and refused) as before."""
    for checked, same, err in run_ranks(_replay_body, 2, timeout=90):
        assert checked == ["to_homes", "from_homes", "to_homes"] and same, checked
        assert err is not None and "reused plan does not match" in err, err


# ----------------------------------------------------------------------------------------------------------------
# Bad input: ValueError on every rank before any collective, and the group still works
# ----------------------------------------------------------------------------------------------------------------


def _expect_error(fn, *must_contain) -> str:
    with _Count() as c:
        try:
            fn()
        except ValueError as e:
            msg = str(e)
        else:
            raise AssertionError(f"no ValueError; expected one mentioning {must_contain}")
    assert c.total == 0, f"a collective ran before the error: {c.counts}"
    for s in must_contain:
        assert s in msg, (s, msg)
    return msg


def _bad_body(rank, world):
    grp = dist.group.WORLD
    x = [torch.zeros(2, 3), torch.zeros(1, 4)]
    cases = {
        "missing home": lambda: route_to_ns_home(x, {0: 0}, grp),
        "home out of range": lambda: route_to_ns_home(x, {0: 0, 1: world}, grp),
        "mixed dtypes": lambda: route_to_ns_home([x[0], x[1].bfloat16()], {0: 0, 1: 1}, grp),
        "dim_sizes": lambda: route_to_ns_home(x, {0: 0, 1: 1}, grp, 0, dim_sizes=[6, 100]),
        "shard_dim": lambda: route_to_ns_home(x, {0: 0, 1: 1}, grp, [0, 2]),
        "ns count": lambda: route_from_ns_home([], [], x, {0: rank, 1: rank}, grp),
        "ns shape": lambda: route_from_ns_home(
            [torch.zeros(2, 3), torch.zeros(1, 4)], [0, 1], x, {0: rank, 1: rank}, grp
        ),
        "ns dtype": lambda: route_from_ns_home(
            [torch.zeros(2 * world, 3, dtype=torch.bfloat16)], [0], x[:1], {0: rank}, grp
        ),
    }
    expect = {
        "missing home": ("param 1", "(1, 4)", "no NS home"),
        "home out of range": ("param 1", "(1, 4)", f"[0, {world})"),
        "mixed dtypes": ("momentum_list[1]", "(1, 4)", "torch.bfloat16", "torch.float32"),
        "dim_sizes": ("param 1", "(1, 4)", "dim_sizes[1]=100"),
        "shard_dim": ("param 1", "(1, 4)", "shard_dim 2"),
        "ns count": ("ns_results", "[0, 1]"),
        "ns shape": ("ns_results[0]", "param 0", "(2, 3)", f"({2 * world}, 3)"),
        "ns dtype": ("ns_results[0]", "torch.bfloat16", "torch.float32"),
    }
    # Domain-level
    R, T = (1, world)
    dom = _domain(R, T)
    shapes = [(4, 6), (6, 4)]
    pds = [0, 1]
    fulls = [_full(i, s) for i, s in enumerate(shapes)]
    shards = [local_shard(f, pd, dom) for f, pd in zip(fulls, pds)]
    wrong = [shards[0], torch.zeros(5, 5)]
    cases.update(
        {
            "domain shape": lambda: to_homes(wrong, [0, 0], pds, shapes, dom, fused=True),
            "domain home": lambda: to_homes(shards, [0, world], pds, shapes, dom, fused=False),
            "domain pd": lambda: to_homes(shards, [0, 0], [0, 2], shapes, dom, fused=True),
            "domain ns": lambda: from_homes([], [], shards, [rank, rank], pds, shapes, dom, fused=True),
        }
    )
    expect.update(
        {
            "domain shape": ("param 1", "(5, 5)", "partition_dim=1", f"1x{world}"),
            "domain home": ("param 1", f"[0, {world})"),
            "domain pd": ("param 1", "partition_dim 2"),
            "domain ns": ("ns_results", "[0, 1]"),
        }
    )
    # A plan reused for a different call.
    plan = {}
    to_homes(shards, [0, 0], pds, shapes, dom, fused=True, plan=plan)
    seed_plan = {}
    route_to_ns_home(x, {0: 0, 1: 0}, grp, plan=seed_plan)
    cases.update(
        {
            "plan fused": lambda: to_homes(shards, [0, 0], pds, shapes, dom, fused=False, plan=plan),
            "plan homes": lambda: to_homes(shards, [0, world - 1], pds, shapes, dom, fused=True, plan=plan),
            "seed plan": lambda: route_to_ns_home(x, {0: 0, 1: world - 1}, grp, plan=seed_plan),
        }
    )
    expect.update(
        {
            "plan fused": ("reused plan", "fused"),
            "plan homes": ("reused plan", "param 1", "homes"),
            "seed plan": ("reused plan", "param 1", "homes"),
        }
    )
    msgs = {}
    for name, fn in cases.items():
        msgs[name] = _expect_error(fn, *expect[name])
        assert _world_sum_ok(rank, world), name
    return sorted(msgs)


def test_bad_input_raises_on_every_rank_before_any_collective():
    results = run_ranks(_bad_body, 3, timeout=90)
    assert all(r == results[0] for r in results) and len(results[0]) == 15
