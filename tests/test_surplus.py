"""The surplus-slot planner ``scheduler.surplus`` (pure Python, no process group)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_muon._scheduler import ns_flops, plan_waves
from overlap_muon._scheduler.surplus import (
    POLICIES,
    SurplusCostModel,
    plan_surplus,
    serving_homes,
    team_row_counts,
)

pytestmark = pytest.mark.timeout(60)

# A CPU-like machine where NS dominates (so teams and duplicates pay off) and one where links dominate.
_NS_BOUND = SurplusCostModel(ns_flops_per_s=1e12, intra_node_bytes_per_s=400e9, inter_node_bytes_per_s=50e9,
                             ranks_per_node=4, latency_s=20e-6)
_LINK_BOUND = SurplusCostModel(ns_flops_per_s=1e15, intra_node_bytes_per_s=1e9, inter_node_bytes_per_s=1e8,
                               ranks_per_node=4, latency_s=1e-3)


def _waves_of_kind(opt, *kinds: str) -> set[int]:
    """The waves whose frozen plan (``opt.wave_plans``) has one of ``kinds`` (the runtime decides nothing later)."""
    return {p.wave.index for p in opt.wave_plans if p.kind in kinds}


def _wave_of(opt) -> dict[int, int]:
    """Muon param index -> the index of its wave (``opt.waves``)."""
    return {i: w.index for w in opt.waves for i in w.params}


def _check_plan(plan, params, homes, num_ranks):
    assert set(plan.assignments) == set(params)
    multi = [r for a in plan.assignments.values() if len(a.ranks) > 1 for r in a.ranks]
    single = [a.ranks[0] for a in plan.assignments.values() if len(a.ranks) == 1]
    # a grown matrix's ranks are its own: never shared with another matrix
    assert len(multi) == len(set(multi)) and not set(multi) & set(single)
    for i, a in plan.assignments.items():
        assert all(0 <= r < num_ranks for r in a.ranks)
        assert a.kind in ("single", "duplicate", "team")
        assert (a.kind == "single") == (len(a.ranks) == 1)
        if a.kind == "duplicate":
            assert a.ranks[0] == homes[i]  # duplicates never move the home
        extra = set(a.ranks) - {homes[i]}
        assert extra <= set(plan.surplus_ranks)
    assert plan.wave_s == max(plan.rank_load_s)


def test_idle_is_the_wave_plan():
    params, homes = [3, 1, 2], {3: 0, 1: 5, 2: 2}
    shapes = {1: (256, 256), 2: (128, 512), 3: (512, 128)}
    plan = plan_surplus(params, homes, shapes, 8, "idle", _NS_BOUND)
    _check_plan(plan, params, homes, 8)
    assert {i: a.ranks for i, a in plan.assignments.items()} == {3: (0,), 1: (5,), 2: (2,)}
    assert plan.surplus_ranks == (1, 3, 4, 6, 7)
    assert plan.policy == "idle"


@pytest.mark.parametrize("policy", ["duplicate", "team", "auto"])
def test_more_homes_than_matrices_uses_the_surplus(policy):
    """One big matrix on 8 ranks: 7 are surplus; every policy but idle must shorten the wave on an NS-bound
    machine (team: compute / k) or at least not lengthen it (duplicate: only the way back shrinks)."""
    params, homes, shapes = [0], {0: 0}, [(2048, 8192)]
    idle = plan_surplus(params, homes, shapes, 8, "idle", _NS_BOUND)
    plan = plan_surplus(params, homes, shapes, 8, policy, _NS_BOUND)
    _check_plan(plan, params, homes, 8)
    assert plan.wave_s <= idle.wave_s
    if policy in ("team", "auto"):
        a = plan.assignments[0]
        assert a.kind == "team" and len(a.ranks) > 1
        assert plan.wave_s < 0.6 * idle.wave_s
        assert plan.policy == "team"


def test_uneven_wave_gives_ranks_to_the_critical_matrix_first():
    """A big and two small matrices on 6 ranks: the big one is the wave's time, so it gets the surplus."""
    params, homes = [0, 1, 2], {0: 0, 1: 1, 2: 2}
    shapes = [(4096, 4096), (128, 128), (256, 128)]
    plan = plan_surplus(params, homes, shapes, 6, "team", _NS_BOUND)
    _check_plan(plan, params, homes, 6)
    assert len(plan.assignments[0].ranks) > 1
    assert len(plan.assignments[1].ranks) == len(plan.assignments[2].ranks) == 1


