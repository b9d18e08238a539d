"""The overlap runtime: waves launched from backward, forward waits, accumulation, unused params, ordering."""

from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, Deep, PlainShardNet, TinyNet, block, build_dtensor_model, local, plain_opt



def _reference_plain(steps, micro=1, skip_fn=None):
    """torch.optim.Muon + AdamW on the full PlainShardNet matrices, grads summed over micro-batches in order
    (``micro``: per step, or a list of per-step counts)."""
    net = PlainShardNet(1, 1, 0, 0)
    fulls = {n: nn.Parameter(net.full[n].clone()) for n in net.SHAPES}
    scale = nn.Parameter(torch.ones(5))
    mu = torch.optim.Muon(list(fulls.values()), **HP)
    aw = torch.optim.AdamW([scale], **ADAMW_KW)
    for s in range(steps):
        for n, p in fulls.items():
            p.grad = None
        scale.grad = None
        skip = skip_fn(s) if skip_fn else ()
        for m in range(micro[s] if isinstance(micro, list) else micro):
            _, fg = net.local_grads(s, m)
            for n, p in fulls.items():
                if n in skip:
                    continue
                p.grad = fg[n].clone() if p.grad is None else p.grad + fg[n]
            scale.grad = fg["scale"].clone() if scale.grad is None else scale.grad + fg["scale"]
        mu.step()
        aw.step()
    return fulls, mu


def _check_plain(net, opt, fulls, mu, R, T, g, t, tag):
    bad = []
    for n, (_, pd) in net.SHAPES.items():
        w = getattr(net, n).weight
        if not torch.equal(w.detach(), block(fulls[n].detach(), pd, R, T, g, t)):
            bad.append(f"{tag}: {n}")
        st = mu.state.get(fulls[n])
        if st is not None and not torch.equal(opt.state[w]["momentum_buffer"], block(st["momentum_buffer"], pd, R, T, g, t)):
            bad.append(f"{tag}: momentum {n}")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# overlap on == overlap off (and == torch.optim.Muon for the plain model)
# ---------------------------------------------------------------------------------------------------------------
def _on_off_plain(rank, world, R, T):
    g, t = divmod(rank, T)
    bad = []
    fulls, mu = _reference_plain(5)
    for fused in (True, False):
        for overlap in (True, False):
            net = PlainShardNet(R, T, g, t)
            opt = plain_opt(net, R, T, g, t, overlap=overlap, fused_a2a=fused)
            for s in range(5):
                cs, _ = net.local_grads(s)
                net(cs).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            bad += _check_plain(net, opt, fulls, mu, R, T, g, t, f"{R}x{T} fused={fused} overlap={overlap}")
            opt.close()
    return bad


def _on_off_dtensor(rank, world, R, T):
    bad = []
    torch.manual_seed(0)
    full = TinyNet()
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(5))
    finals = {}
    for fused in (True, False):
        for overlap in (True, False):
            model, mesh = build_dtensor_model(full, R, T)
            opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, fused_a2a=fused, **HP)
            for s in range(5):
                model(x * (s + 1)).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            finals[(fused, overlap)] = (
                [local(p).detach().clone() for p in model.parameters()],
                [local(opt.state[p]["momentum_buffer"]).clone() for p in model.parameters() if "momentum_buffer" in opt.state[p]],
            )
            opt.close()
    base = finals[(False, False)]
    for key, (ps, ms) in finals.items():
        if not all(torch.equal(a, b) for a, b in zip(ps, base[0])) or not all(torch.equal(a, b) for a, b in zip(ms, base[1])):
            bad.append(f"{R}x{T} dtensor fused={key[0]} overlap={key[1]} differs from synchronous two-stage")
    return bad


@pytest.mark.timeout(200)
@pytest.mark.parametrize("R,T", [(1, 1), pytest.param(1, 2, marks=pytest.mark.slow), (2, 2)])
def test_overlap_on_off_equal(R, T):
    """Overlap on vs off after 5 steps, fused and two-stage: bitwise equal (plain model also to torch.optim.Muon)."""
    res = run_ranks(_on_off_plain, R * T, R, T, timeout=180)
    res += run_ranks(_on_off_dtensor, R * T, R, T, timeout=180)
    bad = [b for r in res for b in r]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# readiness order scrambled per rank
