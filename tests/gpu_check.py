"""The GPU check in one prepared run: the CUDA tests, NS vs ``torch.bmm`` throughput, the exposed optimizer
fraction of a model big enough for NS to matter, and the scale checks one GPU can run, written to one JSON file and
printed as a table.

The scale checks (``scale_checks``): one GPU cannot show nodes. On two gloo ranks sharing the GPU it checks the
warm-up over NCCL (rank 0's own groups, each a size-1 NCCL communicator that the warm-up connects: the collectives
run and complete on the device), and the two-hop exchange's code on device tensors (as 2 nodes of 1: bitwise the
fused exchange, one peer each). The hops across real nodes, and NCCL between ranks, need a multi-GPU machine.

Usage (on a machine with a CUDA GPU): ``bash tests/gpu_check.sh`` (under 5 minutes on one H100/H200-class GPU).
``python tests/gpu_check.py --device cpu --small`` runs the same code paths on tiny shapes (the CPU suite does, so the
script is known to run before a GPU is at hand).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402
from torch import nn  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _timed(fn, device: torch.device, reps: int) -> float:
    """Median seconds of ``fn()`` over ``reps`` runs after one warm-up (device synchronized around each)."""
    fn()
    _sync(device)
    out = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        out.append(time.perf_counter() - t0)
    return sorted(out)[len(out) // 2]


def cuda_tests(out_dir: str, timeout_s: int) -> dict:
    """Run ``tests/test_cuda.py``; return the outcome of each test (passed / failed / skipped)."""
    xml = os.path.join(out_dir, "cuda_tests.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
           os.path.join(ROOT, "tests", "test_cuda.py")]
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
        tail = (proc.stdout + proc.stderr)[-3000:]
    except subprocess.TimeoutExpired as e:
        return {"error": f"timed out after {timeout_s} s", "tail": str(e.stdout)[-3000:]}
    results = {}
    if os.path.exists(xml):
        for case in ET.parse(xml).getroot().iter("testcase"):
            kind = "passed"
            for child in case:
                if child.tag in ("failure", "error"):
                    kind = "failed"
                elif child.tag == "skipped":
                    kind = "skipped"
            results[case.get("name")] = kind
    return {"returncode": proc.returncode, "tests": results, "tail": tail}


def ns_vs_bmm(device: torch.device, shapes: list[tuple[int, int]], reps: int) -> list[dict]:
    """bf16 TFLOP/s of one-matrix NS (``overlap_muon.ns.zeropower``) vs the same matmuls as plain ``torch.bmm``."""
    from overlap_muon import ns_flops, zeropower

    rows = []
    for m, n in shapes:
        x = torch.randn(m, n, device=device)
        flops = ns_flops((m, n), 5)
        t_ns = _timed(lambda: zeropower(x, ns_steps=5), device, reps)
        a, b = (x.mT if m > n else x).bfloat16().unsqueeze(0), None
        b = a.mT.contiguous()

        def matmuls():
            y = a
            for _ in range(5):
                g = torch.bmm(y, b if y is a else y.mT)
                h = torch.bmm(g, g)
                y = torch.bmm(h, y)

        t_mm = _timed(matmuls, device, reps)
        rows.append({"shape": [m, n], "ns_tflops": flops / t_ns / 1e12, "bmm_tflops": flops / t_mm / 1e12,
                     "ns_over_bmm": t_mm / t_ns})
    return rows


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        self.up = nn.Linear(d, 4 * d, bias=False)
        self.down = nn.Linear(4 * d, d, bias=False)
        self.n1, self.n2 = nn.LayerNorm(d), nn.LayerNorm(d)

    def forward(self, x):
        q, k, v = self.qkv(self.n1(x)).chunk(3, dim=-1)
        x = x + self.proj(torch.softmax(q @ k.mT / q.size(-1) ** 0.5, dim=-1) @ v)
        return x + self.down(torch.nn.functional.gelu(self.up(self.n2(x))))


def exposed_fraction(device: torch.device, layers: int, d: int, tokens: int, iters: int, out_dir: str) -> dict:
    """``(t_on - t_none) / (t_off - t_none)`` of a ``layers``-block model of width ``d`` at world 1, and a timeline
    picture of the overlapped step from a ``torch.profiler`` trace."""
    from overlap_muon import OverlapMuon

    x = torch.randn(tokens // 512 or 1, 512 if tokens >= 512 else tokens, d, device=device)
    models, opts = {}, {}
    for name in ("none", "off", "on", "async"):  # on: the default step (barrier); async: async_step=True
        torch.manual_seed(0)
        models[name] = nn.Sequential(*[_Block(d) for _ in range(layers)]).to(device)
        opts[name] = None if name == "none" else OverlapMuon(models[name], overlap=(name != "off"), lr=0.02,
                                                             async_step=(name == "async"))

    def iteration(name: str) -> None:
        models[name](x).float().pow(2).mean().backward()
        if opts[name] is not None:
            opts[name].step()
            opts[name].zero_grad()
        else:
            models[name].zero_grad()

    def chunk(name: str) -> float:
        _sync(device)
        t0 = time.perf_counter()
        for _ in range(iters):
            iteration(name)
        if opts[name] is not None:
            opts[name].synchronize()
        _sync(device)
        return (time.perf_counter() - t0) / iters

    for n in models:
        chunk(n)  # warm-up
    times = {n: [] for n in models}
    k = len(models)
    for r in range(3):
        for n in list(models)[r % k:] + list(models)[: r % k]:
            times[n].append(chunk(n))
    med = {n: sorted(v)[1] for n, v in times.items()}
    opt_s = med["off"] - med["none"]
    frac = (med["on"] - med["none"]) / opt_s if opt_s > 0 else None
    async_frac = (med["async"] - med["none"]) / opt_s if opt_s > 0 else None
    out = {"layers": layers, "d_model": d, "tokens": tokens, "step_s": med, "exposed_fraction": frac,
           "async_exposed_fraction": async_frac}
    trace = os.path.join(out_dir, "gpu_overlap_trace.json")
    try:
        from torch._C._profiler import _ExperimentalConfig

        acts = [torch.profiler.ProfilerActivity.CPU] + (
            [torch.profiler.ProfilerActivity.CUDA] if device.type == "cuda" else [])
        with torch.profiler.profile(activities=acts, schedule=torch.profiler.schedule(wait=0, warmup=1, active=3),
                                    on_trace_ready=lambda p: p.export_chrome_trace(trace),
                                    experimental_config=_ExperimentalConfig(profile_all_threads=True)) as prof:
            for _ in range(4):
                with torch.profiler.record_function("## forward ##"):
                    iteration("on")
                prof.step()
        opts["on"].synchronize()
        from overlap_muon.apps.timeline import draw_timeline

        s = draw_timeline(trace, os.path.join(out_dir, "gpu_overlap_timeline.png"))
        out["timeline"] = {"png": os.path.join(out_dir, "gpu_overlap_timeline.png"),
                           "mean_exposed_fraction": s.mean_exposed_fraction}
    except Exception as e:  # noqa: BLE001 - the picture is an extra; the measurement stands without it
        out["timeline"] = {"error": f"{type(e).__name__}: {e}"}
    for o in opts.values():
        if o is not None:
            o.close()
    return out


def scale_checks(device: torch.device) -> dict:
    """The warm-up over the device's backend and the two-hop exchange on its tensors (``tests/test_nodes.py``)."""
    from tests.dist_utils import run_ranks
    from tests.test_nodes import scale_on_one_device

    try:
        ranks = run_ranks(scale_on_one_device, 2, str(device), timeout=120)
    except AssertionError as e:
        return {"error": str(e)[-2000:]}
    return {"warm_up": ranks[0]["warm_up"], "node_exchange": [r["node_exchange"] for r in ranks]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run of the code paths)")
    ap.add_argument("--out", default=os.path.join(ROOT, "traces", "gpu_check"))
    ap.add_argument("--skip-tests", action="store_true")
    a = ap.parse_args(argv)
    device = torch.device(a.device)
    os.makedirs(a.out, exist_ok=True)
    report: dict = {"device": torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu",
                    "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    if not a.skip_tests:
        report["cuda_tests"] = cuda_tests(a.out, timeout_s=200)
    shapes = [(64, 64), (128, 64)] if a.small else [(1024, 1024), (4096, 1024), (4096, 4096)]
    report["ns"] = ns_vs_bmm(device, shapes, reps=2 if a.small else 10)
    layers, d, tokens, iters = (2, 64, 64, 1) if a.small else (12, 2048, 4096, 3)
    report["overlap"] = exposed_fraction(device, layers, d, tokens, iters, a.out)
    report["scale"] = scale_checks(device)
    path = os.path.join(a.out, "gpu_check.json")
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=str)
    print(f"device {report['device']}  torch {report['torch']}  {report['date']}")
    for name, kind in report.get("cuda_tests", {}).get("tests", {}).items():
        print(f"  test {name:<55} {kind}")
    for r in report["ns"]:
        print(f"  NS {r['shape'][0]}x{r['shape'][1]:<6} {r['ns_tflops']:8.1f} TFLOP/s  bmm {r['bmm_tflops']:8.1f}  "
              f"ratio {r['ns_over_bmm']:.3f}")
    ov = report["overlap"]
    print(f"  overlap {ov['layers']} layers d {ov['d_model']}: none {ov['step_s']['none'] * 1e3:.1f} ms, off "
          f"{ov['step_s']['off'] * 1e3:.1f} ms, on {ov['step_s']['on'] * 1e3:.1f} ms, async_step "
          f"{ov['step_s']['async'] * 1e3:.1f} ms -> exposed fraction {ov['exposed_fraction']} (default step, a "
          f"stream wait), {ov['async_exposed_fraction']} (async_step)")
    sc = report["scale"]
    print(f"  scale: warm-up {sc['warm_up']}; two hops as 2 nodes of 1 {sc['node_exchange']}")
    print(f"  wrote {path}")
    tests = report.get("cuda_tests", {})
    scale_ok = "error" not in sc and all(r["bitwise"] for r in sc["node_exchange"])
    return 0 if scale_ok and (a.skip_tests or tests.get("returncode") == 0) else 1


if __name__ == "__main__":
    sys.exit(main())