@pytest.mark.parametrize("shape", [(8192, 2048), (2048, 8192)])
def test_tall_and_wide_plan_the_same(shape):
    """Cost depends on (min, max) of the shape: a tall matrix and its transpose plan alike."""
    a = plan_surplus([0], {0: 3}, [shape], 8, "auto", _NS_BOUND)
    b = plan_surplus([0], {0: 3}, [shape[::-1]], 8, "auto", _NS_BOUND)
    assert a.assignments[0].ranks == b.assignments[0].ranks and a.wave_s == b.wave_s
    from overlap_muon._scheduler.surplus_cost import _estimate, _Nodes

    nodes = _Nodes(8, _NS_BOUND.ranks_per_node)
    assert _estimate(shape, "team", [3, 2], nodes, _NS_BOUND) == _estimate(shape[::-1], "team", [3, 2], nodes,
                                                                             _NS_BOUND)


def test_link_bound_machine_keeps_idle_under_auto():
    """Where gathers cost more than the NS they split, auto does not build teams."""
    plan = plan_surplus([0, 1], {0: 0, 1: 1}, [(512, 512), (512, 1024)], 8, "auto", _LINK_BOUND)
    assert plan.policy in ("idle", "duplicate")
    assert all(a.kind != "team" for a in plan.assignments.values())