# ---------------------------------------------------------------------------------------------------------------
def _scrambled(rank, world, R, T):
    """Regression: ranks whose gradients become ready in different orders must still launch waves in one order
    (else the all_to_alls of different waves would pair up across ranks and hang or mix data)."""
    g, t = divmod(rank, T)
    fulls, mu = _reference_plain(4)
    net = PlainShardNet(R, T, g, t)
    seam = TestingSeam(timeline=[])
    opt = plain_opt(net, R, T, g, t, overlap=True, wave_slots=1, _testing=seam)
    rng = random.Random(rank * 7 + 1)
    for s in range(4):
        order = list(net.SHAPES)
        rng.shuffle(order)
        cs, _ = net.local_grads(s)
        net(cs, order=order).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    bad = _check_plain(net, opt, fulls, mu, R, T, g, t, f"scrambled rank {rank}")
    n = len(opt.waves)
    launched = [k for ev, k, _ in seam.timeline if ev == "launch"]
    if launched != list(range(n)) * 4:
        bad.append(f"rank {rank} launched waves in order {launched}")
    opt.close()
    return bad


@pytest.mark.timeout(120)
def test_scrambled_readiness_order():
    bad = [b for r in run_ranks(_scrambled, 4, 2, 2, timeout=100) for b in r]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# gradient accumulation, unused params
# ---------------------------------------------------------------------------------------------------------------
def _domain_ns(opt, before: int, world: int) -> int:
    """Matrices NS'd over the domain since this rank's count was ``before``."""
    n = torch.tensor([opt.stats["ns_matrices"] - before])
    if world > 1:
        dist.all_reduce(n)
    return int(n.item())


def _accumulate(rank, world, R, T):
    g, t = divmod(rank, T)
    fulls, mu = _reference_plain(2, micro=5)
    net = PlainShardNet(R, T, g, t)
    opt = plain_opt(net, R, T, g, t, overlap=True)
    bad = []
    for s in range(2):
        before = opt.stats["ns_matrices"]
        for m in range(4):
            with opt.no_sync():
                cs, _ = net.local_grads(s, m)
                net(cs).backward()
            if opt.stats["waves_launched"] != s * len(opt.waves):
                bad.append(f"rank {rank}: a wave launched inside no_sync (step {s}, micro {m})")
        cs, _ = net.local_grads(s, 4)
        net(cs).backward()
        opt.step()
        opt.synchronize()
        n = _domain_ns(opt, before, world)
        if n != len(net.SHAPES):
            bad.append(f"step {s}: {n} matrices NS'd, expected {len(net.SHAPES)}")
        opt.zero_grad()
    bad += _check_plain(net, opt, fulls, mu, R, T, g, t, f"accumulation rank {rank}")
    opt.close()
    return bad


def _learned(rank, world, R, T):
    """Accumulation without no_sync: 2 and 4 passes per step, and 4 with a shorter step (an epoch's tail); equal to
    torch after every step."""
    g, t = divmod(rank, T)
    bad = []
    for micro in ([2, 2, 2], [4, 4, 4], [4, 4, 2, 4]):
        net = PlainShardNet(R, T, g, t)
        opt = plain_opt(net, R, T, g, t, overlap=True)
        for s, n in enumerate(micro):
            before = opt.stats["ns_matrices"]
            for m in range(n):
                cs, _ = net.local_grads(s, m)
                net(cs).backward()
            opt.step()
            done = _domain_ns(opt, before, world)
            if s > 0 and done != len(net.SHAPES):
                bad.append(f"{micro} step {s}: {done} matrices NS'd, expected {len(net.SHAPES)}")
            opt.zero_grad()
            opt.synchronize()
            fulls, mu = _reference_plain(s + 1, micro=micro[:s + 1])
            bad += _check_plain(net, opt, fulls, mu, R, T, g, t, f"{micro} step {s} rank {rank}")
        if opt.stats["reruns"]:
            bad.append(f"{micro}: {opt.stats['reruns']} waves re-run")
        opt.close()
    return bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("R,T", [(1, 1), (1, 2)])
@pytest.mark.parametrize("body", [_accumulate, _learned], ids=["no_sync", "learned"])
def test_gradient_accumulation(body, R, T):
    """``no_sync``: 4 micro-batches under it + 1 outside == one step on the summed gradient, bitwise, NS once per
    matrix. Learned ([Note: learned accumulation]): no ``no_sync``, NS once per matrix per step from the second step
    on, bitwise."""
    bad = [b for r in run_ranks(body, R * T, R, T, timeout=130) for b in r]
    assert not bad, "\n".join(bad)


