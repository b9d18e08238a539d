"""The sections of ``tests/gpu_check.py`` and the report that writes its JSON after each one.

Each section is ``run(device, small, out_dir) -> dict``; a dict with ``"ok": False`` or an exception marks the
section failed (the run goes on to the next one). CUDA-only sections return ``{"skipped": ...}`` on CPU, where the
suite runs them as a smoke run of their code (``tests/test_no_host_sync.py``).
"""

from __future__ import annotations

import json
import os
import random
import time
import traceback
import warnings
from collections.abc import Callable

import torch
from torch import nn

from overlap_muon import OverlapMuon
HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


class Report:
    """The run's JSON at ``path``, rewritten after every section; ``failed`` names the sections that failed."""

    def __init__(self, path: str) -> None:
        self.path, self.data, self.failed = path, {"sections": {}}, []
        self._write()

    def set(self, key: str, value: object) -> None:
        self.data[key] = value
        self._write()

    def section(self, name: str, run: Callable[[], dict]) -> None:
        """Run one section: a progress line when it starts and ends, its result (or error) in the JSON."""
        t0 = time.perf_counter()
        print(f"[{time.strftime('%H:%M:%S')}] {name} ...", flush=True)
        try:
            result = run()
        except Exception as e:  # noqa: BLE001 - a section's failure is reported, the next one runs
            result = {"ok": False, "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
        result["seconds"] = round(time.perf_counter() - t0, 1)
        if result.get("ok") is False:
            self.failed.append(name)
        self.data["sections"][name] = result
        self._write()
        brief = {k: v for k, v in result.items() if k not in ("traceback", "tail", "tests", "rows")}
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {json.dumps(brief, default=str)[:600]}", flush=True)

    def _write(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=2, default=str)
        os.replace(tmp, self.path)


def _cuda_only(device: torch.device) -> dict | None:
    return None if device.type == "cuda" else {"skipped": "no CUDA device (a smoke run of the code path)"}


def _inputs(device: torch.device, small: bool, d: int, tokens: int) -> tuple[int, int, torch.Tensor]:
    """``(width, layers, a (tokens, width) input)``: ``d`` and 8 layers, or 64 and 3 for a smoke run."""
    d, layers = (64, 3) if small else (d, 8)
    return d, layers, torch.randn(tokens, d, device=device, generator=torch.Generator(device).manual_seed(1))


def _net(d: int, layers: int, device: torch.device) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(layers)]).to(device)


def _loop(net: nn.Module, opt: OverlapMuon, x: torch.Tensor, steps: int, after_step: Callable[[], None] | None = None,
          clip: float | None = None) -> None:
    for _ in range(steps):
        net(x).float().pow(2).mean().backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_(net.parameters(), clip)
        opt.step()
        opt.zero_grad()
        if after_step is not None:
            after_step()


def cuda_tests(device: torch.device, small: bool, out: str) -> dict:
    from tests.gpu_check import cuda_tests as run

    r = _cuda_only(device) or run(out, timeout_s=200)
    return r if "skipped" in r else {**r, "ok": r.get("returncode") == 0}


def sanitizer(device: torch.device, small: bool, out: str) -> dict:
    """The side-stream tests under CSAN (``TORCH_CUDA_SANITIZER=1``): a tensor used on two streams without an
    ordering between them fails the test."""
    from tests.gpu_check import cuda_tests as run

    r = _cuda_only(device) or run(out, timeout_s=120, env={"TORCH_CUDA_SANITIZER": "1"},
                                  select="side_streams or inline or batched or grouped", name="sanitizer")
    return r if "skipped" in r else {**r, "ok": r.get("returncode") == 0}


def races(device: torch.device, small: bool, out: str) -> dict:
    """Random delays (``torch.cuda._sleep``) at the start of every lane task, and after each step blocks of the
    wave's sizes allocated on every stream and filled with NaN (a block reused too early would then corrupt an
    update): the params after 6 steps bitwise equal those of ``overlap=False``."""
    from overlap_muon._lanes import Lanes

    d, layers, x = _inputs(device, small, 1024, 64)
    steps = 3 if small else 6
    rng = random.Random(0)
    enqueue = Lanes._enqueue

    def delayed(self, h, stream, fn, deps):
        def late():
            torch.cuda._sleep(rng.randrange(0, 20_000_000))  # up to ~10 ms on the lane's stream
            return fn()
        return enqueue(self, h, stream, late, deps)

    def poison(opt: OverlapMuon) -> None:
        streams = [torch.cuda.current_stream(device)] + list(opt._rt.pipeline.lanes._streams.values())
        for s in streams:
            with torch.cuda.stream(s):
                junk = [torch.full((d, d), float("nan"), device=device) for _ in range(2 * layers)]
                del junk

    finals = {}
    for overlap in (True, False):
        net = _net(d, layers, device)
        opt = OverlapMuon(net, overlap=overlap, auto_overlap=False, **HP)
        if device.type == "cuda" and overlap:
            Lanes._enqueue = delayed
        try:
            _loop(net, opt, x, steps, (lambda: poison(opt)) if device.type == "cuda" else None)
        finally:
            Lanes._enqueue = enqueue
        opt.synchronize()
        finals[overlap] = [p.detach().clone() for p in net.parameters()]
        opt.close()
    same = all(torch.equal(a, b) for a, b in zip(finals[True], finals[False]))
    return {"ok": same, "bitwise_vs_overlap_off": same, "steps": steps}