def test_duplicates_cover_other_nodes_first():
    plan = plan_surplus([0], {0: 1}, [(1024, 4096)], 16,
                        "duplicate", SurplusCostModel(ns_flops_per_s=1e15, ranks_per_node=4,
                                                      inter_node_bytes_per_s=1e9, intra_node_bytes_per_s=1e11))
    ranks = plan.assignments[0].ranks
    assert ranks[0] == 1 and len(ranks) > 1
    nodes = [r // 4 for r in ranks]
    assert len(ranks) >= 4 and len(set(nodes[:4])) == 4  # one home per node before any node gets a second


def test_team_moves_to_a_node_with_room():
    """[Note: team relocation]: a home on a full node moves its team to the node with free ranks."""
    params = [0, 1, 2, 3]
    homes = {0: 0, 1: 1, 2: 2, 3: 3}  # node 0 full, node 1 (ranks 4-7) free
    shapes = [(4096, 4096), (64, 64), (64, 64), (64, 64)]
    plan = plan_surplus(params, homes, shapes, 8, "team", _NS_BOUND)
    _check_plan(plan, params, homes, 8)
    a = plan.assignments[0]
    # the team is built on node 1 first; the released home (rank 0) may join it later, over the slow link
    assert a.kind == "team" and a.ranks[:4] == (4, 5, 6, 7)
    assert set(a.ranks) <= {0, 4, 5, 6, 7}


def test_deterministic_and_matches_waves_of_a_model():
    shapes = [(1024, 1024), (256, 1024), (256, 1024), (1024, 1024), (2816, 1024), (2816, 1024), (1024, 2816)] * 4
    costs = [ns_flops(s) for s in shapes]
    waves = plan_waves(list(range(len(shapes) - 1, -1, -1)), costs, 16)
    last = waves[-1]
    assert len(last.params) < 16  # tapered: surplus exists
    for policy in POLICIES:
        p1 = plan_surplus(last.params, last.homes, shapes, 16, policy, _NS_BOUND)
        p2 = plan_surplus(last.params, last.homes, shapes, 16, policy, _NS_BOUND)
        assert p1 == p2
        _check_plan(p1, last.params, last.homes, 16)


def test_full_wave_has_no_surplus():
    plan = plan_surplus([0, 1], {0: 0, 1: 1}, [(512, 512)] * 2, 2, "team", _NS_BOUND)
    assert plan.surplus_ranks == () and all(a.kind == "single" for a in plan.assignments.values())


def test_team_row_counts_follow_torch_chunk():
    import torch

    for m in range(0, 12):
        for k in range(1, 6):
            expect = [c.size(0) for c in torch.arange(m).chunk(k)] if m else []
            expect += [0] * (k - len(expect))
            assert team_row_counts(m, k) == expect, (m, k)
    with pytest.raises(ValueError, match="team size"):
        team_row_counts(4, 0)


def test_bad_input_names_the_problem():
    with pytest.raises(ValueError, match="policy"):
        plan_surplus([0], {0: 0}, [(4, 4)], 2, "spare")
    with pytest.raises(ValueError, match="home of param 0"):
        plan_surplus([0], {0: 5}, [(4, 4)], 2, "idle")
    with pytest.raises(ValueError, match="match the homes"):
        plan_surplus([0, 1], {0: 0}, [(4, 4)] * 2, 2, "idle")
    with pytest.raises(ValueError, match="shape"):
        plan_surplus([0], {0: 0}, [(4, 4, 4)], 2, "idle")
    with pytest.raises(ValueError, match="team_efficiency"):
        SurplusCostModel(team_efficiency=0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        SurplusCostModel(ranks_per_node=0)


def test_serving_homes_cover_every_rank():
    cm = SurplusCostModel(ns_flops_per_s=1e15, ranks_per_node=4, inter_node_bytes_per_s=1e9,
                          intra_node_bytes_per_s=1e11)
    plan = plan_surplus([0, 1], {0: 1, 1: 2}, [(1024, 4096), (64, 64)], 12, "duplicate", cm)
    dup, single = plan.assignments[0], plan.assignments[1]
    assert dup.kind == "duplicate"
    served = serving_homes(dup, 12, 4)
    assert set(served) == set(dup.ranks)  # every home serves someone (itself at least)
    for h in dup.ranks:
        assert served[h] == h
    for r, h in enumerate(served):
        if any(x // 4 == r // 4 for x in dup.ranks):
            assert h // 4 == r // 4  # a node with a home is served locally
    assert serving_homes(single, 12, 4) == [2] * 12
    team = plan_surplus([0], {0: 0}, [(2048, 8192)], 4, "team", _NS_BOUND).assignments[0]
    assert serving_homes(team, 4, 4) == [-1] * 4
    with pytest.raises(ValueError, match="outside"):
        serving_homes(dup, 2, 4)


def test_on_every_rank_picks_waves_with_room_for_every_rank():
    from overlap_muon._scheduler.surplus import every_rank_kinds

    def on_every_rank(*a):
        return set(every_rank_kinds(*a))

    waves = plan_waves(list(range(5))[::-1], [1.0] * 5, 2, taper=True)  # sizes [1, 2, 1, 1] on 2 homes
    assert [len(w.params) for w in waves] == [1, 2, 1, 1]
    assert on_every_rank(waves, [(512, 256)] * 5, [2]) == {0, 2, 3}  # the full wave stays single-homed
    assert on_every_rank(waves, [(512, 256)] * 5, [1]) == set()  # one rank: no surplus
    # team: only where splitting the NS beats its gathers' latencies (a large matrix, not a tiny one)
    assert on_every_rank(waves, [(2048, 8192)] * 5, [2], "team") == {0, 2, 3}
    assert on_every_rank(waves, [(16, 16)] * 5, [2], "team") == set()


def _surplus_body(rank, world, R, T, surplus, overlap):
    import torch

    from tests.models import ADAMW_KW, HP, PARTITION, TinyNet, build_dtensor_model, local, set_grad
    from overlap_muon import OverlapMuon
    torch.manual_seed(0)
    g, t = divmod(rank, T)
    full = TinyNet()
    model, mesh = build_dtensor_model(full, R, T)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, device_mesh=mesh, overlap=overlap, surplus=surplus, **HP)
    for s in range(3):
        gen = torch.Generator().manual_seed(50 + s)
        for n, p in model.named_parameters():
            set_grad(p, torch.randn(p.shape, generator=gen), PARTITION.get(n), R, T, g, t)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = {n: local(p).detach().clone() for n, p in model.named_parameters()}
    gathered = sorted(_waves_of_kind(opt, "gathered", "team")) + sorted(_waves_of_kind(opt, "team"))
    partial = sorted(p.wave.index for p in opt.wave_plans if p.dup)
    opt.close()
    return out, gathered, partial


@pytest.mark.timeout(180)
@pytest.mark.parametrize("R,T", [(1, 2), (2, 2), pytest.param(1, 4, marks=pytest.mark.slow)])
def test_runtime_duplicate_is_bitwise_the_single_home_result(R, T):
    """``surplus="duplicate"``: the waves with room for every rank run as gathers (each rank NS's the wave's
    matrices and keeps its block, nothing is scattered), and the waves whose plan gives a matrix some of the ranks
    send it to each of them, each runs its NS and only the other ranks get a scatter (from their serving home);
    params equal ``surplus="idle"`` (itself bitwise torch.optim.Muon in test_parity) with ``torch.equal``."""
    from tests.dist_utils import run_ranks

    import torch

    idle = run_ranks(_surplus_body, R * T, R, T, "idle", True, timeout=120)
    dup = run_ranks(_surplus_body, R * T, R, T, "duplicate", True, timeout=120)
    assert all(not g and not p for _, g, p in idle) and all(g for _, g, _ in dup), [g for _, g, _ in dup]
    if R * T == 4:  # 2-matrix waves on 4 homes: each matrix gets 2 homes, the other 2 ranks get a scatter
        assert all(p == [0, 1] for _, _, p in dup), [p for _, _, p in dup]
    for (a, _, _), (b, _, _) in zip(idle, dup):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


_TEAM_SHAPES = [(640, 640), (384, 1536), (1536, 384)]  # square, wide, tall: each a wave of its own at S = 2


def _team_body(rank, world, R, T, surplus, shapes=_TEAM_SHAPES):
    import torch
    from torch import nn

    from overlap_muon import OverlapMuon
    from tests.models import block, explicit_groups

    g, t = divmod(rank, T)
    tp, rm = explicit_groups(R, T, g, t)
    net = nn.Module()
    pds = [(0, 1, 0)[k % 3] for k in range(len(shapes))]
    fulls = [torch.randn(s, generator=torch.Generator().manual_seed(7 + k)) for k, s in enumerate(shapes)]
    for k, (w, pd) in enumerate(zip(fulls, pds)):
        p = nn.Parameter(block(w, pd, R, T, g, t).clone())
        p.partition_dim, p.full_shape = pd, tuple(w.shape)
        net.register_parameter(f"w{k}", p)
    opt = OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=tp, remat_group=rm, overlap=True,
                      surplus=surplus, lr=0.02, weight_decay=0.1)
    for s in range(2):
        for k, ((n, p), pd) in enumerate(zip(net.named_parameters(), pds)):
            full = torch.randn(shapes[k], generator=torch.Generator().manual_seed(100 * s + k))
            p.grad = block(full, pd, R, T, g, t).contiguous()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [p.detach().clone() for p in net.parameters()]
    wave_of = _wave_of(opt)
    teamed = sorted(k for k in range(len(shapes)) if wave_of[k] in _waves_of_kind(opt, "team"))
    gathered = sorted(k for k in range(len(shapes)) if wave_of[k] in _waves_of_kind(opt, "gathered", "team"))
    opt.close()
    return out, teamed, gathered


def _team_bound(shape, steps=2):
    """[Note: team NS by columns] bound on a param after ``steps`` steps at lr 0.02: ``lr * ratio * 2**-7`` per
    step (``ratio``: torch's default ``sqrt(max(1, P/Q))``), i.e. two bf16 ulps of update entries below 1."""
    import math

    return steps * 0.02 * math.sqrt(max(1.0, shape[0] / shape[1])) * 2 ** -7


@pytest.mark.bf16_heavy
@pytest.mark.timeout(240)
@pytest.mark.parametrize("R,T", [(1, 2), (2, 2)])
def test_runtime_team_within_its_bound(R, T):
    """``surplus="team"``: waves with one large matrix on a 2- or 4-rank domain split its NS by columns over the
    domain (``to_team`` -> ``team_zeropower_blocks`` -> ``from_team``). Not bitwise (partial Grams are rounded
    before their sum); the stated bound, for full-rank gradients like these: per step, every param within
    ``lr * ratio * 2**-7`` of the single-home result (for low-rank gradients the bf16 NS noise is larger on both
    paths; ``tests/test_team_ns.py`` bounds the kernel's accuracy against float64 for both kinds). Measured on the
    Intel AMX machine after two steps: 8.8e-5 (640x640), 8.8e-5 (384x1536), 1.9e-4
    (1536x384), against bounds of 3.1e-4, 3.1e-4 and 6.3e-4. At 2x2 the cost model teams the first wave only."""
    from tests.dist_utils import run_ranks

    idle = run_ranks(_team_body, R * T, R, T, "idle", timeout=200)
    team = run_ranks(_team_body, R * T, R, T, "team", timeout=200)
    want = [0, 1, 2] if R * T == 2 else [0]
    assert all(tm == want for _, tm, _ in team) and not any(tm for _, tm, _ in idle), [tm for _, tm, _ in team]
    for (a, _, _), (b, _, _) in zip(idle, team):
        for x, y, shape in zip(a, b, _TEAM_SHAPES):
            assert float((x - y).abs().max()) <= _team_bound(shape), (shape, float((x - y).abs().max()))


@pytest.mark.bf16_heavy
@pytest.mark.timeout(240)
def test_runtime_auto_picks_per_wave():
    """``surplus="auto"``: the cost model (``CPU_GLOO`` here) duplicates the small matrix's wave (bitwise) and
    teams the large ones' (within the team bound); every wave with room is one or the other."""
    from tests.dist_utils import run_ranks

    shapes = [(64, 64), (384, 1536), (1536, 384)]
    idle = run_ranks(_team_body, 2, 1, 2, "idle", shapes, timeout=200)
    auto = run_ranks(_team_body, 2, 1, 2, "auto", shapes, timeout=200)
    for (a, _, _), (b, teamed, gathered) in zip(idle, auto):
        assert teamed == [1, 2] and gathered == [0, 1, 2], (teamed, gathered)
        assert torch.equal(a[0], b[0])  # duplicated: the single-home bits
        for x, y, shape in zip(a[1:], b[1:], shapes[1:]):
            assert float((x - y).abs().max()) <= _team_bound(shape), (shape, float((x - y).abs().max()))


def _mixed_options_body(rank, world):
    import torch
    from torch import nn

    from overlap_muon import OverlapMuon
    from tests.models import explicit_groups

    tp, _ = explicit_groups(1, 2, 0, rank)
    net = nn.Module()
    net.w = nn.Parameter(torch.randn(4, 8))
    net.w.partition_dim, net.w.full_shape = 0, (8, 8)
    try:  # the team group would be created on rank 0 only: the options are compared before any group exists
        OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=tp, surplus="team" if rank == 0 else "idle")
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_options_that_decide_groups_differ_is_an_error_not_a_hang():
    from tests.dist_utils import run_ranks

    for msg in run_ranks(_mixed_options_body, 2, timeout=90):
        assert "different options: surplus (OVERLAP_MUON_SURPLUS): 'team' on ranks 0, 'idle' on ranks 1" in msg, msg


