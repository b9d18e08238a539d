import time, torch, torch.distributed as dist
from tests.dist_utils import run_ranks
def body(rank, world, policy):
    torch.set_num_threads(1)
    from overlap_muon import OverlapMuon
    from overlap_muon.bench import block_of
    X = torch.randn(2048, 8192, generator=torch.Generator().manual_seed(17))
    group = dist.new_group([0, 1])
    net = torch.nn.Module()
    net.w = torch.nn.Parameter(block_of(X, rank, world).clone())
    net.w.partition_dim, net.w.full_shape = 0, tuple(X.shape)
    opt = OverlapMuon(net, muon_filter=lambda n, p: True, tp_group=group, overlap=False, surplus=policy)
    ts = []
    for r in range(3):
        net.w.grad = block_of(torch.randn(X.shape, generator=torch.Generator().manual_seed(100 + r)), rank, world)
        dist.barrier(); t = time.perf_counter()
        if r == 2:
            with torch.profiler.profile(record_shapes=True) as prof:
                opt.step()
        else:
            opt.step()
        dist.barrier(); ts.append(time.perf_counter() - t)
    opt.close()
    evs = [(e.key, str(e.input_shapes)[:80], round(e.cpu_time_total / 1e3, 1), e.count) for e in prof.key_averages(group_by_input_shape=True) if e.cpu_time_total > 5e3 and e.key in ("aten::copy_", "aten::_to_copy", "aten::to")]
    evs.sort(key=lambda e: -e[2])
    return ts, evs[:25]
if __name__ == "__main__":
    import sys
    for rank, (ts, evs) in enumerate(run_ranks(body, 2, sys.argv[1], timeout=300)):
        print(rank, [round(t, 3) for t in ts])
        if rank == 0:
            for e in evs: print("  ", e)
