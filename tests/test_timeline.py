"""Tests of ``overlap_muon.apps.timeline``: lanes, wave counts and the exposed optimizer time read from a trace."""

from __future__ import annotations

import concurrent.futures as cf
import gzip
import json
import os
import shutil
import time

import pytest
import torch
from torch.profiler import ProfilerActivity, profile, record_function, schedule

from overlap_muon.apps.timeline import TimelineSummary, draw_timeline, main

_PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _busy(seconds: float) -> None:
    """Sleep: keeps the ranges' durations without competing for the (shared, small) CPU."""
    time.sleep(seconds)


def _to_home(k: int) -> None:
    with record_function(f"OverlapMuon::wave{k}::pack"):
        _busy(0.001)
    with record_function(f"OverlapMuon::wave{k}::a2a_to_home"):
        _busy(0.001)


def _ns(k: int, dep: cf.Future) -> None:
    dep.result()
    with record_function(f"OverlapMuon::wave{k}::ns"):
        _busy(0.002)


def _from_home(k: int, dep: cf.Future) -> None:
    dep.result()
    with record_function(f"OverlapMuon::wave{k}::a2a_from_home"):
        _busy(0.001)
    with record_function(f"OverlapMuon::wave{k}::apply"):
        _busy(0.0005)


def _profile_synthetic_loop(trace_path: str, num_waves: int = 3, active_steps: int = 2) -> None:
    """A tiny training-like loop: main-thread ranges plus waves on two worker threads, profiled by torch.

    The worker threads exist before profiling starts (as the runtime's lanes do), so the trace only shows
    them with ``profile_all_threads=True``; see [Note: capturing worker threads] in the module.
    """
    comm = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test_comm")
    compute = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="test_compute")
    comm.submit(lambda: None).result()
    compute.submit(lambda: None).result()
    pending: list[cf.Future] = []
    try:
        with profile(
            activities=[ProfilerActivity.CPU],
            schedule=schedule(wait=0, warmup=1, active=active_steps, repeat=1),
            on_trace_ready=lambda p: p.export_chrome_trace(trace_path),
            experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True),
        ) as prof:
            for step in range(1 + active_steps):
                with record_function("## forward ##"):
                    for fut in pending:  # the forward pre-hook waits on each wave's update
                        with record_function("OverlapMuon::wait_wave"):
                            fut.result()
                    pending = []
                    _busy(0.003)
                with record_function("## backward ##"):
                    for k in range(num_waves):
                        _busy(0.001)  # a bucket of gradients becomes ready
                        to = comm.submit(_to_home, k)
                        ns = compute.submit(_ns, k, to)
                        pending.append(comm.submit(_from_home, k, ns))
                with record_function("## optimizer ##"):
                    _busy(0.0005)
                if step == active_steps:
                    # Drain inside the last profiled step, so every wave of the active steps is recorded whole.
                    with record_function("OverlapMuon::wait_flush"):
                        for fut in pending:
                            fut.result()
                    pending = []
                prof.step()
    finally:
        comm.shutdown(wait=True)
        compute.shutdown(wait=True)


@pytest.mark.timeout(60)
def test_timeline_from_torch_profiler_trace(tmp_path):
    trace = str(tmp_path / "trace.json")
    _profile_synthetic_loop(trace, num_waves=3, active_steps=2)
    assert os.path.exists(trace)
    out = str(tmp_path / "sub" / "timeline.png")
    s = draw_timeline(trace, out)

    assert isinstance(s, TimelineSummary)
    with open(out, "rb") as f:
        head = f.read(8)
    assert head == _PNG_MAGIC and os.path.getsize(out) > 5000
    assert s.lanes[0] == "main"
    assert "compute" in s.lanes
    assert any(lane.startswith("comm") for lane in s.lanes[1:]), s.lanes
    assert len(s.lanes) == 3, s.lanes  # main + one comm thread + one compute thread
    assert s.num_waves == 3
    # Every wave of the profiled steps ran each phase once (the warmup step's waves may straddle the start).
    for phase in ("pack", "a2a_to_home", "ns", "a2a_from_home", "apply"):
        assert 2 * 3 <= s.phase_counts[phase] <= 3 * 3, s.phase_counts
    assert s.num_steps == 2
    for step, ex, frac in zip(s.step_ms, s.exposed_ms, s.exposed_fraction):
        assert step > 5.0  # forward 3 ms + 3 buckets of 1 ms, at least
        assert 0.5 <= ex < step  # the 0.5 ms optimizer range at least
        assert 0.0 < frac < 1.0
        assert frac == pytest.approx(ex / step)
    assert s.main_ms["forward"] > 0 and s.main_ms["backward"] > 0 and s.main_ms["optimizer"] > 0
    assert not any("worker threads were not profiled" in w for w in s.warnings)

    # The same trace gzip-compressed reads the same.
    gz = trace + ".gz"
    with open(trace, "rb") as src, gzip.open(gz, "wb") as dst:
        shutil.copyfileobj(src, dst)
    s2 = draw_timeline(gz, str(tmp_path / "timeline_gz.png"))
    assert (s2.lanes, s2.num_waves, s2.exposed_ms, s2.step_ms) == (s.lanes, s.num_waves, s.exposed_ms, s.step_ms)


def _x(name, tid, ts, dur, cat="user_annotation", pid=1):
    return {"ph": "X", "name": name, "cat": cat, "pid": pid, "tid": tid, "ts": ts, "dur": dur}


