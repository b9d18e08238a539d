"""Tests for hooks/: grad-ready tracker, DDP readiness comm hook, forward waits (FSDP2 hook order)."""

import threading

import pytest
import torch
import torch.distributed as dist

from overlap_muon._hooks import GradReadyTracker, ddp_readiness_hook, register_forward_waits
from tests.dist_utils import run_ranks

pytestmark = pytest.mark.timeout(120)


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))


# ---------------------------------------------------------------------------------------------------- tracker


def test_tracker_fires_once_per_param_then_end_callback():
    model = _mlp()
    params = list(model.parameters())
    events = []

    def on_end():
        # Runs after autograd finished: every used param's grad is in place.
        assert all(p.grad is not None for p in params)
        events.append("end")

    tracker = GradReadyTracker(params, events.append, on_end)
    assert len(tracker._handles) == 4
    for step in range(3):
        events.clear()
        model(torch.randn(5, 4)).sum().backward()
        assert len(events) == 5 and sorted(events[:-1]) == [0, 1, 2, 3] and events[-1] == "end", events
    # Gradient accumulation over several micro-batches: one end callback per backward.
    events.clear()
    model(torch.randn(5, 4)).sum().backward()
    model(torch.randn(5, 4)).sum().backward()
    assert events.count("end") == 2 and len(events) == 10
    tracker.remove()
    tracker.remove()
    events.clear()
    model(torch.randn(5, 4)).sum().backward()
    assert events == []


def test_tracker_disabled_is_silent():
    model = _mlp()
    events = []
    tracker = GradReadyTracker(list(model.parameters()), events.append, lambda: events.append("end"))
    tracker.enabled = False
    model(torch.randn(5, 4)).sum().backward()
    assert events == []
    tracker.enabled = True
    model(torch.randn(5, 4)).sum().backward()
    assert len(events) == 5 and events[-1] == "end"


def test_tracker_tied_weight_once():
    """A tied weight listed twice and used twice in the graph fires once, under its first index."""
    emb = torch.nn.Parameter(torch.randn(7, 3))
    bias = torch.nn.Parameter(torch.zeros(7))
    events = []
    tracker = GradReadyTracker([emb, bias, emb], events.append, lambda: events.append("end"))
    assert len(tracker._handles) == 2
    ids = torch.tensor([1, 4, 4])
    logits = emb[ids] @ emb.T + bias
    logits.sum().backward()
    assert sorted(events[:-1]) == [0, 1] and events[-1] == "end"


def test_tracker_unused_and_frozen_params():
    """An unused param never fires, yet the end callback still runs (so a flush can launch its wave)."""
    a = torch.nn.Parameter(torch.randn(3))
    unused = torch.nn.Parameter(torch.randn(3))
    frozen = torch.randn(3)  # requires_grad=False: never hooked
    events = []
    tracker = GradReadyTracker([a, unused, frozen], events.append, lambda: events.append("end"))
    assert len(tracker._handles) == 2
    (a * 2).sum().backward()
    assert events == [0, "end"]


def test_tracker_end_callback_after_aborted_backward():
    """Regression: a backward that raised mid-way must not leave the tracker believing its end callback is
    already queued (it is keyed by the autograd graph task, not by a flag)."""
    w = torch.nn.Parameter(torch.randn(3))
    events = []
    fail = [True]

    def on_ready(i):
        if fail[0]:
            raise KeyError("boom")
        events.append(i)

    GradReadyTracker([w], on_ready, lambda: events.append("end"))
    with pytest.raises(Exception, match="boom"):
        (w * 3).sum().backward()
    fail[0] = False
    (w * 3).sum().backward()
    assert events == [0, "end"]


def test_tracker_bad_input():
    w = torch.nn.Parameter(torch.randn(2, 2))
    with pytest.raises(TypeError, match="param 1"):
        GradReadyTracker([w, "x"], lambda i: None)
    with pytest.raises(ValueError, match=r"param 1 \(shape \(2, 2\)\)"):
        GradReadyTracker([w, w * 2], lambda i: None)


# ---------------------------------------------------------------------------------------------------- forward waits


def test_forward_waits_run_first_and_once():
    model = _mlp()
    order = []
    model[0].register_forward_pre_hook(lambda m, a: order.append("other"))
    handles = register_forward_waits([model[0], model[2], model[0]], lambda m: order.append(m))
    assert len(handles) == 2
    model(torch.randn(2, 4))
    assert order == [model[0], "other", model[2]]
    for h in handles:
        h.remove()
    order.clear()
    model(torch.randn(2, 4))
    assert order == ["other"]
    with pytest.raises(TypeError, match=r"modules\[1\]"):
        register_forward_waits([model, 3], lambda m: None)


# ---------------------------------------------------------------------------------------------------- distributed


