"""Unit tests for scheduler/: NS cost, home assignment, wave planning and dispatch. No process group."""

import random
import threading

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from overlap_muon._scheduler import (
    LoadReport,
    ReadinessRecorder,
    Wave,
    WaveDispatcher,
    load_report,
    lpt_homes,
    ns_flops,
    plan_waves,
    round_robin_homes,
)

pytestmark = pytest.mark.timeout(60)


# ---------------------------------------------------------------------------------------------------- cost


def test_ns_flops_hand_count():
    # (4, 6): m=4, n=6. X@X.T 2*4*4*6=192, A@A 2*4*4*4=128, B@X 2*4*4*6=192 -> 512 per step.
    assert ns_flops((4, 6), ns_steps=1) == 512
    assert ns_flops((4, 6)) == 5 * 512
    assert ns_flops((6, 4)) == 5 * 512  # transposed inside NS: same work
    assert ns_flops((1, 1), ns_steps=2) == 2 * (2 + 2 + 2)
    assert ns_flops((0, 7)) == 0
    assert ns_flops((5, 5), ns_steps=0) == 0


@pytest.mark.parametrize("shape", [(8, 12), (12, 8), (16, 16), (3, 40)])
def test_ns_flops_matches_torch_muon(shape):
    """The count equals what torch's flop counter measures on torch.optim.Muon's own NS routine."""
    from torch.optim._muon import _zeropower_via_newtonschulz

    g = torch.randn(shape)
    with FlopCounterMode(display=False) as fc:
        _zeropower_via_newtonschulz(g, (3.4445, -4.7750, 2.0315), 5, 1e-7)
    assert fc.get_total_flops() == ns_flops(shape, ns_steps=5)


@pytest.mark.parametrize(
    "call",
    [
        lambda: ns_flops((4,)),
        lambda: ns_flops((4, -1)),
        lambda: ns_flops((4.0, 2)),
        lambda: ns_flops((4, 2), ns_steps=-1),
    ],
)
def test_cost_bad_input(call):
    with pytest.raises(ValueError):
        call()


# ---------------------------------------------------------------------------------------------------- homes


def test_lpt_known_cases():
    # Sorted (5,4,3,3,2,2,1) onto 3 ranks: 5->r0 4->r1 3->r2 3->r2(3) 2->r1(4) 2->r0(5) 1->r1(6,tie by rank).
    assert lpt_homes([5, 4, 3, 3, 2, 2, 1], 3) == [0, 1, 2, 2, 1, 0, 1]
    assert load_report([5, 4, 3, 3, 2, 2, 1], [0, 1, 2, 2, 1, 0, 1], 3).per_rank == (7.0, 7.0, 6.0)
    # Equal costs: index order, least rank on ties.
    assert lpt_homes([1, 1, 1, 1], 2) == [0, 1, 0, 1]
    assert lpt_homes([], 4) == []
    assert lpt_homes([2.0], 1) == [0]
    # Initial loads carried in.
    assert lpt_homes([3, 3], 2, initial_loads=[10, 0]) == [1, 1]
    assert lpt_homes([3, 3], 2, initial_loads=[3, 0]) == [1, 0]


def test_lpt_deterministic_and_bounded():
    rng = random.Random(1)
    for _ in range(50):
        n, r = rng.randint(0, 40), rng.randint(1, 9)
        costs = [rng.choice([1, 2, 3, 8, 8, 13]) * rng.randint(1, 4) for _ in range(n)]
        homes = lpt_homes(costs, r)
        assert homes == lpt_homes(list(costs), r)  # pure function of its input
        assert all(0 <= h < r for h in homes)
        if n:
            rep = load_report(costs, homes, r)
            # Any greedy list schedule is within mean + (1 - 1/r) * max cost.
            assert rep.max <= rep.mean + (1 - 1 / r) * max(costs) + 1e-9


def _transformer_shapes(n, d=1024):
    mha = [(3 * d, d), (d, d), (4 * d, d), (d, 4 * d)]
    gqa = [(d + 512, d), (d, d), (2816, d), (d, 2816)]
    out, layer = [], 0
    while len(out) < n:
        out += mha if layer % 2 == 0 else gqa
        layer += 1
    return out[:n]


