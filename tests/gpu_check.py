"""The GPU check in one prepared run, reporting whatever happens: each section writes the JSON when it ends
(``traces/gpu_check/gpu_check.json``) and prints one progress line, so a run cut by the shell's timeout leaves what it
measured. Sections, in order, with their budgets (``tests/gpu_check.sh`` holds the whole run to 9 minutes):

==================  ======  ===========================================================================================
section             budget  what
==================  ======  ===========================================================================================
``versions``        1 s     torch, CUDA, NCCL, driver, the GPUs
``cuda_tests``      200 s   ``tests/test_cuda.py`` (what needs two ranks on FSDP2 is in ``tests/gpu_multi.py``)
``sanitizer``       120 s   its side-stream tests again under ``TORCH_CUDA_SANITIZER=1`` (stream races of tensors)
``races``           30 s    random delays on every lane task and poisoned allocations after each step, bitwise
                            against ``overlap=False``
``memory``          20 s    memory after ``step(); zero_grad()`` and the peak over steps 2-4, overlap on vs off
``sync_debug``      20 s    steps 2-4 of the default, ``async_step`` and user-clip loops under
                            ``set_sync_debug_mode("error")``
``ns``              20 s    NS vs ``torch.bmm`` throughput
``overlap``         60 s    the exposed optimizer fraction of a 12-layer d2048 model, with a timeline picture
``scale``           60 s    two gloo ranks on the GPU under ``TORCH_DISTRIBUTED_DEBUG=DETAIL``: the warm-up over NCCL
                            and the two-hop exchange on device tensors (one GPU cannot show nodes or NCCL between
                            ranks: ``tests/gpu_check_multi.sh`` is for the first multi-GPU machine)
==================  ======  ===========================================================================================

Without a GPU it prints "no GPU", writes the JSON with ``"no_gpu": true`` and exits 0. ``python tests/gpu_check.py
--device cpu --small`` runs the same code paths on tiny shapes (the CPU suite does, so the script is known to run
before a GPU is at hand).
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


def cuda_tests(out_dir: str, timeout_s: int, env: dict | None = None, select: str | None = None,
               name: str = "cuda_tests") -> dict:
    """Run ``tests/test_cuda.py`` (``select``: a ``-k`` expression; ``env``: extra environment); return the outcome
    of each test (passed / failed / skipped, with the skip reasons in ``tail``)."""
    xml = os.path.join(out_dir, f"{name}.xml")
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", f"--junitxml={xml}",
           os.path.join(ROOT, "tests", "test_cuda.py")] + (["-k", select] if select else [])
    try:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, **(env or {})})
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
    """bf16 TFLOP/s of one-matrix NS (``overlap_muon._ns.zeropower``) vs the same matmuls as plain ``torch.bmm``."""
    from overlap_muon._ns import zeropower
    from overlap_muon._scheduler.cost import ns_flops

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


def versions(device: torch.device) -> dict:
    """torch, CUDA, NCCL and driver versions and the GPUs (``None`` where not known)."""
    out: dict = {"torch": torch.__version__, "cuda": torch.version.cuda, "python": sys.version.split()[0]}
    if device.type == "cuda":
        out["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        try:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception as e:  # noqa: BLE001 - a version is a label, not a check
            out["nccl"] = f"unknown ({type(e).__name__})"
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            out["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 else None
        except Exception:  # noqa: BLE001 - no nvidia-smi
            out["driver"] = None
    return out


def main(argv: list[str] | None = None) -> int:
    from tests.gpu_sections import SECTIONS, Report

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="tiny shapes (a smoke run of the code paths)")
    ap.add_argument("--out", default=os.path.join(ROOT, "traces", "gpu_check"))
    ap.add_argument("--skip-tests", action="store_true", help="skip the sections that run pytest")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    report = Report(os.path.join(a.out, "gpu_check.json"))
    if a.device == "cuda" and not torch.cuda.is_available():
        report.set("no_gpu", True)
        report.set("versions", versions(torch.device("cpu")))
        print(f"no GPU: nothing to check (wrote {report.path})")
        return 0
    device = torch.device(a.device)
    report.set("device", torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    report.set("date", time.strftime("%Y-%m-%d %H:%M:%S %Z"))
    report.section("versions", lambda: versions(device))
    for name, run in SECTIONS:
        if a.skip_tests and name in ("cuda_tests", "sanitizer"):
            continue
        report.section(name, lambda run=run: run(device, a.small, a.out))
    print(f"wrote {report.path}; failed sections: {report.failed or 'none'}")
    return 1 if report.failed else 0


if __name__ == "__main__":
    sys.exit(main())