class _Reentrant(nn.Module):
    """``checkpoint(layer, x, use_reentrant=True)``: the layer's gradients come from a nested graph task."""

    def __init__(self, layer: nn.Module) -> None:
        super().__init__()
        self.layer = layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from torch.utils.checkpoint import checkpoint

        return checkpoint(self.layer, x if x.requires_grad else x.detach().requires_grad_(), use_reentrant=True)


def _fsdp2_accumulation(rank, world, reentrant=False):
    """FSDP2 adds each later micro-batch's reduced gradients into the views of one buffer per module ([Note: shared
    gradient buffers] in hooks/grad_ready.py): no wave re-runs, NS once per matrix per step from step 2, and the
    params equal torch's after every step (every rank the same batches: FSDP2's average is the batch's gradient).
    ``reentrant``: each sharded layer under a reentrant activation checkpoint."""
    import copy

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from tests.models import ADAMW_KW, full_mismatches, torch_ref_opts

    torch.manual_seed(0)
    full = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 12), nn.Tanh(), nn.Linear(12, 12))
    ref, model = copy.deepcopy(full), copy.deepcopy(full)
    wrap = (lambda m: nn.Sequential(*[_Reentrant(x) if i % 2 == 0 else x for i, x in enumerate(m)])) if reentrant \
        else (lambda m: m)
    ref_opts = torch_ref_opts(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("remat",))
    for layer in model[::2]:  # each a weight and a bias in one reduce-scatter buffer, each weight a wave
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, **HP)
    bad, mats = [], sum(1 for n, p in model.named_parameters() if p.ndim == 2)
    runs = ((wrap(model), [opt]), (wrap(ref), ref_opts))
    for s in range(3):
        before = opt.stats["ns_matrices"]
        for m, opts in runs:
            for k in range(2):
                m(torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * s + k))).pow(2).mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
        done = _domain_ns(opt, before, world)
        if s > 0 and done != mats:
            bad.append(f"step {s}: {done} matrices NS'd, expected {mats}")
        opt.synchronize()
        bad += [f"step {s}: {b}" for b in full_mismatches(model, ref)]
    if opt.stats["reruns"]:
        bad.append(f"{opt.stats['reruns']} waves re-ran: {dict(opt.stats)}")
    opt.close()
    return bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("reentrant", [False, True])
def test_fsdp2_accumulation_reruns_nothing(reentrant):
    """``reentrant``: bug, NS 3 times per step with ``extra_backward`` and ``reduce_scatter`` re-runs (the
    accumulation was never learned under reentrant checkpointing)."""
    bad = [b for r in run_ranks(_fsdp2_accumulation, 2, reentrant, timeout=130) for b in r]
    assert not bad, "\n".join(bad)


def _captured(rank, world):
    """Every hook fires while the (patched) capture probe says the stream is capturing: nothing launches in
    backward, step() launches it all, bitwise; one warning naming the fix."""
    import warnings

    fulls, mu = _reference_plain(3)
    net = PlainShardNet(1, 1, 0, 0)
    opt = plain_opt(net, 1, 1, 0, 0, overlap=True)
    capturing = [True]
    opt._rt.pipeline.lanes.capturing = lambda: capturing[0]  # [Note: CUDA graph capture] in overlap_muon/_wiring.py
    bad = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for s in range(3):
            cs, _ = net.local_grads(s)
            capturing[0] = True  # the forward and backward are captured, step() runs outside the graph
            net(cs).backward()
            capturing[0] = False
            if opt.stats["waves_launched"] != s * len(opt.waves):
                bad.append(f"step {s}: a wave launched during a captured backward")
            opt.step()
            opt.zero_grad()
    said = [str(w.message) for w in caught if "CUDA graph" in str(w.message)]
    if len(said) != 1 or "disable_cuda_graphs=True" not in said[0]:
        bad.append(f"warnings: {said}")
    bad += _check_plain(net, opt, fulls, mu, 1, 1, 0, 0, "captured")
    opt.close()
    return bad


@pytest.mark.timeout(100)
def test_captured_backward_launches_in_step():
    bad = run_ranks(_captured, 1, timeout=80)[0]
    assert not bad, "\n".join(bad)


