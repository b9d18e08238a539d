"""NS kernel, toggles, home/NS-count cases and bad input of the layer-sharded core."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.optim._muon import _zeropower_via_newtonschulz as torch_zeropower

from overlap_muon import OverlapMuon
from overlap_muon.config import resolve_config
from overlap_muon._ns import zeropower
from tests.seams import SeamedOverlapMuon, TestingSeam
from overlap_muon.config import ENV_VARS
from overlap_muon._scheduler import load_report, lpt_homes, ns_flops, round_robin_homes
from tests.dist_utils import run_ranks
from tests.models import block

COEF = (3.4445, -4.7750, 2.0315)


# ---------------------------------------------------------------------------------------------------------------
# zeropower
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("shape", [(16, 16), (12, 20), (33, 7), (1, 9), (64, 48), (5, 1)])
def test_zeropower_bitwise_equals_torch_muon(shape):
    g = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    assert torch.equal(zeropower(g), torch_zeropower(g, COEF, 5, 1e-7))
    assert zeropower(g).dtype == torch.bfloat16


@pytest.mark.parametrize("shape", [(16, 16), (12, 20), (33, 7), (128, 64)])
def test_batched_ns_equals_per_matrix_loop(shape):
    """Each matrix of a stack is normalized by its own norm: no flattening across matrices."""
    stack = torch.randn((5, *shape), generator=torch.Generator().manual_seed(2))
    stack[2] *= 100.0  # very different norms: a flattened norm would show
    out = zeropower(stack)
    for i in range(5):
        assert torch.equal(out[i], zeropower(stack[i]))


def test_zeropower_per_step_schedule_and_errors():
    g = torch.randn(8, 12)
    sched = [COEF, (3.0, -3.0, 1.0), COEF]
    x = g.bfloat16() / g.bfloat16().norm().clamp(min=1e-7)
    for a, b, c in sched:
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    assert torch.equal(zeropower(g, ns_coefficients=sched, ns_steps=3), x)
    with pytest.raises(ValueError, match="ns_steps"):
        zeropower(g, ns_coefficients=sched, ns_steps=5)
    with pytest.raises(ValueError, match="shape"):
        zeropower(torch.randn(3))
    with pytest.raises(ValueError, match="ns_steps"):
        zeropower(g, ns_steps=100)


def test_ns_flops_cost_model():
    m, n = 12, 20
    assert ns_flops((n, m), 5) == ns_flops((m, n), 5) == 5 * (4 * m * m * n + 2 * m**3)


# ---------------------------------------------------------------------------------------------------------------
# toggles
# ---------------------------------------------------------------------------------------------------------------
BOOL_VARS = ["OVERLAP_MUON_OVERLAP", "OVERLAP_MUON_FUSED_A2A", "OVERLAP_MUON_BATCH_NS", "OVERLAP_MUON_SIDE_STREAMS",
             "OVERLAP_MUON_NVTX"]


@pytest.mark.parametrize("var", BOOL_VARS)
def test_boolean_toggles(var):
    field = {v: k for k, v in ENV_VARS.items()}[var]
    for raw, val in [("1", True), ("0", False), ("true", True), ("FALSE", False), ("yes", True), ("no", False),
                     ("On", True), ("off", False)]:
        cfg = resolve_config({var: raw})
        assert getattr(cfg, field) is val and cfg.sources[field] == "env"
    for raw in ["2", "y", "enable", "-1", "tru"]:
        with pytest.raises(ValueError, match=var):
            resolve_config({var: raw})
    # a constructor argument overrides the environment
    cfg = resolve_config({var: "0"}, **{field: True})
    assert getattr(cfg, field) is True and cfg.sources[field] == "argument"


def test_cost_model_is_a_visible_choice():
    """The surplus plan's machine figures are a config field: ``auto`` follows the lanes (CUDA streams or not), a
    named one holds on any device, anything else is an error naming the variable."""
    from overlap_muon._builder import cost_model as _cost_model
    from overlap_muon._scheduler import SurplusCostModel
    from overlap_muon._scheduler.surplus import CPU_GLOO
    from overlap_muon._scheduler.surplus_cost import PROFILES

    assert resolve_config({}).cost_model == "auto"
    assert resolve_config({"OVERLAP_MUON_COST_MODEL": "cuda"}).cost_model == "cuda"
    with pytest.raises(ValueError, match="OVERLAP_MUON_COST_MODEL"):
        resolve_config({"OVERLAP_MUON_COST_MODEL": "tpu"})
    assert _cost_model("auto", cuda=False) is CPU_GLOO and _cost_model("cpu_gloo", cuda=True) is CPU_GLOO
    assert _cost_model("auto", cuda=True) == SurplusCostModel() == _cost_model("cuda", cuda=False)
    assert _cost_model("gb300", cuda=False) is PROFILES["gb300"]
    assert resolve_config({"OVERLAP_MUON_COST_MODEL": "h100"}).cost_model == "h100"


def test_mode_balance_slots_timeout_toggles():
    assert resolve_config({"OVERLAP_MUON_MODE": "duplicated"}).mode == "duplicated"
    assert resolve_config({"OVERLAP_MUON_MODE": "layer_sharded"}).mode == "layer_sharded"
    assert resolve_config({"OVERLAP_MUON_BALANCE": "round_robin"}).balance == "round_robin"
    assert resolve_config({"OVERLAP_MUON_WAVE_SLOTS": "3"}).wave_slots == 3
    assert resolve_config({"OVERLAP_MUON_PG_TIMEOUT_S": "30"}).pg_timeout_s == 30.0
    for var, raw in [("OVERLAP_MUON_MODE", "sharded"), ("OVERLAP_MUON_BALANCE", "greedy"),
                     ("OVERLAP_MUON_WAVE_SLOTS", "0"), ("OVERLAP_MUON_WAVE_SLOTS", "x"),
                     ("OVERLAP_MUON_PG_TIMEOUT_S", "-1"), ("OVERLAP_MUON_PG_TIMEOUT_S", "soon"),
                     ("OVERLAP_MUON_PG_TIMEOUT_S", "inf"), ("OVERLAP_MUON_PG_TIMEOUT_S", "nan")]:
        with pytest.raises(ValueError, match=var):
            resolve_config({var: raw})
    cfg = resolve_config({})
    assert (cfg.mode, cfg.overlap, cfg.fused_a2a, cfg.batch_ns, cfg.balance, cfg.wave_slots) == (
        "layer_sharded", True, True, False, "lpt", None)
    assert "mode='layer_sharded'(default)" in cfg.describe()
    with pytest.raises(TypeError):
        resolve_config(bogus=1)


def test_env_toggle_reaches_optimizer(monkeypatch):
    monkeypatch.setenv("OVERLAP_MUON_MODE", "duplicated")
    monkeypatch.setenv("OVERLAP_MUON_OVERLAP", "0")
    opt = OverlapMuon(nn.Linear(4, 4))
    assert opt.config.mode == "duplicated" and opt.config.overlap is False
    opt.close()
    opt = OverlapMuon(nn.Linear(4, 4), overlap=True)
    assert opt.config.overlap is True and opt.config.sources["overlap"] == "argument"
    opt.close()
    with pytest.raises(ValueError, match="add_param_group"):
        opt.add_param_group({"params": [nn.Parameter(torch.zeros(2, 2))]})
    monkeypatch.setenv("OVERLAP_MUON_OVERLAP", "maybe")
    with pytest.raises(ValueError, match="OVERLAP_MUON_OVERLAP"):
        OverlapMuon(nn.Linear(4, 4))


# ---------------------------------------------------------------------------------------------------------------
# homes: LPT vs round robin, NS exactly once per matrix per step
# ---------------------------------------------------------------------------------------------------------------
def _stack_model(shapes):
    m = nn.Module()
    m.layers = nn.ModuleList([nn.Linear(q, p, bias=False) for p, q in shapes])
    return m


def _shapes(n):
    base = [(24, 16), (16, 24), (40, 16), (16, 16), (8, 40), (32, 32), (12, 28)]
    return [base[i % len(base)] for i in range(n)]


def _ns_once(rank, world, n):
    torch.manual_seed(0)
    model = _stack_model(_shapes(n))
    ref = _stack_model(_shapes(n))
    ref.load_state_dict(model.state_dict())
    # 1 x world domain of plain row shards (partition_dim 0), explicit TP group
    for layer in model.layers:
        full = layer.weight.detach()
        layer.weight = nn.Parameter(block(full, 0, 1, world, 0, rank).clone())
        layer.weight.partition_dim = 0
        layer.weight.full_shape = tuple(full.shape)
    calls = []
    seam = TestingSeam(ns_wrap=lambda ns, mats, kw: (calls.append(len(mats)), ns(mats, kw))[1])
    opt = SeamedOverlapMuon(model, tp_group=dist.group.WORLD if world > 1 else None, overlap=False, lr=0.02,
                            _testing=seam)
    mu = torch.optim.Muon(ref.parameters(), lr=0.02)
    for s in range(2):
        gen = torch.Generator().manual_seed(s)
        for lm, lr_ in zip(model.layers, ref.layers):
            gfull = torch.randn(lr_.weight.shape, generator=gen)
            lr_.weight.grad = gfull
            lm.weight.grad = block(gfull, 0, 1, world, 0, rank).contiguous()
        opt.step()
        mu.step()
    ok = all(torch.equal(lm.weight, block(lr_.weight.detach(), 0, 1, world, 0, rank))
             for lm, lr_ in zip(model.layers, ref.layers))
    homes = [w.homes for w in opt.waves]
    opt.close()
    return sum(calls), ok, homes


@pytest.mark.timeout(240)
@pytest.mark.parametrize("n,world", [(19, 8), (72, 7), (3, 8)])
def test_each_matrix_ns_once_per_step(n, world):
    """19 matrices on 8 homes, 72 on 7, 3 on 8 (5 homes idle): every matrix NS'd exactly once per step."""
    res = run_ranks(_ns_once, world, n, timeout=220)
    assert sum(r[0] for r in res) == 2 * n
    assert all(r[1] for r in res)
    assert all(r[2] == res[0][2] for r in res)  # identical plan on every rank, no communication


