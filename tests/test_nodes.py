"""Scale: node-aware exchanges ([Note: node-aware exchange] in overlap_muon/_domain.py), homes that know nodes and the
warm-up of every group at construction ([Note: warm-up] in overlap_muon/_comm.py), at world 4 as 2 nodes of 2."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from overlap_muon._comm import domain_from_layouts, node_spans
from overlap_muon.layer_sharded_a2a import from_homes, local_shard, to_homes
from tests.dist_utils import run_ranks
from tests.test_routing import SPECS, _Count, _full


def test_node_spans():
    assert node_spans([0, 1, 2, 3], 2) == (2, 2)
    assert node_spans([0, 1, 2, 3], 4) is None  # one node
    assert node_spans([0, 1, 2, 3], 1) == (1, 4)
    assert node_spans([1, 2, 3, 4], 2) is None  # 1 + 2 + 1 ranks per node: uneven
    assert node_spans([0, 2, 4, 6], 2) == (1, 4)


def peers(route, hops, me: int) -> int:
    """Ranks this rank sends to or receives from in a fused ``route`` (not itself): flat (``hops`` None) or in the
    two hops of ``hops`` (``layer_sharded_a2a._nodes.TwoHops``)."""
    if hops is None:
        return sum(1 for d, (a, b) in enumerate(zip(route.send_splits, route.recv_splits)) if d != me and (a or b))
    node, mine = divmod(me, hops.groups.ranks_per_node)
    one = sum(1 for l, (a, b) in enumerate(zip(hops.hop1_send, hops.hop1_recv)) if l != mine and (a or b))
    return one + sum(1 for n, (a, b) in enumerate(zip(hops.hop2_send, hops.hop2_recv)) if n != node and (a or b))


def _routing_body(rank, world):
    out = []
    shapes, pds = [(P, Q) for P, Q, _ in SPECS], [pd for *_, pd in SPECS]
    for (R, T), node_size in (((2, 2), 2), ((1, 4), 2), ((4, 1), 2), ((2, 2), 1)):
        layout = [[[g * T + t for t in range(T)] for g in range(R)]]
        flat, hopped = domain_from_layouts(layout), domain_from_layouts(layout, node_size=node_size)
        assert flat.nodes is None and hopped.nodes is not None
        n = len(SPECS)
        # Single homes (uneven, and all on one rank), then two homes per matrix, each serving half the ranks
        # (surplus="duplicate"'s fused exchange).
        for homes, copies, serve in (([(2 * i + 1) % 3 for i in range(n)], 1, None), ([3] * n, 1, None),
                                     ([(i + k) % 4 for i in range(n) for k in range(2)], 2,
                                      [frozenset(r for r in range(4) if r % 2 == k) for _ in range(n) for k in
                                       range(2)])):
            fulls = [_full(i, s, torch.bfloat16) for i, s in enumerate(shapes) for _ in range(copies)]
            cpds = [pd for pd in pds for _ in range(copies)]
            cshapes = [s for s in shapes for _ in range(copies)]
            shards = [local_shard(f, pd, flat) for f, pd in zip(fulls, cpds)]
            got, counts = {}, {}
            for name, dom in (("flat", flat), ("nodes", hopped)):
                plan, kept_to, kept_from = {}, {}, {}
                for _ in range(2):  # the second call replays the route, in the buffers the first one reserved
                    with _Count() as c:
                        mats, idx = to_homes(shards, homes, cpds, cshapes, dom, fused=True, plan=plan, buffers=kept_to)
                        back = from_homes([m * 3 for m in mats], idx, shards, homes, cpds, cshapes, dom, fused=True,
                                          plan=plan, serve=serve, buffers=kept_from)
                    got[name] = [m.clone() for m in mats] + [b.clone() for b in back]
                counts[name] = c.a2a
                if name == "nodes":
                    hops = plan["nodes_to"][1]
                    p = (peers(plan["fused_to"], None, dom.flat_rank), peers(plan["fused_to"], hops, dom.flat_rank))
            assert len(got["flat"]) == len(got["nodes"])
            assert all(torch.equal(a, b) for a, b in zip(got["flat"], got["nodes"])), (R, T, node_size, copies)
            L = hopped.nodes.ranks_per_node
            assert counts == {"flat": 2, "nodes": 4 if L > 1 else 2}, counts
            out.append((R, T, node_size, p))
    return out


def _world4_body(rank, world):
    """One spawn for the tests of this file at world 4: routing, training in every configuration, warm-up counts."""
    train = {kind: {(overlap, ex): _train(rank, kind, overlap, ex) for overlap in (False, True)
                    for ex in ("off", "on")} for kind in ("plain", "fsdp_tp")}
    return {"routing": _routing_body(rank, world), "train": train,
            "warm": [_warm(rank, warm) for warm in (True, False)], "mixed": _mixed_node_sizes(rank)}


def _mixed_node_sizes(rank):
    """Nodes of different sizes as each rank sees them (LOCAL_WORLD_SIZE 2 on ranks 0-1, 4 on ranks 2-3): the
    first pair alone would build two-hop groups, which the others would never join. Every rank must run flat."""
    import os
    import warnings

    from tests.models import PlainShardNet, plain_opt

    os.environ["LOCAL_WORLD_SIZE"] = "2" if rank < 2 else "4"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            net = PlainShardNet(2, 2, rank // 2, rank % 2)
            opt = plain_opt(net, 2, 2, rank // 2, rank % 2, overlap=True)
        cs, _ = net.local_grads(0)
        net(cs).backward()
        opt.step()
        nodes = opt.domain.nodes
        opt.close()
    finally:
        del os.environ["LOCAL_WORLD_SIZE"]
    return nodes, [str(w.message) for w in caught if "node sizes differ" in str(w.message)]


@pytest.fixture(scope="module")
def world4():
    """Every rank's results of :func:`_world4_body` at world 4 (2 nodes of 2)."""
    return run_ranks(_world4_body, 4, timeout=240)