def _auto(rank, world, R, T, prefer):
    """auto_overlap with this rank's trial medians patched (``prefer[rank]``: (on, off) seconds): bitwise torch at
    the end, the agreed choice (the largest of each over the ranks) kept, waves launched in backward iff it is on."""
    from overlap_muon._overlap_choice import OverlapChoice, TRIAL

    g, t = divmod(rank, T)
    steps = 2 * TRIAL + 5
    fulls, mu = _reference_plain(steps)
    net = PlainShardNet(R, T, g, t)
    opt = plain_opt(net, R, T, g, t, overlap=True, auto_overlap=True)
    real = OverlapChoice.medians
    OverlapChoice.medians = lambda self: None if real(self) is None else prefer[rank]
    modes = []
    try:
        for s in range(steps):
            cs, _ = net.local_grads(s)
            before = opt.stats["waves_launched"]
            net(cs).backward()
            modes.append(opt.stats["waves_launched"] > before)  # launched in backward: the overlap is on
            opt.step()
            opt.zero_grad()
    finally:
        OverlapChoice.medians = real
    bad = _check_plain(net, opt, fulls, mu, R, T, g, t, f"auto rank {rank}")
    on = max(p[0] for p in prefer) <= max(p[1] for p in prefer)
    want = [True] * (TRIAL + 1) + [False] * (TRIAL + 1) + [on] * 3
    if modes != want or opt.stats["overlap_auto_chose_on"] != on:
        bad.append(f"rank {rank}: modes {modes}, expected {want}; stats {dict(opt.stats)}")
    if not on and (opt._rt.wiring.tracker is not None or opt._rt.wiring.fixed[0]):
        bad.append(f"rank {rank}: off for good, but the hooks or the version fix stayed")
    opt.close()
    return bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("R,T,prefer", [(1, 1, [(2.0, 1.0)]), (1, 2, [(1.0, 2.0), (3.0, 1.5)]),
                                        (1, 2, [(1.0, 2.0), (1.5, 1.2)])], ids=["off", "off_agreed", "on_agreed"])
def test_auto_overlap_keeps_the_faster_agreed(R, T, prefer):
    """[Note: overlap where it pays]: TRIAL iterations on, TRIAL off, then the choice every rank agrees on."""
    bad = [b for r in run_ranks(_auto, R * T, R, T, prefer, timeout=130) for b in r]
    assert not bad, "\n".join(bad)


def _unused(rank, world, R, T):
    g, t = divmod(rank, T)

    def skip(s):
        return ("l5",) if s % 2 else ("l5", "l3")  # l5 never used; l3 used on odd steps only

    # l5 never receives a gradient: torch.optim.Muon leaves it untouched (no state); so must we.
    fulls, mu = _reference_plain(4, skip_fn=skip)
    net = PlainShardNet(R, T, g, t)
    l5_before = net.l5.weight.detach().clone()
    opt = plain_opt(net, R, T, g, t, overlap=True, wave_slots=1)
    for s in range(4):
        cs, _ = net.local_grads(s)
        net(cs, skip=skip(s)).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    bad = _check_plain(net, opt, fulls, mu, R, T, g, t, f"unused rank {rank}")
    if not torch.equal(net.l5.weight.detach(), l5_before):
        bad.append("the never-used param changed")
    opt.close()
    return bad


@pytest.mark.timeout(120)
@pytest.mark.parametrize("R,T", [(1, 1), (2, 1)])
def test_unused_and_sometimes_used_params(R, T):
    bad = [b for r in run_ranks(_unused, R * T, R, T, timeout=100) for b in r]
    assert not bad, "\n".join(bad)