def test_lpt_beats_round_robin_on_mixed_shapes():
    for n, ranks in [(19, 8), (72, 7), (3, 8)]:
        costs = [float(ns_flops(s)) for s in _shapes(n)]
        lpt = load_report(costs, lpt_homes(costs, ranks), ranks)
        rr = load_report(costs, round_robin_homes(n, ranks), ranks)
        assert lpt.max <= rr.max
        assert lpt_homes(costs, ranks) == lpt_homes(list(costs), ranks)  # deterministic


def _tp_invariance(rank, world):
    # OverlapMuon's constructor is collective over the default group, so each TP size is its own world.
    T = world
    full = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
    grad = torch.randn(256, 256, generator=torch.Generator().manual_seed(3))
    out = {}
    for pd in (0, 1):
        m = nn.Module()
        m.w = nn.Linear(256, 256, bias=False)
        m.w.weight = nn.Parameter(block(full, pd, 1, T, 0, rank).clone())
        m.w.weight.partition_dim = pd
        m.w.weight.full_shape = (256, 256)
        opt = OverlapMuon(m, tp_group=dist.group.WORLD if T > 1 else None, overlap=False, lr=0.02, weight_decay=0.0)
        m.w.weight.grad = block(grad, pd, 1, T, 0, rank).contiguous()
        opt.step()
        out[pd] = m.w.weight.detach().clone()
        opt.close()
    return out