def memory(device: torch.device, small: bool, out: str) -> dict:
    """MiB allocated after ``step(); zero_grad()`` at steps 1-4 and the peak over steps 2-4, overlap on vs off
    (figures; the on-minus-off difference after a step is what a wave still holds)."""
    if _cuda_only(device):
        return _cuda_only(device)
    d, layers, x = _inputs(device, small, 2048, 256)
    rows = {}
    for overlap in (True, False):
        net = _net(d, layers, device)
        opt = OverlapMuon(net, overlap=overlap, auto_overlap=False, **HP)
        after = []
        for s in range(4):
            if s == 1:
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
            _loop(net, opt, x, 1)
            after.append(torch.cuda.memory_allocated(device) / 2**20)
        rows["on" if overlap else "off"] = {"after_step_mib": [round(v, 1) for v in after],
                                            "peak_steps_2_4_mib": round(torch.cuda.max_memory_allocated(device)
                                                                        / 2**20, 1)}
        opt.close()
        del net, opt
    held = rows["on"]["after_step_mib"][-1] - rows["off"]["after_step_mib"][-1]
    return {"ok": True, **rows, "held_after_step_mib": round(held, 1)}


def sync_debug(device: torch.device, small: bool, out: str) -> dict:
    """Steps 2-4 of the default and ``async_step`` loops under ``set_sync_debug_mode``: with ``content_check=False``
    in ``"error"`` mode (no host sync anywhere); the default counted in ``"warn"`` mode (its content check reads
    one flag per step on the host, [Note: content fingerprints] in ``overlap_muon/_wave_state.py``); each also with a
    user ``clip_grad_norm_`` that does not bite between backward and ``step()``, and with ``max_grad_norm`` (neither
    reads its coefficient on the host: [Note: a clip that does not bite] in ``overlap_muon/_version_fix.py``)."""
    if _cuda_only(device):
        return _cuda_only(device)
    d, layers, x = _inputs(device, small, 1024, 64)
    out_rows = {}
    for name, kw, mode, clip in (("default_unchecked", dict(content_check=False), "error", None),
                                 ("async_step_unchecked", dict(content_check=False, async_step=True), "error", None),
                                 ("user_clip_unchecked", dict(content_check=False), "error", 1e6),
                                 ("max_grad_norm_unchecked", dict(content_check=False, max_grad_norm=1e6), "error",
                                  None),
                                 ("default", {}, "warn", None), ("user_clip", {}, "warn", 1e6)):
        net = _net(d, layers, device)
        opt = OverlapMuon(net, overlap=True, auto_overlap=False, **kw, **HP)
        _loop(net, opt, x, 1)
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode(mode)
            try:
                _loop(net, opt, x, 3, clip=clip)
                out_rows[name] = {"ok": True, "reruns": opt.stats["reruns"]}
            except RuntimeError as e:
                out_rows[name] = {"ok": False, "error": str(e)[:500]}
            finally:
                torch.cuda.set_sync_debug_mode("default")
        out_rows[name]["sync_warnings"] = sum("synchroniz" in str(w.message) for w in caught)
        opt.synchronize()
        opt.close()
    return {"ok": all(r["ok"] for r in out_rows.values()), **out_rows}


def ns(device: torch.device, small: bool, out: str) -> dict:
    from tests.gpu_check import ns_vs_bmm

    shapes = [(64, 64), (128, 64)] if small else [(1024, 1024), (4096, 1024), (4096, 4096)]
    return {"rows": ns_vs_bmm(device, shapes, reps=2 if small else 10)}


def overlap(device: torch.device, small: bool, out: str) -> dict:
    from tests.gpu_check import exposed_fraction

    layers, d, tokens, iters = (2, 64, 64, 1) if small else (12, 2048, 4096, 3)
    return exposed_fraction(device, layers, d, tokens, iters, out)


def scale(device: torch.device, small: bool, out: str) -> dict:
    from tests.gpu_check import scale_checks

    old = os.environ.get("TORCH_DISTRIBUTED_DEBUG")
    os.environ["TORCH_DISTRIBUTED_DEBUG"] = "DETAIL"  # the spawned ranks check every collective's shapes and order
    try:
        r = scale_checks(device)
    finally:
        if old is None:
            os.environ.pop("TORCH_DISTRIBUTED_DEBUG")
        else:
            os.environ["TORCH_DISTRIBUTED_DEBUG"] = old
    return {**r, "ok": "error" not in r and all(x["bitwise"] for x in r["node_exchange"])}


#: The sections in order (``tests/gpu_check.py``'s docstring lists them with their budgets).
SECTIONS: list[tuple[str, Callable[[torch.device, bool, str], dict]]] = [
    ("cuda_tests", cuda_tests), ("sanitizer", sanitizer), ("races", races), ("memory", memory),
    ("sync_debug", sync_debug), ("ns", ns), ("overlap", overlap), ("scale", scale)]