@pytest.mark.parametrize("n,r", [(19, 8), (72, 7), (3, 8)])
def test_lpt_beats_round_robin_on_mixed_shapes(n, r):
    costs = [ns_flops(s) for s in _transformer_shapes(n)]
    lpt = load_report(costs, lpt_homes(costs, r), r)
    rr = load_report(costs, round_robin_homes(n, r), r)
    assert lpt.max <= rr.max
    assert lpt.max_over_mean <= rr.max_over_mean
    if n > r:
        assert lpt.max < rr.max


def test_round_robin_and_report():
    assert round_robin_homes(5, 3) == [0, 1, 2, 0, 1]
    assert round_robin_homes(3, 4, start=2) == [2, 3, 0]
    rep = load_report([1, 2, 3], [0, 0, 1], 2)
    assert rep == LoadReport(per_rank=(3.0, 3.0), max=3.0, mean=3.0, max_over_mean=1.0)
    assert load_report([0, 0], [0, 1], 3).max_over_mean == 1.0


@pytest.mark.parametrize(
    "call",
    [
        lambda: lpt_homes([1, -1], 2),
        lambda: lpt_homes([1, float("nan")], 2),
        lambda: lpt_homes([1], 0),
        lambda: lpt_homes([1], 2, initial_loads=[0]),
        lambda: round_robin_homes(-1, 2),
        lambda: load_report([1], [2], 2),
        lambda: load_report([1, 1], [0], 2),
    ],
)
def test_homes_bad_input(call):
    with pytest.raises(ValueError):
        call()


def test_homes_error_names_param():
    with pytest.raises(ValueError, match="param 1"):
        lpt_homes([1, -3], 2)


# ---------------------------------------------------------------------------------------------------- plan_waves


def _sizes(waves):
    return [len(w.params) for w in waves]


def test_plan_waves_sizes_and_taper():
    order = list(range(18, -1, -1))
    costs = [1.0] * 19
    assert _sizes(plan_waves(order, costs, 8, taper=False)) == [8, 8, 3]
    assert _sizes(plan_waves(order, costs, 8)) == [5, 8, 4, 2]
    assert _sizes(plan_waves(order, costs, 8, wave_slots=4)) == [4, 4, 4, 4, 2, 1]
    assert _sizes(plan_waves(order, costs, 8, wave_slots=1)) == [1] * 19
    assert _sizes(plan_waves([4, 3, 2, 1, 0], [1.0] * 5, 2, wave_slots=2)) == [1, 2, 1, 1]
    assert _sizes(plan_waves([0], [1.0], 8)) == [1]
    assert _sizes(plan_waves([2, 1, 0], [1.0] * 3, 8)) == [1, 2]
    assert plan_waves([], [], 4) == []


@pytest.mark.parametrize("taper", [True, False])
@pytest.mark.parametrize("balance", ["lpt", "round_robin"])
@pytest.mark.parametrize("n,r,slots", [(19, 8, None), (72, 7, None), (3, 8, None), (30, 4, 6), (7, 3, 1)])
def test_plan_waves_invariants(n, r, slots, balance, taper):
    rng = random.Random(n * 100 + r)
    order = list(range(n))
    rng.shuffle(order)
    costs = [float(ns_flops(s)) for s in _transformer_shapes(n)]
    waves = plan_waves(order, costs, r, wave_slots=slots, balance=balance, taper=taper)
    cap = r if slots is None else slots
    assert [w.index for w in waves] == list(range(len(waves)))
    assert [i for w in waves for i in w.params] == order  # consecutive cuts, readiness order kept
    assert all(1 <= len(w.params) <= cap for w in waves)
    if taper and len(waves) >= 2:
        assert len(waves[-1].params) <= max(1, cap // 4)
        assert len(waves[-2].params) <= max(1, cap // 2)
    for w in waves:
        assert set(w.homes) == set(w.params) and all(0 <= h < r for h in w.homes.values())
    if balance == "round_robin":
        assert [w.homes[i] for w in waves for i in w.params] == [k % r for k in range(n)]


def test_plan_waves_lpt_loads_carried():
    # Wave 0 = [0, 1] (costs 10, 1) -> homes r0, r1; wave 1 = [2] must avoid the loaded r0.
    waves = plan_waves([0, 1, 2], [10.0, 1.0, 1.0], 2, wave_slots=2, taper=False)
    assert [w.homes for w in waves] == [{0: 0, 1: 1}, {2: 1}]
    # In general each wave is LPT from the loads of the waves before it.
    costs = [float(ns_flops(s)) for s in _transformer_shapes(40)]
    order = list(range(39, -1, -1))
    loads = [0.0] * 6
    for w in plan_waves(order, costs, 6):
        wc = [costs[i] for i in w.params]
        assert [w.homes[i] for i in w.params] == lpt_homes(wc, 6, initial_loads=loads)
        for i in w.params:
            loads[w.homes[i]] += costs[i]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(order=[0, 1], costs=[1, 1], num_ranks=2, wave_slots=0), "wave_slots"),
        (dict(order=[0, 1], costs=[1, 1], num_ranks=2, balance="greedy"), "balance"),
        (dict(order=[0, 0], costs=[1, 1], num_ranks=2), "permutation"),
        (dict(order=[0], costs=[1, 1], num_ranks=2), "permutation"),
        (dict(order=[0, 2], costs=[1, 1], num_ranks=2), "permutation"),
        (dict(order=[0, 1], costs=[1, 1], num_ranks=0), "num_ranks"),
        (dict(order=[0, 1], costs=[1, -1], num_ranks=2), "param 1"),
    ],
)
def test_plan_waves_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_waves(**kwargs)