@pytest.mark.timeout(180)
def test_256_matrix_same_update_for_tp_1_to_4():
    ref = run_ranks(_tp_invariance, 1, timeout=60)[0][0]
    for T in (2, 3, 4):
        res = run_ranks(_tp_invariance, T, timeout=60)
        for pd in (0, 1):
            got = torch.cat([res[r][pd] for r in range(T)], dim=pd)
            assert torch.equal(got, ref), (T, pd)


# ---------------------------------------------------------------------------------------------------------------
# bad input: raised on every rank before any exchange; the process group stays usable
# ---------------------------------------------------------------------------------------------------------------
def _bad_inputs(rank, world):
    msgs = []

    def expect(fn, exc, needle):
        try:
            fn()
        except exc as e:
            msgs.append(needle in str(e))
        else:
            msgs.append(False)

    group = dist.group.WORLD

    def wrong_local_shape():
        m = nn.Linear(8, 6, bias=False)
        # rank 1 holds a wrongly shaped shard: every rank must raise, not only rank 1
        rows = 3 if rank == 0 else 2
        m.weight = nn.Parameter(torch.randn(rows, 8))
        m.weight.partition_dim = 0
        m.weight.full_shape = (6, 8)
        OverlapMuon(m, tp_group=group, overlap=False)

    def missing_partition_dim():
        # a shard (full_shape says so) without partition_dim; without full_shape it would be a replicated param
        m = nn.Linear(8, 6, bias=False)
        m.weight = nn.Parameter(torch.randn(3, 8))
        m.weight.full_shape = (6, 8)
        OverlapMuon(m, tp_group=group, overlap=False)

    def not_2d():
        m = nn.Module()
        m.p = nn.Parameter(torch.randn(2, 3, 4))
        OverlapMuon(m, muon_filter=lambda n, p: True)

    expect(wrong_local_shape, ValueError, "expected (3, 8)")
    expect(missing_partition_dim, ValueError, "partition_dim")
    expect(not_2d, ValueError, "2-D")
    expect(lambda: OverlapMuon(nn.Linear(2, 2), lr=-1.0), ValueError, "Learning rate")
    expect(lambda: OverlapMuon(nn.Linear(2, 2), adjust_lr_fn="bogus"), ValueError, "bogus")
    expect(lambda: OverlapMuon(nn.Linear(2, 2), ns_coefficients=(1.0, 2.0)), ValueError, "ns_coefficients")
    expect(lambda: OverlapMuon("model"), TypeError, "nn.Module")
    t = torch.tensor([1.0])
    dist.all_reduce(t)  # the default group still works
    msgs.append(t.item() == world)
    return msgs


@pytest.mark.timeout(120)
def test_bad_input_raises_on_every_rank():
    res = run_ranks(_bad_inputs, 2, timeout=100)
    assert all(all(r) for r in res), res


def test_adamw_setting_passed_as_an_option_points_to_adamw_kwargs():
    """Found by a new-user test: ``OverlapMuon(model, betas=...)`` listed the runtime options only."""
    with pytest.raises(TypeError, match=r"\['betas'\] are AdamW settings: pass them as adamw_kwargs"):
        OverlapMuon(nn.Linear(4, 4), betas=(0.9, 0.95))
