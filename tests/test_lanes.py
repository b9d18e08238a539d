"""The lanes (``overlap_muon/_lanes.py``) on CPU.

[Note: a waiting thread helps]: the thread that waits for the lanes runs the compute lane's queued NS tasks from the
back, once each, and nothing else. Bug it answers: on a 2-core machine at world 1, ``step()`` sat idle in the barrier
while one lane thread worked through a queue of NS tasks (overlap on was slower than off on a DTensor TP model: 104
vs 102 ms per iteration). And the CUDA lanes' streams named by device, driven with fakes.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from overlap_muon import OverlapMuon
from overlap_muon._lanes import Lanes
from tests.models import HP, Deep, train_pair
from tests.seams import SeamedOverlapMuon, TestingSeam


def _lanes_with_a_blocked_worker():
    """CPU lanes whose compute worker is held inside a first task until the returned event is set."""
    lanes = Lanes(torch.device("cpu"))
    gate, started = threading.Event(), threading.Event()

    def blocker():
        started.set()
        gate.wait(30)
        return "first"

    first = lanes.submit("compute", blocker, shareable=True)
    assert started.wait(30)
    return lanes, gate, first


def test_help_runs_queued_shareable_tasks_last_first_and_handles_resolve_in_order():
    lanes, gate, first = _lanes_with_a_blocked_worker()
    ran: list[tuple[int, str]] = []

    def task(k):
        def fn():
            ran.append((k, threading.current_thread().name))
            return k
        return fn

    handles = [lanes.submit("compute", task(k), shareable=True) for k in range(4)]
    kept = lanes.submit("compute", task(9))  # not shareable: only the lane's worker runs it
    lanes.help()
    main = threading.current_thread().name
    assert ran == [(3, main), (2, main), (1, main), (0, main)], ran
    assert not any(h.done() for h in handles)  # the worker has not reached them: their handles wait in queue order
    gate.set()
    assert first.result() == "first" and [h.result() for h in handles] == [0, 1, 2, 3]
    assert kept.result() == 9 and ran[-1] == (9, ran[-1][1]) and ran[-1][1] != main
    lanes.shutdown()


def test_an_error_in_a_helped_task_reaches_the_waiter_through_the_lane():
    lanes, gate, _ = _lanes_with_a_blocked_worker()

    def boom():
        raise KeyError("planted")

    bad = lanes.submit("compute", boom, shareable=True)
    after = lanes.submit("from_home", lambda: "later", deps=[bad])
    lanes.help()  # runs boom on this thread; the error is the lane's, not help()'s
    gate.set()
    with pytest.raises(RuntimeError, match="compute lane task failed") as e:
        bad.wait()
    assert isinstance(e.value.__cause__, KeyError)
    with pytest.raises(RuntimeError, match="from_home lane task failed"):
        after.wait()
    lanes.shutdown()


def test_help_takes_nothing_the_worker_took():
    lanes = Lanes(torch.device("cpu"))
    counts: list[int] = []
    handles = [lanes.submit("compute", lambda k=k: counts.append(k), shareable=True) for k in range(50)]
    for _ in range(5):
        lanes.help()
    for h in handles:
        h.result()
    assert sorted(counts) == list(range(50)) and not lanes._shared  # each ran once; nothing is left queued
    lanes.shutdown()


def test_step_helps_with_ns_and_stays_bitwise():
    """With the lane's first NS held until the barrier has run one, ``step()``'s barrier runs NS tasks itself (on the
    main thread; no timing decides it), and the result is torch's, bitwise."""
    torch.manual_seed(0)
    model, ref = Deep(), Deep()
    ref.load_state_dict(model.state_dict())
    threads: list[str] = []
    main, helped = threading.current_thread().name, threading.Event()

    def ns_wrap(ns, mats, kw):
        me = threading.current_thread().name
        threads.append(me)
        if me == main:
            helped.set()
        else:
            helped.wait(30)  # the lane's worker waits here until the barrier has helped once
        return ns(mats, kw)

    opt = SeamedOverlapMuon(model, overlap=True, _testing=TestingSeam(ns_wrap=ns_wrap), **HP)
    xs = [torch.randn(8, 16) for _ in range(3)]
    train_pair(model, opt, ref, [torch.optim.Muon(ref.parameters(), **HP)], xs, range(3))
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p, q)
    assert helped.is_set() and any(t != main for t in threads), threads
    assert opt.stats["ns_matrices"] == len(threads)  # counted once each, whichever thread ran it
    opt.close()