def test_wave_validates_homes():
    with pytest.raises(ValueError):
        Wave(index=0, params=(1, 2), homes={1: 0})


# ---------------------------------------------------------------------------------------------------- dispatcher


def _plan(n=19, r=8, **kw):
    return plan_waves(list(range(n - 1, -1, -1)), [1.0] * n, r, **kw)


class _Recorder:
    """A launch callback that checks, at each launch, that order and readiness hold."""

    def __init__(self, waves):
        self.waves = waves
        self.launched = []
        self.marked = set()  # filled by the test BEFORE calling mark_ready
        self.flushing = False

    def __call__(self, wave):
        assert wave.index == len(self.launched), (wave.index, self.launched)
        if not self.flushing:
            assert set(wave.params) <= self.marked
        self.launched.append(wave.index)


def _leading_complete(waves, marked):
    k = 0
    while k < len(waves) and set(waves[k].params) <= marked:
        k += 1
    return k


@pytest.mark.parametrize("seed", range(20))
def test_dispatcher_scrambled_marks_launch_in_order(seed):
    waves = _plan()
    rec = _Recorder(waves)
    d = WaveDispatcher(waves, rec)
    marks = list(range(19))
    random.Random(seed).shuffle(marks)
    for i in marks:
        rec.marked.add(i)
        d.mark_ready(i)
        assert d.launched == _leading_complete(waves, rec.marked) == len(rec.launched)
    assert d.launched == len(d._waves) and rec.launched == list(range(len(waves)))
    assert d.flush() == 0


def test_dispatcher_flush_with_unmarked_params():
    """Regression: a param whose gradient never arrives (unused) must not stall its wave or later ones."""
    waves = _plan()  # sizes [5, 8, 4, 2]: wave 0 = params 18..14
    rec = _Recorder(waves)
    d = WaveDispatcher(waves, rec)
    for i in [18, 17, 16, 15, 14, 13] + [1, 0]:  # wave 0, part of wave 1, all of wave 3
        rec.marked.add(i)
        d.mark_ready(i)
    assert d.launched == 1 and not d.launched == len(d._waves)
    rec.flushing = True
    assert d.flush() == 3
    assert rec.launched == [0, 1, 2, 3] and d.launched == len(d._waves)
    rec.flushing = False
    d.mark_ready(5)  # late mark after the flush: no relaunch
    assert rec.launched == [0, 1, 2, 3]
    # A new step starts clean.
    d.reset()
    rec.launched.clear()
    assert d.launched == 0
    for i in range(18, 13, -1):
        d.mark_ready(i)
    assert rec.launched == [0]


def test_dispatcher_idempotent_and_unknown():
    waves = _plan(4, 2, taper=False)  # [3, 2], [1, 0]
    rec = _Recorder(waves)
    d = WaveDispatcher(waves, rec)
    rec.marked |= {3}
    d.mark_ready(3)
    d.mark_ready(3)
    d.mark_ready(3)
    assert d.launched == 0  # param 2 still missing: repeats of 3 do not count
    rec.marked |= {2}
    d.mark_ready(2)
    d.mark_ready(2)
    assert rec.launched == [0]
    with pytest.raises(ValueError, match="param 7"):
        d.mark_ready(7)