def _ddp_body(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 8), torch.nn.Linear(8, 3))
    ref.load_state_dict(model.state_dict())
    # Tiny buckets: several buckets, so signals arrive while backward is still running.
    ddp = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=1e-4)
    params = list(model.parameters())
    watched = params[:-1]  # the last bias is averaged but not watched
    seen: dict[int, torch.Tensor] = {}
    counts: dict[int, int] = {}
    lock = threading.Lock()

    calls = [0]

    def on_ready(indices):
        with lock:
            calls[0] += 1
            for i in indices:
                counts[i] = counts.get(i, 0) + 1
                seen[i] = watched[i].grad.clone()  # must already be the averaged value

    ddp.register_comm_hook(*ddp_readiness_hook(on_ready, {id(p): i for i, p in enumerate(watched)}))
    for step in range(3):
        seen.clear()
        counts.clear()
        x = torch.randn(5, 4, generator=torch.Generator().manual_seed(10 * step + rank))
        ddp(x).pow(2).sum().backward()
        ref.zero_grad(set_to_none=True)
        ref(x).pow(2).sum().backward()
        expected = []
        for p in ref.parameters():
            g = p.grad / world_size  # divide first, as DDP's default hook does
            dist.all_reduce(g)
            expected.append(g)
        assert counts == {i: 1 for i in range(len(watched))}, counts
        for i in range(len(watched)):
            assert torch.equal(seen[i], expected[i]), (step, i)
            assert torch.equal(params[i].grad, expected[i])
        assert torch.equal(params[-1].grad, expected[-1])
        ddp.zero_grad(set_to_none=step % 2 == 0)  # both zero_grad modes

    # no_sync micro-batches: no signal until the synced backward.
    counts.clear()
    for _ in range(2):
        with ddp.no_sync():
            ddp(torch.randn(5, 4)).sum().backward()
        assert counts == {}
    ddp(torch.randn(5, 4)).sum().backward()
    assert counts == {i: 1 for i in range(len(watched))}
    assert calls[0] >= 2, "expected several buckets, each signalled on its own"

    # Without gradient_as_bucket_view the averaged values reach .grad only at the end of backward: refused.
    model2 = torch.nn.Linear(4, 3)
    ddp2 = DDP(model2, gradient_as_bucket_view=False)
    index2 = {id(p): i for i, p in enumerate(model2.parameters())}
    ddp2.register_comm_hook(*ddp_readiness_hook(lambda idx: None, index2))
    try:
        ddp2(torch.randn(2, 4)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the error crosses the C++ reducer; check its message
        assert "gradient_as_bucket_view=True" in str(e), str(e)
    else:
        raise AssertionError("gradient_as_bucket_view=False was not refused")
    return True


def _fsdp_body(rank, world_size):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    mesh = init_device_mesh("cpu", (world_size,))
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    for m in (model[0], model[2]):
        fully_shard(m, mesh=mesh)
    fully_shard(model, mesh=mesh)
    layers = [model[0], model[2]]

    # Forward order: the prepended wait sees the sharded DTensor; a plain hook added after fully_shard runs
    # after FSDP's all-gather and sees the unsharded param.
    log = []

    def wait(m):
        w = m.weight
        local = tuple(w.to_local().shape) if isinstance(w, DTensor) else None
        log.append(("wait", layers.index(m), isinstance(w, DTensor), local))

    for k, m in enumerate(layers):
        m.register_forward_pre_hook(lambda mod, args, k=k: log.append(("plain", k, isinstance(mod.weight, DTensor))))
    handles = register_forward_waits(layers, wait)
    # Grad readiness on FSDP2's sharded DTensor params: FSDP calls the post-accumulate hooks after reduce-scatter.
    params = list(model.parameters())
    events = []

    def on_ready(i):
        g = params[i].grad
        events.append((i, isinstance(g, DTensor), tuple(g.to_local().shape) == tuple(params[i].to_local().shape)))

    tracker = GradReadyTracker(params, on_ready, lambda: events.append("end"))
    for _ in range(2):
        log.clear()
        events.clear()
        model(torch.randn(5, 4)).sum().backward()
        rows0 = len(torch.chunk(torch.empty(6), world_size)[rank])
        rows2 = len(torch.chunk(torch.empty(3), world_size)[rank])
        assert log == [
            ("wait", 0, True, (rows0, 4)),
            ("plain", 0, False),
            ("wait", 1, True, (rows2, 6)),
            ("plain", 1, False),
        ], log
        assert events[-1] == "end" and events.count("end") == 1, events
        assert sorted(e[0] for e in events[:-1]) == list(range(len(params))), events
        assert all(e[1] and e[2] for e in events[:-1]), events
        model.zero_grad(set_to_none=True)
    for h in handles:
        h.remove()
    tracker.remove()
    return True


def _dist_body(rank, world_size):
    # One spawn per world size for both checks: spawning ranks is the slow part.
    return _ddp_body(rank, world_size), _fsdp_body(rank, world_size)


@pytest.mark.parametrize("world", [1, 2])
def test_ddp_readiness_and_fsdp2_hooks(world):
    """DDP: the values visible in .grad when on_ready fires equal the averaged gradient. FSDP2: the forward
    wait runs before FSDP's all-gather pre-hook, and grad-ready hooks fire on the sharded DTensor grads."""
    assert run_ranks(_dist_body, world, timeout=100) == [(True, True)] * world