@pytest.mark.timeout(300)
def test_node_aware_routing_is_the_fused_routing(world4):
    """Two hops over 2 nodes of 2 (and 4 nodes of 1): the same homes' matrices and the same blocks back, bit for
    bit, with two collectives per direction (one with a rank per node), on each grid, replayed or not, with one
    home per matrix or two (each serving half the ranks)."""
    for rows in (r["routing"] for r in world4):
        for R, T, node_size, (flat_peers, node_peers) in rows:
            L, N = (2, 2) if node_size == 2 else (1, 4)
            assert node_peers <= (L - 1) + (N - 1) and flat_peers <= 3, (R, T, node_size, flat_peers, node_peers)


def _train(rank, kind, overlap, node_exchange):
    from overlap_muon import OverlapMuon
    from tests.models import ADAMW_KW, HP, PlainShardNet, TinyNet, build_dtensor_model, plain_opt

    if kind == "plain":
        net = PlainShardNet(2, 2, rank // 2, rank % 2)
        opt = plain_opt(net, 2, 2, rank // 2, rank % 2, overlap=overlap, node_exchange=node_exchange, node_size=2)
        batch = lambda s: (net.local_grads(s)[0],)  # noqa: E731
        loss = lambda out: out  # noqa: E731
    else:  # DTensor: TP plan + FSDP2 on a (2, 2) mesh, a real forward and backward
        torch.manual_seed(0)
        net, mesh = build_dtensor_model(TinyNet(), 2, 2)
        opt = OverlapMuon(net, adamw_kwargs=ADAMW_KW, device_mesh=mesh, overlap=overlap,
                          node_exchange=node_exchange, node_size=2, **HP)
        batch = lambda s: (torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * s + rank // 2)),)  # noqa
        loss = lambda out: out.pow(2).mean()  # noqa: E731
    snaps = []
    for s in range(3):
        loss(net(*batch(s))).backward()
        opt.step()
        opt.zero_grad()
        snaps.append([(p.full_tensor() if hasattr(p, "full_tensor") else p.detach()).clone() for p in net.parameters()])
    nodes = opt.domain.nodes
    opt.close()
    return snaps, None if nodes is None else (nodes.ranks_per_node, nodes.nodes)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["plain", "fsdp_tp"])
def test_node_aware_training_is_bitwise_the_fused(kind, world4):
    """Plain shards (2 x 2) and DTensor FSDP x TP, sync and overlap: node_exchange="on" over 2 nodes of 2 trains
    exactly what the flat fused exchange does, after every step."""
    for rank_results in world4:
        runs = rank_results["train"][kind]
        ref = runs[False, "off"][0]
        for (overlap, ex), (snaps, nodes) in runs.items():
            assert nodes == (None if ex == "off" else (2, 2)), (overlap, ex, nodes)
            assert all(torch.equal(a, b) for sa, sb in zip(snaps, ref) for a, b in zip(sa, sb)), (overlap, ex)


def _warm(rank, warm):
    import overlap_muon._binding as binding
    from tests.models import PlainShardNet, plain_opt

    calls = []
    real = binding.warm_up
    binding.warm_up = lambda *a: calls.append(real(*a)) or calls[-1]
    try:
        net = PlainShardNet(2, 2, rank // 2, rank % 2)
        opt = plain_opt(net, 2, 2, rank // 2, rank % 2, overlap=True, node_exchange="on", node_size=2, warm_up=warm)
        built = (list(calls), opt.stats["warm_up_collectives"])
        for s in range(2):
            cs, _ = net.local_grads(s)
            net(cs).backward()
            opt.step()
            opt.zero_grad()
        after = (list(calls), opt.stats["warm_up_collectives"])
        opt.close()
    finally:
        binding.warm_up = real
    return built, after


def _warm_fails_body(rank, world):
    from tests.models import PlainShardNet, plain_opt

    real = dist.all_to_all_single

    def broken(out, inp, *a, group=None, **kw):
        if dist.get_world_size(group) == 2 and dist.get_process_group_ranks(group) == [0, 2]:
            raise RuntimeError("connection refused")
        return real(out, inp, *a, group=group, **kw)

    dist.all_to_all_single = broken
    try:
        net = PlainShardNet(2, 2, rank // 2, rank % 2)
        plain_opt(net, 2, 2, rank // 2, rank % 2, overlap=True, node_exchange="on", node_size=2)
    except RuntimeError as e:
        return str(e)
    finally:
        dist.all_to_all_single = real
    return None


@pytest.mark.timeout(300)
def test_nodes_of_different_sizes_run_flat_on_every_rank(world4):
    """Each rank reads its own LOCAL_WORLD_SIZE: where they differ, the ranks agree to run flat (no rank builds
    groups the others skip, which would hang), and rank 0 says why, once."""
    for rank, (nodes, said) in enumerate(r["mixed"] for r in world4):
        assert nodes is None and len(said) == (rank == 0) and "['2', '4']" in "".join(said or ["['2', '4']"]), said


@pytest.mark.timeout(300)
def test_warm_up_runs_every_group_once_at_construction(world4):
    """[Note: warm-up]: at world 4 (2 x 2, two nodes) every group of the runtime runs its collectives once at
    construction, and only the kinds it will run: per lane the flat group's all_gather (with node hops its
    all_to_all is not used; fused, the remat and TP groups carry nothing), the node and across-nodes groups'
    all_to_all, the gather lane's control group's all_to_all (under gloo, its flat group), plus the step's agreement
    group: 8 collectives, none after. Off: none. A failing group is named with its ranks."""
    for (built, after), (built_off, after_off) in (r["warm"] for r in world4):
        assert built == ([8], 8) and after == built, (built, after)
        assert built_off == ([], 0) and after_off == built_off, (built_off, after_off)
    msgs = run_ranks(_warm_fails_body, 4, timeout=120)
    for rank, msg in enumerate(msgs):
        if rank in (0, 2):
            assert msg and "warm-up: all_to_all" in msg and "global ranks [0, 2]" in msg and "refused" in msg, msg


# ----------------------------------------------------------------------------------------------------------------
# What tests/gpu_check.py runs on one GPU (and, on CPU, the suite through its smoke run): one GPU cannot show nodes.
# ----------------------------------------------------------------------------------------------------------------


def _one_rank_warm_up(rank, device, backend):
    """Warm-up over ``backend`` (NCCL on a GPU) of rank 0's own groups, a size-1 group per role (collective:
    every rank makes them; rank 0 runs the warm-up)."""
    import time

    from overlap_muon._comm import CommContext, warm_up
    from overlap_muon._domain import Domain

    g = [dist.new_group([0], backend=backend) for _ in range(4)]
    if rank != 0:
        return None
    dom = Domain(1, 1, 0, 0, remat_group=g[0], tp_group=g[1], flat_group=g[2])
    t0 = time.perf_counter()
    n = warm_up(CommContext(dom, dom, None, g[3], None, None), device, fused=False)  # every kind
    if device.type == "cuda":
        torch.cuda.synchronize()
    return {"collectives": n, "seconds": round(time.perf_counter() - t0, 3), "backend": dist.get_backend(g[0])}


def scale_on_one_device(rank, world, device):
    """What one GPU can check of scale (``tests/gpu_check.py``), on two gloo ranks sharing ``device``: the
    warm-up of rank 0's NCCL groups (gloo on CPU), and the two-hop exchange as 2 nodes of 1."""
    dev = torch.device(device)
    warm = _one_rank_warm_up(rank, dev, "nccl" if dev.type == "cuda" else "gloo")
    return {"warm_up": warm, "node_exchange": two_nodes_of_one(rank, world, dev)}


def two_nodes_of_one(rank, world, dev):
    """Two ranks (on one GPU: sharing it over gloo) as 2 nodes of 1: the two-hop exchange of bf16 shards on
    ``dev`` against the fused one, bit for bit, with the peers of each."""
    layout = [[[0], [1]]]
    flat, hopped = domain_from_layouts(layout), domain_from_layouts(layout, node_size=1)
    shapes, pds = [(P, Q) for P, Q, _ in SPECS], [pd for *_, pd in SPECS]
    homes = [i % 2 for i in range(len(SPECS))]
    fulls = [_full(i, s, torch.bfloat16).to(dev) for i, s in enumerate(shapes)]
    shards = [local_shard(f, pd, flat) for f, pd in zip(fulls, pds)]
    got, plans = {}, {}
    for name, dom in (("flat", flat), ("nodes", hopped)):
        plans[name] = plan = {}
        mats, idx = to_homes(shards, homes, pds, shapes, dom, fused=True, plan=plan)
        back = from_homes([m * 3 for m in mats], idx, shards, homes, pds, shapes, dom, fused=True, plan=plan)
        got[name] = [m.cpu() for m in mats + back]
    same = len(got["flat"]) == len(got["nodes"]) and all(torch.equal(a, b) for a, b in zip(got["flat"], got["nodes"]))
    hops = plans["nodes"]["nodes_to"][1]
    return {"bitwise": same, "device": str(dev), "peers": (peers(plans["flat"]["fused_to"], None, rank),
                                                           peers(plans["nodes"]["fused_to"], hops, rank))}