def test_dispatcher_bad_waves():
    w0 = Wave(index=0, params=(0,), homes={0: 0})
    with pytest.raises(ValueError, match="index"):
        WaveDispatcher([Wave(index=1, params=(0,), homes={0: 0})], lambda w: None)
    with pytest.raises(ValueError, match="param 0"):
        WaveDispatcher([w0, Wave(index=1, params=(0,), homes={0: 0})], lambda w: None)
    with pytest.raises(ValueError, match="no params"):
        WaveDispatcher([w0, Wave(index=1, params=(), homes={})], lambda w: None)


def test_dispatcher_reentrant_launch_keeps_order():
    """A launch that marks params itself (same thread) must neither deadlock nor launch out of order."""
    waves = _plan(6, 2, taper=False)  # [5, 4], [3, 2], [1, 0]
    launched = []

    def launch(w):
        launched.append(w.index)
        if w.index == 0:
            for i in (1, 0, 3, 2):  # completes wave 2 before wave 1
                d.mark_ready(i)
            assert launched == [0]  # nothing launched from inside the launch
            d.flush()
            assert launched == [0]

    d = WaveDispatcher(waves, launch)
    d.mark_ready(5)
    d.mark_ready(4)
    assert launched == [0, 1, 2]


def test_dispatcher_failed_launch_blocks_until_reset():
    waves = _plan(4, 2, taper=False)
    calls = []

    def launch(w):
        calls.append(w.index)
        if len(calls) == 1:
            raise OSError("lane down")

    d = WaveDispatcher(waves, launch)
    d.mark_ready(3)
    with pytest.raises(OSError):
        d.mark_ready(2)
    assert d.launched == 0
    with pytest.raises(RuntimeError, match="reset"):
        d.mark_ready(1)
    with pytest.raises(RuntimeError, match="reset"):
        d.flush()
    d.reset()
    assert d.flush() == 2 and calls == [0, 0, 1]


def test_dispatcher_threads_marking_concurrently():
    """Marks racing on several threads (autograd device threads, comm threads) still launch in wave order."""
    n, threads = 64, 8
    waves = plan_waves(list(range(n - 1, -1, -1)), [float(i % 5 + 1) for i in range(n)], 8, wave_slots=6)
    for step in range(15):
        rec = _Recorder(waves)
        lock = threading.Lock()
        d = WaveDispatcher(waves, rec)
        marks = list(range(n))
        random.Random(step).shuffle(marks)
        barrier = threading.Barrier(threads)
        errors = []

        def work(chunk):
            try:
                barrier.wait()
                for i in chunk:
                    with lock:
                        rec.marked.add(i)
                    d.mark_ready(i)
                    d.mark_ready(i)
            except BaseException as e:  # noqa: BLE001 - surfaced below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(marks[t::threads],)) for t in range(threads)]
        for t in ts:
            t.start()
        for t in ts:
            t.join(timeout=30)
        assert not errors, errors
        assert rec.launched == list(range(len(waves))) and d.launched == len(d._waves)


# ---------------------------------------------------------------------------------------------------- recorder


def test_readiness_recorder():
    r = ReadinessRecorder(6)
    for i in (4, 5, 4, 1, 5):
        r.mark_ready(i)
    assert r.recorded == (4, 5, 1)
    assert r.order() == [4, 5, 1, 3, 2, 0]
    r.reset()
    assert r.order() == [5, 4, 3, 2, 1, 0]
    with pytest.raises(ValueError):
        r.mark_ready(6)
    with pytest.raises(ValueError):
        ReadinessRecorder(-1)
    # Its order is a valid plan_waves order.
    assert len(plan_waves(r.order(), [1.0] * 6, 2)) >= 1


# ---------------------------------------------------------------------------------------------------------------
# plan_waves_by_cost
# ---------------------------------------------------------------------------------------------------------------

from overlap_muon._scheduler import WaveCostModel, plan_waves_by_cost  # noqa: E402
from overlap_muon._scheduler.waves import _Segment, _finish  # noqa: E402


