"""CUDA-only checks: side streams and events with real kernels, ranks sharing one GPU over gloo, NCCL.

Skipped without a GPU. ``tests/gpu_check.sh`` runs this file (and a short benchmark) on a GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.conftest import requires_cuda
from tests.dist_utils import run_ranks
from tests.models import HP, PlainShardNet, block
from tests.models import Deep as _Deep

pytestmark = [pytest.mark.cuda, requires_cuda]


def _train(overlap, side_streams=True, batch_ns=False, steps=4, **kw):
    torch.manual_seed(0)
    model = _Deep(d=256).cuda()
    ref = _Deep(d=256).cuda()
    ref.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, overlap=overlap, side_streams=side_streams, batch_ns=batch_ns, **HP, **kw)
    mu = torch.optim.Muon(ref.parameters(), **HP)
    x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for _ in range(steps):
        model(x).sum().backward()
        ref(x).sum().backward()
        opt.step()
        mu.step()
        opt.zero_grad()
        mu.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    out = [p.detach().clone() for p in model.parameters()], [p.detach().clone() for p in ref.parameters()]
    opt.close()
    return out


def test_side_streams_bitwise_equal_torch_muon():
    """Lanes on side streams + events (waves applied while the next forward runs): equal to torch.optim.Muon."""
    ours, ref = _train(overlap=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))
    ours_sync, _ = _train(overlap=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, ours_sync))


def test_inline_lanes_bitwise_equal_torch_muon():
    """Side streams off (every lane task inline on the launching thread and stream): still torch.optim.Muon."""
    ours, ref = _train(overlap=True, side_streams=False)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_backward_captured_in_a_cuda_graph_launches_in_step():
    """[Note: CUDA graph capture] in overlap_muon/_wiring.py: forward + backward captured in a CUDA graph (as
    torchtitan does by default) and replayed; the hooks launch nothing during capture and nothing runs them on
    replay, so step() launches every wave: bitwise torch.optim.Muon, one warning."""
    torch.manual_seed(0)
    model, ref = _Deep(d=256).cuda(), _Deep(d=256).cuda()
    ref.load_state_dict(model.state_dict())
    opt = OverlapMuon(model, **HP)
    mu = torch.optim.Muon(ref.parameters(), **HP)
    x = torch.randn(64, 256, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph asks
        for _ in range(2):
            model(x).sum().backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=True)
    graph = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="disable_cuda_graphs=True"):
        with torch.cuda.graph(graph):
            model(x).sum().backward()
    launched = opt.stats["waves_launched"]
    for _ in range(3):
        graph.replay()
        opt.step()
        ref(x).sum().backward()
        mu.step()
        mu.zero_grad()
    opt.synchronize()
    assert opt.stats["waves_launched"] == launched + 3 * len(opt.waves)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    opt.close()


def test_auto_overlap_decides_on_cuda_events_and_stays_exact():
    """[Note: overlap where it pays]: the trial times with CUDA events (no host sync), decides after 12 steps, and
    every step stays torch.optim.Muon."""
    ours, ref = _train(overlap=True, steps=16, auto_overlap=True)
    assert all(torch.equal(a, b) for a, b in zip(ours, ref))


def test_batched_ns_on_gpu_matches_overlap_off():
    """Batched NS: on vs off equal (batched cuBLAS may differ from per-matrix calls; compared among themselves)."""
    a, _ = _train(overlap=True, batch_ns=True)
    b, _ = _train(overlap=False, batch_ns=True)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def _shared_gpu(rank, world, backend):
    R, T = 1, world
    g, t = 0, rank
    net = PlainShardNet(R, T, g, t).cuda()
    for n, (shape, pd) in net.SHAPES.items():
        w = getattr(net, n).weight
        w.partition_dim, w.full_shape = pd, shape
    opt = OverlapMuon(net, tp_group=dist.group.WORLD if world > 1 else None, muon_filter=lambda n, p: p.ndim == 2,
                      overlap=True, batch_ns=False, **HP)
    ref = {n: nn.Parameter(net.full[n].clone().cuda()) for n in net.SHAPES}
    mu = torch.optim.Muon(list(ref.values()), **HP)
    for s in range(3):
        cs, fulls = net.local_grads(s)
        net({k: v.cuda() for k, v in cs.items()}).backward()
        for n, p in ref.items():
            p.grad = fulls[n].cuda()
        opt.step()
        mu.step()
        opt.zero_grad()
    opt.synchronize()
    ok = all(torch.equal(getattr(net, n).weight.detach(), block(ref[n].detach(), pd, R, T, g, t))
             for n, (_, pd) in net.SHAPES.items())
    opt.close()
    return ok


def test_two_ranks_share_one_gpu_over_gloo():
    assert all(run_ranks(_shared_gpu, 2, "gloo", timeout=120))


def test_one_rank_over_nccl():
    assert all(run_ranks(_shared_gpu, 1, "nccl", timeout=120, backend="nccl"))


# ---------------------------------------------------------------------------------------------------------------
# FSDP2 on one GPU: no host sync in the overlapped step; FSDP2's all-gather streams wait for the update
# ---------------------------------------------------------------------------------------------------------------
class _TwoBlocks(nn.Module):
    def __init__(self, d: int = 512) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(),
                                                   nn.Linear(4 * d, d, bias=False)) for _ in range(2)])

    def forward(self, x):
        for b in self.blocks:
            x = x + b(x)
        return x


def _fsdp_model(d: int = 512):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = _TwoBlocks(d).cuda()
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("remat",))
    for b in model.blocks:
        fully_shard(b, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _fsdp_no_sync(rank, world):
    model, mesh = _fsdp_model()
    # content_check=False: the check reads one flag per step on the host by design ([Note: content fingerprints]
    # in overlap_muon/_wave_state.py); the rest of backward and step() must not sync.
    opt = OverlapMuon(model, device_mesh=mesh, content_check=False, **HP)
    x = torch.randn(32, 512, device="cuda")
    model(x).sum().backward()  # warm-up: FSDP2 lazy init, allocator, cuBLAS handles
    opt.step()
    opt.zero_grad()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    opt.synchronize()
    opt.close()
    return True


def test_fsdp2_overlap_step_has_no_host_sync():
    """Backward (grad hooks, wave launches, the presence agreement) and step() never wait for the device (but for
    the content check's one flag a step, off here: ``tests/gpu_sections.py``'s ``sync_debug`` counts it)."""
    assert all(run_ranks(_fsdp_no_sync, 1, timeout=180, backend="nccl"))


def _fsdp_race(rank, world, patch_streams):
    import overlap_muon._hooks.forward_wait as fw
    import overlap_muon._forward_waits as om
    
    if patch_streams:  # the defect: only the current stream waits, FSDP2's copy-in stream does not
        om.fsdp_param_streams = lambda module: []
    outs = []
    for overlap in (True, False):
        model, mesh = _fsdp_model()
        seam = TestingSeam(before_apply=lambda st: torch.cuda._sleep(200_000_000))  # ~0.1 s on the lane
        opt = OverlapMuon(model, device_mesh=mesh, overlap=overlap, async_step=True, _testing=seam, **HP)
        x = torch.randn(32, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
        for _ in range(2):
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        outs.append(model(x).detach().clone())  # reads the update through FSDP2's all-gather
        opt.synchronize()
        opt.close()
    om.fsdp_param_streams = fw.fsdp_param_streams
    return torch.equal(outs[0], outs[1])


def test_fsdp2_all_gather_waits_for_the_update():
    """``async_step``: a slow apply (``torch.cuda._sleep`` on its lane) must still land before FSDP2 all-gathers the
    shard: the forward after an overlapped step equals the synchronous one. (That the check fails without the fix
    needs FSDP2 over two ranks, which never all-gathers over one: ``tests/gpu_multi.py`` shows it at world 2.)"""
    assert all(run_ranks(_fsdp_race, 1, False, timeout=180, backend="nccl"))


def _fsdp_barrier(rank, world):
    """The default step on FSDP2: a slow apply (``torch.cuda._sleep`` on its lane) still lands before the next
    forward's all-gather, with no host sync in ``step()``; an AdamW step after it writes the same shards; FSDP2's
    ``set_post_optim_event`` is never called (it would order the all-gathers after ``step()``'s end only, not after
    the second optimizer's writes: issue 46, finding 1)."""
    from torch.distributed.fsdp import FSDPModule

    events = []
    original = FSDPModule.set_post_optim_event
    FSDPModule.set_post_optim_event = lambda self, event: (events.append(event), original(self, event))[1]
    outs = []
    try:
        for overlap in (True, False):
            model, mesh = _fsdp_model()
            seam = TestingSeam(before_apply=lambda st: torch.cuda._sleep(200_000_000))  # ~0.1 s on the lane
            opt = OverlapMuon(model, device_mesh=mesh, overlap=overlap, content_check=False, _testing=seam, **HP)
            second = torch.optim.AdamW(model.parameters(), lr=1e-3)  # writes every param after OverlapMuon.step()
            x = torch.randn(32, 512, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
            model(x).sum().backward()  # warm-up: FSDP2 lazy init
            opt.step()
            second.step()
            opt.zero_grad()
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error" if overlap else "default")
            try:
                model(x).sum().backward()
                opt.step()
                second.step()
                opt.zero_grad()
                outs.append(model(x).detach().clone())  # reads both updates through FSDP2's all-gather
            finally:
                torch.cuda.set_sync_debug_mode("default")
            opt.synchronize()
            opt.close()
    finally:
        FSDPModule.set_post_optim_event = original
    return torch.equal(outs[0], outs[1]), len(events)


def test_fsdp2_default_step_orders_updates_through_the_current_stream():
    """[Note: the step barrier] on CUDA: the current stream waits on the apply events (no host sync), FSDP2's own
    pre-forward wait on the current stream orders the all-gathers after them and after a second optimizer's
    writes, and ``set_post_optim_event`` is never called; the forward after the step equals the synchronous one.
    (At world 1 FSDP2 never all-gathers on its streams, so only the spy can fail here: tests/gpu_check.sh's
    multi-GPU script runs world 2.)"""
    ((same, events),) = run_ranks(_fsdp_barrier, 1, timeout=180, backend="nccl")
    assert same and events == 0


class _Grouped(nn.Module):
    """Two grouped expert weights (E, P, Q) used by a forward (every expert sees every token)."""

    def __init__(self, e: int = 4, d: int = 128, h: int = 192) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(e, h, d) / d**0.5)
        self.w_out = nn.Parameter(torch.randn(e, d, h) / h**0.5)

    def forward(self, x):
        return sum(torch.nn.functional.gelu(x @ self.w_in[e].T) @ self.w_out[e].T for e in range(self.w_in.shape[0]))


def test_grouped_experts_on_side_streams_bitwise_equal_torch_muon():
    """Grouped (E, P, Q) expert weights (``experts=``) with overlap on side streams: equal to torch.optim.Muon on
    every expert matrix as its own param."""
    torch.manual_seed(0)
    model = _Grouped().cuda()
    opt = OverlapMuon(model, experts=["w_in", "w_out"], **HP)
    ref = [nn.Parameter(p.detach()[e].clone()) for p in model.parameters() for e in range(p.shape[0])]
    mu = torch.optim.Muon(ref, **HP)
    x = torch.randn(64, 128, device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    for _ in range(3):
        model(x).square().mean().backward()
        for k, (p, e) in enumerate((p, e) for p in model.parameters() for e in range(p.shape[0])):
            ref[k].grad = p.grad[e].clone()
        opt.step()
        mu.step()
        opt.zero_grad()
    opt.synchronize()
    torch.cuda.synchronize()
    got = [p.detach()[e] for p in model.parameters() for e in range(p.shape[0])]
    assert all(torch.equal(a, b.detach()) for a, b in zip(got, ref))
    opt.close()