# ---------------------------------------------------------------------------------------------------------------
# overlap really happens (order of timestamps, not durations)
# ---------------------------------------------------------------------------------------------------------------
def test_ns_starts_inside_backward_and_forward_waits_only_for_its_wave():
    torch.manual_seed(0)
    model = Deep()
    seam = TestingSeam(ns_delay_s=0.05)
    opt = OverlapMuon(model, overlap=True, async_step=True, wave_slots=1, _testing=seam, **HP)
    x = torch.randn(8, 16)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    seam.timeline = []
    # Make backward long enough (host-side) that wave 0's NS must start inside it.
    import time as _time

    class Slow(torch.autograd.Function):
        @staticmethod
        def forward(ctx, y):
            return y.clone()

        @staticmethod
        def backward(ctx, gy):
            _time.sleep(0.5)
            return gy

    y = model(x)
    loss = Slow.apply(model.layers[0](x)).sum() * 0 + y.sum()  # the slow node runs near the end of backward
    loss.backward()
    t_bwd_end = _time.perf_counter()
    opt.step()
    # first module of the next forward
    first_wave = next(w.index for w in opt.waves if 0 in w.params)
    seam.timeline.append(("forward_begin", -1, _time.perf_counter()))
    model(x)
    tl = list(seam.timeline)
    opt.close()
    ns0 = [ts for ev, k, ts in tl if ev == "ns_start" and k == 0]
    assert ns0 and ns0[0] < t_bwd_end, f"wave 0's NS did not start inside backward: {tl}"
    fwd = [ts for ev, k, ts in tl if ev == "forward_begin"][0]
    waits = [(ev, k) for ev, k, ts in tl if ev == "wait_begin" and ts >= fwd]
    assert waits[0] == ("wait_begin", first_wave), waits
    # layer 0's pre-hook waited only for its own wave (the last one launched)
    assert first_wave == len(opt.waves) - 1


# ---------------------------------------------------------------------------------------------------------------
# lane errors surface in the main thread
# ---------------------------------------------------------------------------------------------------------------
def test_lane_error_surfaces_with_traceback():
    torch.manual_seed(0)
    model = Deep(n=2)
    def boom(*a, **k):
        raise FloatingPointError("injected NS failure")

    opt = OverlapMuon(model, overlap=True, _testing=TestingSeam(ns_wrap=boom), **HP)
    model(torch.randn(2, 16)).sum().backward()
    with pytest.raises(RuntimeError, match="lane task failed") as ei:
        opt.step()  # surfaces here if the lane already failed, else at synchronize()
        opt.synchronize()
    assert isinstance(ei.value.__cause__, FloatingPointError)


# ---------------------------------------------------------------------------------------------------------------
# DDP: readiness from the comm hook (averaged gradients)
# ---------------------------------------------------------------------------------------------------------------
def _ddp(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    finals = []
    for overlap in (True, False):
        torch.manual_seed(0)
        net = Deep(n=4)
        ddp = DDP(net, gradient_as_bucket_view=True, bucket_cap_mb=0.001)
        opt = OverlapMuon(net, overlap=overlap, **HP)
        opt.attach_ddp(ddp)
        for s in range(3):
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * s + rank))
            ddp(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        finals.append([p.detach().clone() for p in net.parameters()])
        opt.close()
    return all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.timeout(120)
def test_ddp_comm_hook_readiness_matches_synchronous():
    """Waves launched from DDP's comm hook read the averaged gradients: equal to the synchronous path after DDP."""
    assert all(run_ranks(_ddp, 2, timeout=100))


def test_profiler_shows_every_wave_phase(tmp_path):
    """Each wave's phases appear as record_function ranges (lane threads need profile_all_threads on CPU)."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = Deep(n=3)
    opt = OverlapMuon(model, overlap=True, wave_slots=1, **HP)
    x = torch.randn(4, 16)
    cfg = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    with profile(activities=[ProfilerActivity.CPU], experimental_config=cfg) as prof:
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    names = {e.name for e in prof.events()}
    for k in range(len(opt.waves)):
        for phase in ("pack", "a2a_to_home", "ns", "a2a_from_home", "apply"):
            assert f"OverlapMuon::wave{k}::{phase}" in names, (k, phase)
    prof.export_chrome_trace(str(tmp_path / "trace.json"))
    opt.close()


def _observed(rank, world, R, T):
    g, t = divmod(rank, T)
    fulls, mu = _reference_plain(4)
    net = PlainShardNet(R, T, g, t)
    opt = plain_opt(net, R, T, g, t, overlap=True, wave_slots=2, readiness_order="observed")
    order = ["l3", "l0", "l5", "l1", "l4", "l2"]  # backward reaches them in the reverse of this order
    for s in range(4):
        cs, _ = net.local_grads(s)
        net(cs, order=order if rank == 0 else list(reversed(order))).backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    bad = _check_plain(net, opt, fulls, mu, R, T, g, t, f"observed rank {rank}")
    plan = [w.params for w in opt.waves]
    opt.close()
    return bad, plan


@pytest.mark.timeout(120)
def test_observed_readiness_order_is_rank0s_and_exact():
    """readiness_order="observed": rank 0's first-step order, broadcast, becomes every rank's wave plan."""
    res = run_ranks(_observed, 2, 1, 2, timeout=100)
    assert not [b for r in res for b in r[0]]
    assert res[0][1] == res[1][1]
    names = list(PlainShardNet.SHAPES)
    first = [names[i] for i in res[0][1][0]]
    assert first[0] == "l2"  # rank 0's backward reached l2 first (it was added last in its forward)


class _ReversedDeep(Deep):
    """Layers used in reverse registration order, so the default wave order (reverse registration) is not the
    backward order: the waves of later-used blocks can still be in flight when an earlier block prefetches."""

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return x


def _fsdp_prefetch(rank, world):
    """FSDP2 explicit forward prefetch all-gathers the next block inside this block's pre-forward, before the
    next block's own wait hook runs: the runtime must wait for the prefetched block's waves there too."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    finals = []
    for overlap in (True, False):
        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("remat",))
        model = _ReversedDeep(n=4)
        order = list(reversed(model.layers))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        for a, b in zip(order, order[1:]):
            a.set_modules_to_forward_prefetch([b])
        opt = OverlapMuon(model, device_mesh=mesh, overlap=overlap, wave_slots=1, _testing=TestingSeam(ns_delay_s=0.02), **HP)
        x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
        for _ in range(3):
            model(x).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        finals.append([p.full_tensor().clone() for p in model.parameters()])
        opt.close()
    return all(torch.equal(a, b) for a, b in zip(*finals))


