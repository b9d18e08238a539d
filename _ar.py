import time, torch, torch.distributed as dist
from tests.dist_utils import run_ranks
def body(rank, world):
    torch.set_num_threads(1)
    g = torch.randn(2048, 2048).bfloat16()
    res = {}
    for name in ("ar_bf16", "ar_fp32", "ag_bf16"):
        ts = []
        for r in range(6):
            dist.barrier(); t = time.perf_counter()
            if name == "ar_bf16":
                x = g.clone(); dist.all_reduce(x)
            elif name == "ar_fp32":
                x = g.float(); dist.all_reduce(x); x = x.bfloat16()
            else:
                parts = [torch.empty_like(g) for _ in range(world)]; dist.all_gather(parts, g)
                acc = parts[0].float()
                for p in parts[1:]: acc += p.float()
                x = acc.bfloat16()
            dist.barrier(); ts.append(time.perf_counter() - t)
        res[name] = sorted(ts[1:])[2]
    # syrk vs plain on the team block
    from overlap_muon.ns import sym_gram, sym_poly
    xc = torch.randn(2048, 4096).bfloat16()
    for name, f in (("gram", lambda: xc @ xc.mT), ("sym_gram256", lambda: sym_gram(xc, 256)), ("sym_gram512", lambda: sym_gram(xc, 512))):
        ts = []
        for r in range(4):
            dist.barrier(); t = time.perf_counter(); f(); dist.barrier(); ts.append(time.perf_counter() - t)
        res[name] = sorted(ts[1:])[1]
    A = (xc @ xc.mT)
    for name, f in (("poly", lambda: torch.addmm(A, A, A, beta=-4.7, alpha=2.0)), ("sym_poly256", lambda: sym_poly(A, -4.7, 2.0, 256))):
        ts = []
        for r in range(4):
            dist.barrier(); t = time.perf_counter(); f(); dist.barrier(); ts.append(time.perf_counter() - t)
        res[name] = sorted(ts[1:])[1]
    return res
if __name__ == "__main__":
    print(run_ranks(body, 2, timeout=300)[0])
