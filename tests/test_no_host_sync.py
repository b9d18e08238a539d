"""What the CPU suite can prove of the CUDA path (issue: no host sync in backward, FSDP2's streams wait).

1. Gradient presence is agreed on host flags: the tensors the check builds are CPU ``uint8`` and travel on a gloo
   group, whatever the params' device, so the launch never waits for the GPU.
2. A forward pre-hook makes FSDP2's all-gather copy-in and all-gather streams wait on the wave's apply event, not
   only the current stream: FSDP2 copies the sharded params on its own stream, which waited on the current stream
   once, in the root's pre-forward, before the per-module waits ran.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import overlap_muon._lanes as lanes_mod
from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, PlainShardNet, TinyNet, build_dtensor_model, plain_opt


def _presence_body(rank, world):
    seen = []
    orig = dist.all_to_all_single

    def spy(out, inp, *a, group=None, **k):
        if inp.dtype == torch.uint8 and inp.numel() <= 64:  # the presence flags (the data travels as bf16 bytes)
            seen.append((out.device.type, inp.device.type, dist.get_backend(group)))
        return orig(out, inp, *a, group=group, **k)

    dist.all_to_all_single = spy
    try:
        net = PlainShardNet(1, 2, 0, rank)
        opt = plain_opt(net, 1, 2, 0, rank, overlap=True)
        for s in range(2):
            cs, _ = net.local_grads(s)
            net(cs).backward()
            opt.step()
            opt.zero_grad()
        opt.close()
    finally:
        dist.all_to_all_single = orig
    return seen


@pytest.mark.timeout(120)
def test_presence_check_builds_cpu_tensors_on_gloo():
    for seen in run_ranks(_presence_body, 2, timeout=90):
        assert seen and all(s == ("cpu", "cpu", "gloo") for s in seen), seen


class _FakeEvent:
    pass


class _FakeStream:
    def __init__(self) -> None:
        self.waited: list = []

    def wait_event(self, ev) -> None:
        self.waited.append(ev)


def test_wait_makes_every_given_stream_wait_on_the_event(monkeypatch):
    current, streams = _FakeStream(), [_FakeStream(), _FakeStream()]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current)  # the lanes name their device
    h = lanes_mod.LaneHandle("from_home")
    h.event = _FakeEvent()
    h.wait(streams)
    assert [s.waited for s in [current] + streams] == [[h.event]] * 3


def _fsdp_streams_body(rank, world):
    """Forward pre-hooks of FSDP2 modules hand FSDP2's all-gather streams to the wait."""
    torch.manual_seed(0)
    model, mesh = build_dtensor_model(TinyNet(), 1, 1)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=True, async_step=True, **HP)
    calls = []
    orig = opt._pipeline.wait

    def spy(waves, streams=()):
        calls.append(len(streams))
        return orig(waves, streams)

    opt._pipeline.wait = spy
    x = torch.randn(4, 12)
    for _ in range(2):
        model(x).sum().backward()
        opt.step()
        opt.zero_grad()
    model(x)
    opt.close()
    ctx = model._get_fsdp_state()._comm_ctx
    return calls, [type(s).__name__ for s in (ctx.all_gather_copy_in_stream, ctx.all_gather_stream)]


@pytest.mark.timeout(120)
def test_fsdp_module_waits_pass_fsdp_streams():
    calls, kinds = run_ranks(_fsdp_streams_body, 1, timeout=90)[0]
    # The root FSDP2 module (it all-gathers every param of TinyNet) passes its copy-in and all-gather streams once
    # FSDP2 has created them (after its lazy init in the first forward); its children are not FSDP2 modules.
    assert calls.count(2) >= 2 and set(calls) <= {0, 2}, calls
    assert kinds == ["Stream", "Stream"]


@pytest.mark.timeout(120)
def test_gpu_check_script_runs_on_cpu(tmp_path):
    """``tests/gpu_check.py`` (what ``gpu_check.sh`` runs on a GPU) runs its code paths on tiny CPU shapes, so the
    GPU run does not fail on a typo; each section is in the JSON (the CUDA-only ones as skipped)."""
    import json
    import subprocess
    import sys

    root = __import__("os").path.dirname(__import__("os").path.dirname(__file__))
    proc = subprocess.run([sys.executable, "tests/gpu_check.py", "--device", "cpu", "--small", "--skip-tests",
                           "--out", str(tmp_path)], cwd=root, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    sections = json.loads((tmp_path / "gpu_check.json").read_text())["sections"]
    assert list(sections) == ["versions", "races", "memory", "sync_debug", "ns", "overlap", "scale"], list(sections)
    assert sections["races"]["bitwise_vs_overlap_off"] and "skipped" in sections["memory"]
    assert len(sections["ns"]["rows"]) == 2 and sections["overlap"]["step_s"]["on"] > 0
    # the scale checks: warm-up of one rank's groups (flat: all_to_all, all_gather; remat, TP: all_to_all; team:
    # all_reduce, all_gather), and two hops as 2 nodes of 1, bitwise the fused exchange with one peer each
    warm, hops = sections["scale"]["warm_up"], sections["scale"]["node_exchange"]
    assert warm["collectives"] == 6 and all(r["bitwise"] and r["peers"] == [1, 1] for r in hops), sections["scale"]


@pytest.mark.timeout(60)
def test_gpu_check_without_a_gpu_says_so_and_exits_0(tmp_path):
    """Issue 46, finding 7: ``bash tests/gpu_check.sh`` on a machine without a GPU prints "no GPU", writes its JSON
    and exits 0 (it used to fail)."""
    import json
    import os
    import subprocess

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    root = os.path.dirname(os.path.dirname(__file__))
    proc = subprocess.run(["bash", "tests/gpu_check.sh"], cwd=root, capture_output=True, text=True, timeout=50,
                          env={**os.environ, "GPU_CHECK_OUT": str(tmp_path)})
    assert proc.returncode == 0 and "no GPU" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert report["no_gpu"] is True and report["versions"]["torch"] == torch.__version__


@pytest.mark.timeout(120)
def test_multi_gpu_script_runs_on_cpu(tmp_path):
    """``tests/gpu_multi.py`` (what ``gpu_check_multi.sh`` runs on two GPUs) runs on 2 gloo ranks on CPU: FSDP2 with
    a second optimizer writing after ``step()`` is bitwise ``overlap=False``; the stream race is skipped (no
    streams)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(__file__))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "tests/gpu_multi.py", "--device", "cpu", "--out", str(tmp_path)], cwd=root,
                          capture_output=True, text=True, timeout=110, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    report = json.loads((tmp_path / "gpu_multi.json").read_text())
    assert report["second_optimizer"]["bitwise_vs_overlap_off"] and "skipped" in report["all_gather_race"], report