@pytest.mark.timeout(120)
def test_fsdp_forward_prefetch_waits_for_prefetched_waves():
    assert all(run_ranks(_fsdp_prefetch, 2, timeout=100))


def _split_presence(rank, world, overlap):
    """Regression: a param with a gradient on rank 1 only used to leave rank 1 in its all_to_all until the
    process-group timeout while rank 0 reported success (and, without overlap, replicas silently diverged)."""
    net = PlainShardNet(1, world, 0, rank)
    opt = plain_opt(net, 1, world, 0, rank, overlap=overlap, wave_slots=6)
    cs, _ = net.local_grads(0)
    skip = ("l2",) if rank == 0 else ()
    try:
        net(cs, skip=skip).backward()
        opt.step()
        opt.synchronize()
    except (ValueError, RuntimeError) as e:
        msg = str(e) + " " + str(e.__cause__ or "")
        ok = "'l2.weight'" in msg and "some ranks" in msg
    else:
        ok = False
    t = torch.ones(1)
    dist.all_reduce(t)  # the default group still works
    return ok and t.item() == world


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [True, False])
def test_gradient_on_some_ranks_only_is_an_error_everywhere(overlap):
    assert all(run_ranks(_split_presence, 2, overlap, timeout=60, pg_timeout=30))


def test_second_backward_before_step_counts_like_torch():
    """Regression: a second backward before step() in overlap mode used to be ignored by Muon (its wave had
    already launched with the first micro-batch's gradient) while AdamW saw the sum; then it raised. Now the
    speculative waves of the first backward are dropped and step() uses the summed gradient, as torch does."""
    torch.manual_seed(0)
    model = Deep(n=2)
    ref = Deep(n=2)
    ref.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, overlap=True, **HP)
    mu = torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], **HP)
    x = torch.randn(2, 16)
    for m in (model, ref):
        m(x).sum().backward()
        m(x).sum().backward()
    opt.step()
    mu.step()
    opt.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()) if a.ndim == 2)
    opt.close()


def test_cost_planned_waves_batch_and_stay_exact():
    """``wave_plan="cost"`` (``scheduler.plan_waves_by_cost``): at world 1 same-shape matrices share waves, so
    fewer waves run, and the result is still ``torch.optim.Muon``'s; with ``batch_ns`` they make fewer NS calls
    (batched NS is not claimed bitwise, see the README's BATCH_NS row, so that run is not compared)."""
    results = {}
    for plan in ("count", "cost"):
        torch.manual_seed(0)
        model = Deep(n=8, d=32)
        ref = Deep(n=8, d=32)
        ref.load_state_dict(model.state_dict())
        opt = OverlapMuon(model, wave_plan=plan, **HP)
        mu = torch.optim.Muon(ref.parameters(), **HP)
        x = torch.randn(4, 32)
        for _ in range(3):
            for m, o in ((model, opt), (ref, mu)):
                m(x).sum().backward()
                o.step()
                o.zero_grad()
        opt.synchronize()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
        results[plan] = len(opt.waves)
        opt.close()
        batched = OverlapMuon(Deep(n=8, d=32), wave_plan=plan, batch_ns=True, **HP)
        results[plan, "calls"] = sum(len({m.full_shape for m in batched._muon if m.index in w.params})
                                     for w in batched.waves)
        batched.close()
    assert results["cost"] < results["count"], results
    assert results["cost", "calls"] < results["count", "calls"], results