def _team_threads(rank, world):
    """``surplus="team"`` NS issues collectives: it never runs on the waiting thread (a rank's collectives would
    leave the lane's order). The first wave's team NS is slowed, so the second is still queued when ``step()``
    waits."""
    from torch import nn

    from tests.models import explicit_groups

    tp, _ = explicit_groups(1, 2, 0, rank)
    torch.manual_seed(0)
    net = nn.Module()
    for name in ("a", "b"):  # this rank's half (rows) of a (768, 768) matrix each
        w = nn.Parameter(torch.randn(384, 768))
        w.partition_dim, w.full_shape = 0, (768, 768)
        setattr(net, name, w)
    opt = OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=tp, overlap=True, surplus="team", wave_slots=1,
                      **HP)
    seen: list[str] = []
    ctx = opt._pipeline._ctx
    team_ns = ctx.team_ns

    def watch(work, kw):
        seen.append(threading.current_thread().name)
        if len(seen) % 2:
            time.sleep(0.3)
        return team_ns(work, kw)

    ctx.team_ns = watch
    for s in range(2):
        for j, w in enumerate((net.b, net.a)):
            w.grad = torch.randn(384, 768, generator=torch.Generator().manual_seed(s + 10 * rank + 100 * j))
            opt._rt.on_ready(opt._rt.index.first[id(w)])  # the gradient-ready hook: launched before step()
        opt.step()
        opt.zero_grad()
    opt.close()
    return seen, opt.stats["waves_launched"]


@pytest.mark.timeout(120)
def test_collective_ns_stays_on_its_lane():
    from tests.dist_utils import run_ranks

    for seen, launched in run_ranks(_team_threads, 2, timeout=100):
        assert launched == 4 and len(seen) == 4 and all(t.startswith("overlap_muon_compute") for t in seen), seen


def _fake_cuda_lanes(monkeypatch, dev):
    """CUDA lanes on ``dev`` driven on CPU: fake streams and events that record the device they were asked for;
    returns ``(lanes, asked)``."""
    import contextlib

    asked: list[object] = []

    class FakeStream:
        def __init__(self, device):
            self.device = device

        def wait_stream(self, other):
            pass

        def wait_event(self, event):
            pass

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.stream = None

        def record(self, stream=None):
            self.stream = stream

        def query(self):
            return True

    def current_stream(device=None):
        asked.append(device)
        return FakeStream(device)

    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    lanes = Lanes(torch.device("cpu"), side_streams=False)
    lanes.cuda, lanes.inline, lanes.device = True, False, dev
    lanes._streams = {name: FakeStream(dev) for name in ("to_home", "compute", "from_home")}
    return lanes, asked


def test_cuda_lanes_name_the_params_device(monkeypatch):
    """Issue 46, finding 6: params on ``cuda:1`` in a process whose current device is ``cuda:0`` (no
    ``set_device``): every current stream the lanes order against is ``cuda:1``'s."""
    dev = torch.device("cuda", 1)
    lanes, asked = _fake_cuda_lanes(monkeypatch, dev)
    h = lanes.submit("compute", lambda: 7)
    h.wait()
    timed = lanes.current_stream_event(timing=True)
    assert h.value == 7 and asked and all(d == dev for d in asked), asked
    assert timed.stream is not None and timed.stream.device == dev


def test_cuda_lane_error_waits_for_the_next_wait(monkeypatch):
    """Issue 46, finding 6: a CUDA task that raises while it is enqueued (from a grad hook, mid-backward) does not
    raise there; its handle keeps the error for the next wait, as a CPU future does, and a task depending on it is
    not run and carries the same error."""
    lanes, _ = _fake_cuda_lanes(monkeypatch, torch.device("cuda", 0))
    ran = []

    def oom():
        raise torch.OutOfMemoryError("planted")

    bad = lanes.submit("to_home", oom)  # returns: the hook that launched it goes on
    after = lanes.submit("compute", lambda: ran.append(1), deps=[bad])
    assert bad.done() and after.done() and not ran
    for h in (bad, after):
        with pytest.raises(RuntimeError, match="lane task failed") as e:
            h.wait()
        assert isinstance(e.value.__cause__, torch.OutOfMemoryError)
