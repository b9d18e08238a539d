"""``mode="auto"``: each weight's NS strategy (home, duplicated, Gram) from the cost model ([Note: NS strategy per
weight] in ``scheduler/strategy.py``), the same on every rank, bitwise unless inexact NS is allowed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist

from overlap_muon._scheduler.strategy import pick_strategies, strategy_costs
from overlap_muon._scheduler.surplus_cost import PROFILES, SurplusCostModel
from tests.dist_utils import run_ranks

H200 = PROFILES["h200"]


def test_picks_follow_the_cost_model():
    # Many weights on few ranks: the homes share the NS work, duplicating would multiply it.
    assert set(pick_strategies([(4096, 4096)] * 64, 8, H200)) == {"home"}
    # One weight on two ranks: its home would idle the other rank and move twice the bytes of an all-gather.
    assert pick_strategies([(4096, 4096)], 2, H200) == ["duplicated"]
    # A wide matrix over slow links: its Gram (64 x 64 fp32) is far smaller than its shard.
    slow = dataclasses.replace(H200, intra_node_bytes_per_s=1e6, inter_node_bytes_per_s=1e6)
    assert pick_strategies([(64, 1 << 16)] * 4, 8, slow, gram_ok={0: True, 1: True, 2: True, 3: True}) == ["gram"] * 4
    assert "gram" not in pick_strategies([(64, 1 << 16)] * 4, 8, slow)  # not allowed: never
    # A Gram larger than the shard it replaces is never picked, however slow the links.
    assert strategy_costs((1024, 1024), 8, slow, gram_ok=True).gram is None
    # A home that does not fit: Gram where allowed, else the home anyway.
    small = dataclasses.replace(slow, home_memory_bytes=1e6)
    assert strategy_costs((64, 1 << 16), 8, small, gram_ok=True).duplicated is None
    assert pick_strategies([(64, 1 << 16)], 8, small) == ["home"]


def test_cost_model_figures_are_checked():
    with pytest.raises(ValueError, match="fp32_flops_per_s"):
        SurplusCostModel(fp32_flops_per_s=0)
    with pytest.raises(ValueError, match="home_memory_bytes"):
        SurplusCostModel(home_memory_bytes=-1)
    with pytest.raises(ValueError, match=r"S must be.*\(8, 8\)"):
        strategy_costs((8, 8), 0, H200)


def _body(rank: int, world: int, forced: list[str] | None, allow_inexact: bool, overlap: bool):
    """Plain TP shards (wide split by columns, tall by rows: Gram-able; wide by rows: not), ``mode="auto"`` with the
    cost model's picks or ``forced`` ones; returns per param the largest difference from ``torch.optim.Muon`` after
    3 steps, the picks of every rank and the stats."""
    from overlap_muon import OverlapMuon, _ns_strategy as ns_strategy
    from tests.models import HP, PlainTPPair, explicit_groups

    tp, _ = explicit_groups(1, world, 0, rank)
    pair = PlainTPPair({"wide_cols": ((96, 160), 1), "tall_rows": ((160, 96), 0), "wide_rows": ((64, 128), 0),
                        "sq": ((64, 64), 0)}, world, rank)
    real = ns_strategy.pick_strategies
    if forced is not None:
        ns_strategy.pick_strategies = lambda shapes, *a, gram_ok, **k: [
            f if f != "gram" or j in gram_ok else "home" for j, f in enumerate(forced)]
    opt = OverlapMuon(pair.net, muon_filter=lambda n, p: True, tp_group=tp, mode="auto", allow_inexact=allow_inexact,
                      overlap=overlap, auto_overlap=False, **HP)
    ns_strategy.pick_strategies = real
    diffs = pair.train(opt)
    picks = [None] * world
    dist.all_gather_object(picks, opt._rt.strategies.picks)
    stats = dict(opt.stats)
    opt.close()
    return diffs, picks, stats


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
def test_auto_is_bitwise_and_agreed(overlap):
    """The cost model's picks, and a forced mix of homes and duplicates: bitwise ``torch.optim.Muon`` on every
    param, the same picks on every rank, counted in ``stats``."""
    for forced in (None, ["duplicated", "home", "duplicated", "home"]):
        for diffs, picks, stats in run_ranks(_body, 2, forced, False, overlap, timeout=100):
            assert diffs == [0.0] * 4, (forced, diffs)
            assert picks[0] == picks[1] and "gram" not in picks[0], picks
            assert sum(stats[f"strategy.{k}"] for k in ("home", "duplicated", "gram")) == 4, stats
            if forced is not None:
                assert picks[0] == forced and stats["strategy.duplicated"] == 2, (picks, stats)


@pytest.mark.timeout(120)
def test_auto_gram_picks_only_when_allowed():
    """With ``allow_inexact``, the Gram picks (of the Gram-able params) are within the Gram bound of
    ``tests/test_gram_mode.py``; the others stay bitwise."""
    from tests.models import HP

    forced = ["gram", "gram", "gram", "duplicated"]  # wide_rows is not Gram-able: it stays at its home
    for diffs, picks, stats in run_ranks(_body, 2, forced, True, True, timeout=100):
        assert picks[0] == ["gram", "gram", "home", "duplicated"] == picks[1], picks
        assert stats["strategy.gram"] == 2, stats
        for d, shape in zip(diffs[:2], [(96, 160), (160, 96)]):
            assert d <= 3 * HP["lr"] * max(1.0, shape[0] / shape[1]) ** 0.5 * 2 ** -7, diffs
        assert diffs[2:] == [0.0, 0.0], diffs


def test_strategy_table_auto_never_above_its_baseline():
    """The simulator's strategy table (``apps/strategies.py``): ``auto`` (exact or not) never estimates more than
    every weight at its home, and its picks cover every weight of the layout."""
    from overlap_muon.apps.strategies import layouts, table_rows

    for gb300 in (False, True):
        rows = table_rows(PROFILES["gb300"], gb300)
        assert len(rows) == len(layouts(gb300))
        for r in rows:
            assert r["auto_inexact"] <= r["auto"] <= r["home"], r
            assert sum(r["picks"]["auto"].values()) == sum(r["picks"]["auto_inexact"].values()), r