def test_step_inside_a_capture_is_refused_and_changes_nothing():
    """Issue 46, finding 4: ``step()`` inside a CUDA graph capture (probe patched) raises a clear error before
    anything changes (no event query, no collective, no state): params, state and gradients stay as they were,
    and the same step outside the capture then gives torch's result."""
    torch.manual_seed(0)
    model, ref = Deep(), Deep()
    ref.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, overlap=True, auto_overlap=False, **HP)
    mu = torch.optim.Muon(ref.parameters(), **HP)
    capturing = [False]
    opt._rt.pipeline.lanes.capturing = lambda: capturing[0]
    x = torch.randn(8, 16)
    for m in (model, ref):
        m(x).pow(2).mean().backward()
    before = [p.detach().clone() for p in model.parameters()]
    capturing[0] = True
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        opt.step()
    capturing[0] = False
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters())) and not opt.state
    opt.step()
    mu.step()
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
    opt.close()


def test_async_step_forward_inside_a_capture_is_refused():
    """Issue 46, finding 4: with ``async_step``, a forward captured in a CUDA graph (probe patched) cannot wait for
    the step's updates: its first forward pre-hook raises a clear error naming the default step as the fix."""
    torch.manual_seed(0)
    model = Deep()
    opt = OverlapMuon(model, overlap=True, async_step=True, **HP)
    x = torch.randn(8, 16)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    opt._rt.pipeline.lanes.capturing = lambda: True
    with pytest.raises(RuntimeError, match="async_step=False"):
        model(x)
    opt._rt.pipeline.lanes.capturing = lambda: False
    opt.synchronize()
    opt.close()


def _posted_checks(rank, world, split):
    """Issue 46, finding 3, driven on CPU: the presence checks posted without blocking (the CUDA launch's way,
    ``PostedChecks.post``): no grad hook runs a blocking check, the result is bitwise the blocking one's, and
    a gradient on one rank only is still a ValueError on every rank at ``step()``. As under NCCL, the checks get a
    gloo group of their own (a gloo job's control group is the exchange's group, where posting is off)."""
    import dataclasses
    from overlap_muon._agreement import Agreement

    blocking = Agreement.check_wave
    Agreement.check_wave = lambda self, st, dom: (_ for _ in ()).throw(AssertionError("a blocking check ran"))
    try:
        finals = []
        for post in (True, False):
            net = PlainShardNet(1, world, 0, rank)
            opt = plain_opt(net, 1, world, 0, rank, overlap=True, wave_slots=2, auto_overlap=False)
            pipe = opt._pipeline
            assert pipe.checks.post == [False, False]  # CPU: a gloo job
            (to, back), own = pipe._doms[0], dist.new_group(list(range(world)), backend="gloo")
            pipe._doms[0] = (dataclasses.replace(to, ctrl_group=own), back)
            pipe.checks.post = [post, post]
            posted, add = [], pipe.checks.add
            pipe.checks.add = lambda *a: (posted.append(1), add(*a))
            if not post:
                Agreement.check_wave = blocking
            for s in range(2 if not split else 1):
                cs, _ = net.local_grads(s)
                net(cs, skip=("l2",) if split and rank == 0 else ()).backward()
                try:
                    opt.step()
                except ValueError as e:
                    opt.close()
                    return bool(posted) and "'l2.weight'" in str(e) and "some ranks" in str(e)
                opt.zero_grad()
            if bool(posted) != post:
                return False
            opt.synchronize()
            finals.append([p.detach().clone() for p in net.parameters()])
            opt.close()
        return not split and all(torch.equal(a, b) for a, b in zip(*finals))
    finally:
        Agreement.check_wave = blocking


@pytest.mark.timeout(120)
@pytest.mark.parametrize("split", [False, True], ids=["bitwise", "split_presence"])
def test_posted_presence_checks(split):
    assert all(run_ranks(_posted_checks, 2, split, timeout=90, pg_timeout=30))