def _llama_shapes(layers: int = 6, d: int = 256) -> list[tuple[int, int]]:
    """A Llama-shaped stack: GQA (4 query heads, 2 KV heads of 64), SwiGLU MLP 688; layer 0 first."""
    per = [(256, d), (128, d), (128, d), (d, 256), (688, d), (688, d), (d, 688)]
    return per * layers


def _ns_calls(waves, shapes) -> int:
    """zeropower calls of a plan with shape batching: one per (wave, home, shape)."""
    return sum(len({(w.homes[i], shapes[i]) for i in w.params}) for w in waves)


def _plan_finish(waves, order, costs, shapes, S, model, ready) -> float:
    works, ends = [], []
    for w in waves:
        seg = _Segment()
        for i in w.params:
            seg.add(costs[i], shapes[i], S)
        works.append(seg.seconds(model, S))
        ends.append(max(ready[i] for i in w.params))
    return _finish([len(w.params) for w in waves], works, ends)


@pytest.mark.parametrize("S", [1, 2, 3, 8])
@pytest.mark.parametrize("balance", ["lpt", "round_robin"])
def test_plan_by_cost_partitions_the_order(S, balance):
    shapes = _llama_shapes(3)
    costs = [float(ns_flops(s)) for s in shapes]
    order = list(reversed(range(len(shapes))))
    waves = plan_waves_by_cost(order, costs, shapes, S, balance=balance)
    assert [i for w in waves for i in w.params] == order
    assert [w.index for w in waves] == list(range(len(waves)))
    assert all(0 <= h < S for w in waves for h in w.homes.values())
    again = plan_waves_by_cost(order, costs, shapes, S, balance=balance)
    assert [(w.params, w.homes) for w in again] == [(w.params, w.homes) for w in waves]
    assert plan_waves_by_cost([], [], [], S) == []


def test_plan_by_cost_batches_at_world_1_where_count_based_cannot():
    """Regression guard for the issue's figure: with one home, the count-based overlap default (one matrix per
    wave) makes one NS call per matrix (43 per step on the 6-layer Llama-shaped model); the cost-based plan
    groups same-shape matrices."""
    shapes = _llama_shapes(6)
    costs = [float(ns_flops(s)) for s in shapes]
    order = list(reversed(range(len(shapes))))
    by_count = plan_waves(order, costs, 1, wave_slots=1)
    by_cost = plan_waves_by_cost(order, costs, shapes, 1)
    assert _ns_calls(by_count, shapes) == len(shapes)
    assert _ns_calls(by_cost, shapes) < len(shapes) // 2
    assert len(by_cost) < len(by_count)


def test_plan_by_cost_tapers_when_backward_is_long():
    """The last wave (first layers, awaited first by the next forward) is small; the first is large."""
    shapes = _llama_shapes(6)
    costs = [float(ns_flops(s)) for s in shapes]
    order = list(reversed(range(len(shapes))))
    base = sum(c / WaveCostModel().ns_flops_per_s + WaveCostModel().ns_call_s for c in costs)
    for factor in (2, 4, 10):
        sizes = [len(w.params) for w in plan_waves_by_cost(order, costs, shapes, 1,
                                                             WaveCostModel(backward_s=factor * base))]
        assert sizes[-1] == 1, (factor, sizes)
        assert sizes[0] == max(sizes), (factor, sizes)


def test_plan_by_cost_extremes():
    shapes = [(64, 64), (64, 128)] * 8
    costs = [float(ns_flops(s)) for s in shapes]
    order = list(range(16))
    # Every gradient ready at once: any cut only adds fixed costs, so one wave.
    assert [len(w.params) for w in plan_waves_by_cost(order, costs, shapes, 2, ready_s=[0.0] * 16)] == [16]
    # Free waves and calls, gradients far apart: each matrix as soon as it is ready (then merges that cost
    # nothing on the critical path are allowed, so the last wave stays one matrix).
    free = WaveCostModel(ns_call_s=0.0, wave_s=0.0)
    waves = plan_waves_by_cost(order, costs, shapes, 2, free, ready_s=[float(i) for i in range(16)])
    assert len(waves[-1].params) == 1
    # max_wave_params bounds every wave.
    waves = plan_waves_by_cost(order, costs, shapes, 1, ready_s=[0.0] * 16, max_wave_params=5)
    assert max(len(w.params) for w in waves) <= 5