@pytest.mark.bf16_heavy
@pytest.mark.timeout(240)
def test_transposed_and_split_matrices_are_duplicated_not_teamed():
    """A team splits one matrix's columns; a transposed (Conv1D) or split matrix is NS'd as the reference does it
    (its transpose, or each part), so its waves are duplicated instead: bitwise equal to ``surplus="idle"``."""
    from tests.dist_utils import run_ranks

    idle = run_ranks(_fallback_body, 2, "idle", timeout=200)
    team = run_ranks(_fallback_body, 2, "team", timeout=200)
    for (a, _, _), (b, teamed, gathered) in zip(idle, team):
        assert teamed == [] and gathered == [0, 1], (teamed, gathered)
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _fallback_body(rank, world, surplus):
    import torch
    from torch import nn

    from overlap_muon import OverlapMuon
    from overlap_muon.split import QKVSplit
    from tests.models import block
    from tests.test_users import Conv1D

    tp = dist.new_group([0, 1])
    net = nn.Module()
    net.conv = Conv1D(640, 640)  # stored (in, out): a transposed Muon matrix, (640, 640) full
    net.qkv = nn.Linear(640, 768, bias=False)  # q, k, v parts of 256 rows each
    fulls = [torch.randn(640, 640, generator=torch.Generator().manual_seed(3)),
             torch.randn(768, 640, generator=torch.Generator().manual_seed(4))]
    for mod, w in zip((net.conv, net.qkv), fulls):
        mod.weight = nn.Parameter(block(w, 0, 1, 2, 0, rank).clone())
        mod.weight.partition_dim, mod.weight.full_shape = 0, tuple(w.shape)
    opt = OverlapMuon(net, muon_filter=lambda n, p: p.ndim == 2, tp_group=tp, split={"qkv.weight": QKVSplit(4, 4, 64)},
                      overlap=True, surplus=surplus, lr=0.02, weight_decay=0.1)
    for s in range(2):
        for k, p in enumerate((net.conv.weight, net.qkv.weight)):
            full = torch.randn(fulls[k].shape, generator=torch.Generator().manual_seed(50 * s + k))
            p.grad = block(full, 0, 1, 2, 0, rank).contiguous()
        net.conv.bias.grad = torch.zeros(640)
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [p.detach().clone() for p in (net.conv.weight, net.qkv.weight)]
    mi = {n: k for k, n in enumerate(opt.muon_param_names)}
    waves = [_wave_of(opt)[mi["conv.weight"]], _wave_of(opt)[mi["qkv.weight"]]]
    teamed = [k for k, w in enumerate(waves) if w in _waves_of_kind(opt, "team")]
    gathered = [k for k, w in enumerate(waves) if w in _waves_of_kind(opt, "gathered", "team")]
    opt.close()
    return out, teamed, gathered