def _handmade_trace() -> dict:
    """Two 10 ms steps on tid 1; waves on tid 2 (to home), 3 (NS), 4 (from home). Times in microseconds."""
    ev = []
    for s in range(2):
        b = 1000.0 + s * 10_000
        ev.append(_x(f"ProfilerStep#{s + 5}", 1, b, 10_000))
        ev.append(_x("## forward ##", 1, b, 3000))
        ev.append(_x("OverlapMuon::wait_wave1", 1, b + 100, 400))  # waits for the last step's waves: 0.4 ms
        ev.append(_x("## backward ##", 1, b + 3000, 4000))
        ev.append(_x("## optimizer ##", 1, b + 7000, 1000))  # 1 ms
        ev.append(_x("Optimizer.step#OverlapMuon.step", 1, b + 7100, 800))  # nested: counted once
        ev.append(_x("OverlapMuon::wait_flush", 1, b + 7500, 200))  # nested too
        ev.append(_x("Optimizer.zero_grad#OverlapMuon.zero_grad", 1, b + 9000, 50))  # not the step
        for k in range(2):
            w = b + 4000 + k * 1500
            ev.append(_x(f"OverlapMuon::wave{k}::pack", 2, w, 200))
            ev.append(_x(f"OverlapMuon::wave{k}::a2a_to_home", 2, w + 200, 300))
            ev.append(_x(f"OverlapMuon::wave{k}::ns", 3, w + 500, 600))
            ev.append(_x(f"OverlapMuon::wave{k}::a2a_from_home", 4, w + 1100, 300))
            ev.append(_x(f"OverlapMuon::wave{k}::apply", 4, w + 1400, 100))
    ev.append({"ph": "M", "name": "thread_name", "pid": 1, "tid": 1, "args": {"name": "main"}})
    return {"traceEvents": ev}


@pytest.mark.timeout(60)
def test_exposed_time_exact_on_handmade_trace(tmp_path, capsys):
    trace = tmp_path / "hand.json"
    trace.write_text(json.dumps(_handmade_trace()))
    out = str(tmp_path / "hand.png")
    s = draw_timeline(str(trace), out)
    assert s.lanes == ("main", "comm: to_home", "compute", "comm: from_home")
    assert s.num_steps == 2 and s.num_waves == 2
    assert s.phase_counts == {"pack": 4, "a2a_to_home": 4, "ns": 4, "a2a_from_home": 4, "apply": 4}
    assert s.step_ms == pytest.approx((10.0, 10.0))
    # 1.0 ms optimizer range (the nested step and wait add nothing) + the 0.4 ms wait in the forward.
    assert s.exposed_ms == pytest.approx((1.4, 1.4))
    assert s.exposed_fraction == pytest.approx((0.14, 0.14))
    assert s.mean_exposed_fraction == pytest.approx(0.14)
    assert s.main_ms["optimizer"] == pytest.approx(2.0)
    assert s.main_ms["wait"] == pytest.approx(2 * 0.6)
    assert os.path.getsize(out) > 5000

    assert main([str(trace), "--out", str(tmp_path / "cli.png")]) == 0
    printed = capsys.readouterr().out
    assert "14.00%" in printed and "compute" in printed
    assert os.path.exists(tmp_path / "cli.png")


@pytest.mark.timeout(30)
def test_trace_without_steps_or_lanes_and_bad_files(tmp_path):
    trace = tmp_path / "plain.json"
    events = [_x("## forward ##", 7, 0, 2000), _x("## optimizer ##", 7, 2000, 500)]
    trace.write_text(json.dumps({"traceEvents": events}))
    s = draw_timeline(str(trace), str(tmp_path / "plain.png"))
    assert s.lanes == ("main",) and s.num_waves == 0 and s.num_steps == 1
    assert s.exposed_ms == pytest.approx((0.5,)) and s.exposed_fraction == pytest.approx((0.2,))
    assert any("ProfilerStep" in w for w in s.warnings)

    bad = tmp_path / "bad.json"
    bad.write_text("not json")
    with pytest.raises(ValueError, match="not a JSON Chrome trace"):
        draw_timeline(str(bad), str(tmp_path / "bad.png"))
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"traceEvents": []}))
    with pytest.raises(ValueError, match="no complete"):
        draw_timeline(str(empty), str(tmp_path / "empty.png"))


@pytest.mark.timeout(30)
def test_cuda_trace_uses_stream_lanes(tmp_path):
    """On CUDA the wave ranges are drawn from their GPU projections (one lane per stream), not the CPU launches."""
    ev = [_x("ProfilerStep#0", 1, 0, 10_000), _x("## backward ##", 1, 0, 6000), _x("## optimizer ##", 1, 6000, 300)]
    for k in range(3):
        w = 1000.0 + 1500 * k
        for phase, stream, a, d in (("pack", 7, 0, 100), ("a2a_to_home", 7, 100, 300), ("ns", 13, 400, 500),
                                    ("a2a_from_home", 20, 900, 300), ("apply", 20, 1200, 100)):
            ev.append(_x(f"OverlapMuon::wave{k}::{phase}", 1, w + a, 5))  # the CPU-side launch, on the main thread
            ev.append(_x(f"OverlapMuon::wave{k}::{phase}", stream, w + a + 20, d, cat="gpu_user_annotation", pid=0))
    trace = tmp_path / "cuda.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    s = draw_timeline(str(trace), str(tmp_path / "cuda.png"))
    assert s.lanes == ("main", "comm: to_home (stream 7)", "compute (stream 13)", "comm: from_home (stream 20)")
    assert s.num_waves == 3 and all(n == 3 for n in s.phase_counts.values())
    assert s.exposed_ms == pytest.approx((0.3,))
