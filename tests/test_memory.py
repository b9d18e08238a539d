"""Release on time (docs/design.md, invariant 9): a wave's tensors die once its update has been applied and waited for.

Regression: a wave's lane handle kept its task closures alive, and through them the step's gradients, packed bf16
momenta, assembled full matrices and returned shards, until the same wave launched again in the next backward.
The tests take ``weakref``s of every tensor the pipeline's functions produce in step k, then check none is alive
after ``step()``, ``zero_grad(set_to_none=True)`` and the next forward (overlap) or when ``step()`` returns (sync).
No ``gc.collect()``: reference counting alone must free them (no cycles hold them).
"""

from __future__ import annotations

import weakref

import pytest
import torch

import overlap_muon._exchanges as exchanges_mod
import overlap_muon._muon_math as math_mod
import overlap_muon._ns as ns_mod
import overlap_muon._pipeline as pipeline_mod
from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, TinyNet, build_dtensor_model

WRAPPED = ((math_mod, "momentum_update"), (pipeline_mod, "ns_input"), (exchanges_mod, "to_homes"),
           (exchanges_mod, "from_homes"), (exchanges_mod, "all_gather_full"), (ns_mod, "zeropower"))


class _Spy:
    """Wraps the pipeline's tensor-producing functions and keeps weakrefs to what they return, per step."""

    def __init__(self) -> None:
        self.step = 0
        self.refs: dict[int, list[tuple[str, weakref.ref]]] = {}
        self._orig = {(mod, n): getattr(mod, n) for mod, n in WRAPPED}

    def __enter__(self) -> "_Spy":
        for (mod, name), fn in self._orig.items():
            setattr(mod, name, self._wrap(name, fn))
        return self

    def __exit__(self, *exc) -> None:
        for (mod, name), fn in self._orig.items():
            setattr(mod, name, fn)

    def _wrap(self, name, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            self._take(name, out)
            return out

        return call

    def _take(self, name, out) -> None:
        if isinstance(out, torch.Tensor):
            self.refs.setdefault(self.step, []).append((name, weakref.ref(out)))
        elif isinstance(out, (list, tuple)):
            for x in out:
                self._take(name, x)

    def alive(self, step: int) -> list[str]:
        return sorted({name for name, r in self.refs.get(step, []) if r() is not None})


def _train(model, opt, spy, overlap: bool, steps: int = 3) -> list[str]:
    bad = []
    grads: list[weakref.ref] = []
    for s in range(steps):
        spy.step = s
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
        model(x).pow(2).mean().backward()
        grads = [weakref.ref(p.grad) for p in opt.param_groups[0]["params"]]
        opt.step()
        if not overlap:
            alive = spy.alive(s)
            bad += [f"sync step {s}: {alive} alive when step() returned"] if alive else []
        opt.zero_grad(set_to_none=True)
        model(x).sum()  # the next forward waits for the waves: then step s's tensors must be gone
        alive = spy.alive(s) + (["grads"] if any(r() is not None for r in grads) else [])
        if alive:
            bad.append(f"step {s} (overlap={overlap}): {alive} still alive after step, zero_grad, next forward")
    assert spy.refs, "the spy saw no tensors"
    return bad


@pytest.mark.parametrize("overlap", [True, False])
def test_wave_tensors_released_world1(overlap):
    torch.manual_seed(0)
    model = TinyNet()
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, overlap=overlap, **HP)
    with _Spy() as spy:
        bad = _train(model, opt, spy, overlap)
    opt.close()
    assert not bad, bad


def _body(rank, world, overlap):
    torch.manual_seed(0)
    model, mesh = build_dtensor_model(TinyNet(), 2, 2)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, **HP)
    with _Spy() as spy:
        bad = _train(model, opt, spy, overlap)
    opt.close()
    return bad


@pytest.mark.timeout(180)
@pytest.mark.parametrize("overlap", [True, False])
def test_wave_tensors_released_2x2(overlap):
    res = run_ranks(_body, 4, overlap, timeout=150)
    assert all(not b for b in res), res


def test_cuda_release_policy_frees_a_wave_when_the_step_has_waited(monkeypatch):
    """Issue 46, finding 2: under the CUDA release policy (``LateRelease``), driven on CPU with every task reported
    unfinished (as on a GPU still running the applies when ``step()`` returns), a wave's tensors are released once
    the step's barrier has made the current stream wait on its apply, not at the next ``step()``: after
    ``step(); zero_grad()`` nothing of the step is alive. Before, the states waited for ``reap()`` at the next
    ``step()``, through the next forward and backward."""
    from overlap_muon._lanes import LaneHandle
    from overlap_muon._wave_state import LateRelease

    torch.manual_seed(0)
    model = TinyNet()
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, overlap=True, auto_overlap=False, **HP)
    opt._pipeline._release = LateRelease()
    monkeypatch.setattr(LaneHandle, "done", lambda self: False)
    bad = []
    with _Spy() as spy:
        for s in range(2):
            spy.step = s
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).mean().backward()
            grads = [weakref.ref(p.grad) for p in opt.param_groups[0]["params"]]
            opt.step()
            opt.zero_grad(set_to_none=True)
            alive = spy.alive(s) + (["grads"] if any(r() is not None for r in grads) else [])
            if alive or opt._pipeline._applied:
                bad.append(f"step {s}: {alive} alive, {len(opt._pipeline._applied)} states held after step, zero_grad")
    assert spy.refs, "the spy saw no tensors"
    assert not bad, bad
    assert len(opt._pipeline._release._landing) == 2 * len(opt.waves)  # kept for synchronize(), tensors gone
    opt.synchronize()
    assert not opt._pipeline._release._landing
    opt.close()