@pytest.mark.parametrize("seed", range(6))
def test_plan_by_cost_finish_is_optimal_over_every_cut(seed):
    """Brute force over all 2^(n-1) cuts of a small instance: no cut finishes the last wave earlier."""
    import itertools
    import random

    rnd = random.Random(seed)
    n, S = 7, rnd.choice([1, 2, 3])
    shapes = [rnd.choice([(32, 32), (64, 32), (128, 64)]) for _ in range(n)]
    costs = [float(ns_flops(s)) for s in shapes]
    order = rnd.sample(range(n), n)
    ready = [rnd.uniform(0, 2e-3) for _ in range(n)]
    model = WaveCostModel(ns_flops_per_s=1e10, ns_call_s=rnd.uniform(0, 5e-4), wave_s=rnd.uniform(0, 5e-4))
    best = plan_waves_by_cost(order, costs, shapes, S, model, ready_s=ready)
    run_ready = {}
    acc = 0.0
    for i in order:  # a wave launches once every gradient before it in the order is ready
        acc = max(acc, ready[i])
        run_ready[i] = acc
    got = _plan_finish(best, order, costs, shapes, S, model, run_ready)
    for cuts in itertools.product([0, 1], repeat=n - 1):
        sizes, size = [], 1
        for c in cuts:
            if c:
                sizes.append(size)
                size = 1
            else:
                size += 1
        sizes.append(size)
        waves, pos = [], 0
        for k, z in enumerate(sizes):
            waves.append(Wave(index=k, params=tuple(order[pos:pos + z]), homes={i: 0 for i in order[pos:pos + z]}))
            pos += z
        assert got <= _plan_finish(waves, order, costs, shapes, S, model, run_ready) * (1 + 1e-9)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(order=[0, 0]), "permutation"),
        (dict(shapes=[(4, 4)]), "shapes has 1"),
        (dict(shapes=[(4, 4), (4,)]), "shape of param 1"),
        (dict(num_ranks=0), "num_ranks"),
        (dict(balance="best"), "balance"),
        (dict(ready_s=[0.0]), "ready_s has 1"),
        (dict(ready_s=[0.0, -1.0]), "ready_s of param 1"),
        (dict(max_wave_params=0), "max_wave_params"),
        (dict(costs=[1.0, float("nan")]), "cost of param 1"),
    ],
)
def test_plan_by_cost_bad_input(kwargs, match):
    args = dict(order=[1, 0], costs=[1.0, 2.0], shapes=[(4, 4), (4, 8)], num_ranks=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        plan_waves_by_cost(**args)


@pytest.mark.parametrize("field, value", [("ns_flops_per_s", 0), ("ns_call_s", -1.0), ("wave_s", float("inf")),
                                          ("link_bytes_per_s", -5.0), ("backward_s", -1.0)])
def test_wave_cost_model_validates(field, value):
    with pytest.raises(ValueError, match=field):
        WaveCostModel(**{field: value})


# ---------------------------------------------------------------------------------------------------------------
# plan hash
# ---------------------------------------------------------------------------------------------------------------

from overlap_muon._scheduler import first_plan_difference, param_fingerprints, plan_hash  # noqa: E402


def _plan_inputs(n: int = 6, S: int = 2):
    names = [f"layers.{i // 3}.{'qkv'[i % 3]}.weight" for i in range(n)]
    shapes = [(64 * (1 + i % 3), 64) for i in range(n)]
    pds = [i % 2 for i in range(n)]
    costs = [float(ns_flops(s)) for s in shapes]
    waves = plan_waves(list(reversed(range(n))), costs, S, wave_slots=2)
    return names, shapes, pds, waves


def test_plan_hash_is_deterministic_across_processes():
    """The hash must not depend on the process (Python's str hash is salted per process): a fresh interpreter
    computes the same value."""
    import subprocess
    import sys

    names, shapes, pds, waves = _plan_inputs()
    h = plan_hash(param_fingerprints(names, shapes, pds, waves), extra=(1, 2, "layer_sharded"))
    assert 0 <= h < 2**63
    code = (
        "from tests.test_scheduler import _plan_inputs\n"
        "from overlap_muon._scheduler import param_fingerprints, plan_hash\n"
        "n, s, p, w = _plan_inputs()\n"
        "print(plan_hash(param_fingerprints(n, s, p, w), extra=(1, 2, 'layer_sharded')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**__import__("os").environ, "PYTHONHASHSEED": "12345"})
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.strip()) == h


def test_plan_hash_sees_every_field():
    names, shapes, pds, waves = _plan_inputs()
    base = param_fingerprints(names, shapes, pds, waves)
    h = plan_hash(base)
    assert plan_hash(base, extra=("duplicated",)) != h
    assert plan_hash(base[:-1]) != h
    changed = [
        param_fingerprints(names[:2] + ["other"] + names[3:], shapes, pds, waves),
        param_fingerprints(names, shapes[:2] + [(65, 64)] + shapes[3:], pds, waves),
        param_fingerprints(names, shapes, pds[:2] + [None] + pds[3:], waves),
    ]
    for fp in changed:
        assert plan_hash(fp) != h
        assert [i for i, (a, b) in enumerate(zip(fp, base)) if a != b] == [2]
    # Another home or wave cut changes the fingerprints of the params concerned.
    costs = [float(ns_flops(s)) for s in shapes]
    other = plan_waves(list(reversed(range(6))), costs, 2, wave_slots=3)
    assert plan_hash(param_fingerprints(names, shapes, pds, other)) != h


def test_first_plan_difference_names_the_param_and_ranks():
    names, shapes, pds, waves = _plan_inputs()
    fp = param_fingerprints(names, shapes, pds, waves)
    assert first_plan_difference([fp, fp, fp], [names] * 3) is None
    bad = list(fp)
    bad[4] ^= 1
    d = first_plan_difference([fp, fp, bad, bad], [names] * 4)
    assert (d.index, d.name, d.ranks) == (4, names[4], (2, 3))
    msg = d.message()
    assert names[4] in msg and "#4" in msg and "[2, 3]" in msg
    # A rank with a param fewer differs at the first index it lacks; one with a param more, at the extra one.
    d = first_plan_difference([fp, fp[:-1]], [names, names[:-1]])
    assert (d.index, d.name, d.ranks) == (5, names[5], (1,))
    d = first_plan_difference([fp[:-1], fp], [names[:-1], names])
    assert (d.index, d.name, d.ranks) == (5, names[5], (1,))


def test_plan_hash_bad_input():
    names, shapes, pds, waves = _plan_inputs()
    with pytest.raises(ValueError, match="one entry per param"):
        param_fingerprints(names[:-1], shapes, pds, waves)
    with pytest.raises(ValueError, match="in no wave"):
        param_fingerprints(names, shapes, pds, waves[1:])
    with pytest.raises(ValueError, match="partition_dim=2"):
        param_fingerprints(names, shapes, [2] + pds[1:], waves)
    with pytest.raises(ValueError, match="shape"):
        param_fingerprints(names, [(4, 4, 4)] + shapes[1:], pds, waves)
    with pytest.raises(ValueError, match="per rank"):
        first_plan_difference([], [])
    with pytest.raises(ValueError, match="rank 1 has"):
        first_plan_difference([[1], [1]], [["a"], []])


def test_lpt_node_tie_break_moves_only_ties():
    """[Note: homes that know nodes]: with node_size, equal-load homes go to a diagonal (one per node and per local
    index before any repeat), and every rank's NS load is plain LPT's (as a multiset: only ties move)."""
    from overlap_muon._scheduler.homes import lpt_homes

    assert lpt_homes([1.0] * 4, 16, node_size=4) == [0, 5, 10, 15]
    assert lpt_homes([1.0] * 4, 16) == [0, 1, 2, 3]
    rng = random.Random(7)
    for _ in range(50):
        n, ranks, L = rng.randint(1, 40), rng.choice([4, 8, 16]), rng.choice([2, 4])
        costs = [float(rng.choice([1, 2, 3, 5])) for _ in range(n)]
        loads = {}
        for ns in (None, L):
            per = [0.0] * ranks
            for c, h in zip(costs, lpt_homes(costs, ranks, node_size=ns)):
                per[h] += c
            loads[ns] = sorted(per)
        assert loads[None] == loads[L], (costs, ranks, L)
    with pytest.raises(ValueError):
        lpt_homes([1.0], 4, node_size=0)
