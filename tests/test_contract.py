"""torch.optim's contract in overlap mode: only ``step()`` changes params and state, with the gradients and
hyper-parameters current at that call. Each test is a training loop a user of torchtitan, Megatron or
modded-nanogpt writes, compared with ``torch.equal`` against ``torch.optim.Muon`` + ``torch.optim.AdamW`` (world 1)
or against the same distributed model with ``overlap=False`` (FSDP2 + TP)."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, TinyNet, build_dtensor_model, local, train_pair

X = [torch.randn(4, 12, generator=torch.Generator().manual_seed(100 + s)) for s in range(4)]


def _pair(model_cls=TinyNet, **kw):
    """(model, OverlapMuon, reference model, torch Muon, torch AdamW) on identical weights."""
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP, **kw)
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    mu = torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **HP)
    aw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)
    return model, opt, ref, mu, aw


def _equal(a: nn.Module, b: nn.Module) -> list[str]:
    return [n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(local(p).detach(), q)]


def _loop(model, opt, ref, ref_opts, between=None, steps=3):
    train_pair(model, opt, ref, ref_opts, X, range(steps), between)
    opt.synchronize()


# ---------------------------------------------------------------------------------------------------------------
# 1, 2: gradients clipped and hyper-parameters set between backward and step()
# ---------------------------------------------------------------------------------------------------------------
def test_clip_grad_norm_after_backward_is_exact():
    """Bug: Muon params got the unclipped gradient (the waves had read it during backward): max diff 2e-3."""
    model, opt, ref, mu, aw = _pair()
    _loop(model, opt, ref, [mu, aw], between=lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05))
    assert not _equal(model, ref)
    assert opt.stats["reruns"] > 0  # clipping bit: the speculative waves were re-run
    opt.close()


def test_grad_scaler_unscale_is_exact():
    """Bug (found by a break test): ``GradScaler.unscale_`` divides the gradients with
    ``torch._amp_foreach_non_finite_check_and_unscale_``, which moves no version counter in torch 2.13, even on
    plain tensors, so overlap mode committed the waves computed from the still-scaled gradients (4.2e-3 off
    ``torch.optim.Muon`` at step 1, no re-run). Now the op bumps them ([Note: DTensor foreach versions])."""
    model, opt, ref, mu, aw = _pair()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    for s in range(3):
        scaler.scale(model(X[s]).pow(2).mean()).backward()
        scaler.unscale_(opt)
        for p, q in zip(model.parameters(), ref.parameters()):
            q.grad = p.grad.clone()  # the reference gets exactly the unscaled gradients
        scaler.step(opt)
        scaler.update()
        mu.step()
        aw.step()
        opt.zero_grad()
        mu.zero_grad()
        aw.zero_grad()
    opt.synchronize()
    assert not _equal(model, ref)
    assert opt.stats["reruns"] > 0
    opt.close()


@pytest.mark.parametrize("edit, cause, fix", [
    (lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05), "grad_edited:clip_grad_norm_",
     "OverlapMuon(max_grad_norm=...)"),
    (lambda m, o, s: [p.grad.mul_(0.5) for p in m.parameters()], "grad_edited", "post-accumulate-grad hook"),
    (lambda m, o, s: [setattr(p, "grad", p.grad * 0.5) for p in m.parameters()], "grad_replaced", "inside step()"),
    (lambda m, o, s: o[0].param_groups[0].update(momentum=0.9 - 0.01 * s), "hyper", "before backward")],
    ids=["clip", "mul_", "replaced", "momentum"])
def test_reruns_name_their_cause_and_fix(edit, cause, fix):
    """Each re-run kind is counted under its cause (``stats["reruns.<cause>"]``) and warned once with its fix."""
    model, opt, ref, mu, aw = _pair()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _loop(model, opt, ref, [mu, aw], between=edit)
    said = [str(w.message) for w in caught if "re-ran" in str(w.message)]
    assert not _equal(model, ref)
    assert opt.stats[f"reruns.{cause}"] == opt.stats["reruns"] > 0, dict(opt.stats)
    assert len(said) == 1 and fix in said[0], said
    opt.close()


def test_lr_and_momentum_set_after_backward_are_used():
    """Bug: lr changed 0.02 -> 0.01 after backward, the update had the norm of lr 0.02 (modded-nanogpt's schedule
    and momentum warm-up set both between backward and step)."""
    model, opt, ref, mu, aw = _pair()

    def sched(m, opts, s):
        for o in opts:
            if not isinstance(o, torch.optim.AdamW):
                o.param_groups[0]["lr"] = 0.01 / (s + 1)  # the Muon group
                o.param_groups[0]["momentum"] = 0.85 + 0.03 * s

    _loop(model, opt, ref, [mu, aw], between=sched)
    assert not _equal(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 3: weights read outside their module's forward
# ---------------------------------------------------------------------------------------------------------------
class FusedQKV(nn.Module):
    """The parent reads the children's weights itself (a fused-QKV pattern): q/k/v's forwards never run."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(12, 12, bias=False) for _ in range(3))
        self.lin = nn.Linear(36, 12, bias=False)
        self.out = nn.Linear(12, 12, bias=False)
        self.norm = nn.LayerNorm(12)

    def forward(self, x):
        h = F.linear(self.norm(x), torch.cat([self.q.weight, self.k.weight, self.v.weight]))
        return self.out(F.linear(h, self.lin.weight))


def test_weights_read_outside_their_module_never_stale():
    """Bug: q/k/v/lin's forward pre-hooks never ran, so the next forward read them before their update landed.
    Now: one warning naming them, then the root's forward waits for them; results equal torch's."""
    model, opt, ref, mu, aw = _pair(FusedQKV, wave_slots=1, async_step=True)  # forward waits: async_step only
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        _loop(model, opt, ref, [mu, aw], steps=4)
    msgs = [str(x.message) for x in w if "no forward of the module" in str(x.message)]
    assert len(msgs) == 1 and all(n in msgs[0] for n in ("q.weight", "k.weight", "v.weight", "lin.weight"))
    assert "out.weight" not in msgs[0]
    assert not _equal(model, ref)
    opt.close()


def test_register_wait_gives_a_precise_wait_point():
    model, opt, ref, mu, aw = _pair(FusedQKV, async_step=True)
    opt.register_wait(model, [model.q.weight, model.k.weight, model.v.weight, model.lin.weight])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback warning: every param is covered
        _loop(model, opt, ref, [mu, aw])
    assert not _equal(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 4: backward without step
# ---------------------------------------------------------------------------------------------------------------
def test_backward_without_step_changes_nothing():
    """Bug: a forward+backward with no step() (a gradient probe) changed the weights; torch's own test loop
    (closure(), zero_grad(), backward + step) raised "received another gradient after its wave was launched"."""
    model, opt, ref, mu, aw = _pair()
    before = [p.detach().clone() for p in model.parameters()]
    model(X[0]).pow(2).mean().backward()  # a probe
    opt.synchronize()
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
    assert not opt.state  # no state before the first step ([Note: lazy state])
    opt.zero_grad()
    for s in range(3):
        for m, os_ in ((model, [opt]), (ref, [mu, aw])):
            def closure(m=m, os_=os_, s=s):
                for o in os_:
                    o.zero_grad()
                loss = m(X[s]).pow(2).mean()
                loss.backward()
                return loss
            closure()  # evaluation closure (torch's test loop), then the training closure inside step()
            for o in os_:
                o.zero_grad()
            m(X[s + 1]).pow(2).mean().backward()
            for o in os_:
                o.step()
    opt.synchronize()
    assert not _equal(model, ref)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 5: an optimizer rebuilt on the same model
# ---------------------------------------------------------------------------------------------------------------
def test_rebuilt_optimizer_drives_alone():
    """Bug: the dropped optimizer's hooks stayed alive (they held it), so every update was applied twice."""
    model, opt, ref, mu, aw = _pair()
    with pytest.raises(RuntimeError, match="close"):
        OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    del opt
    gc.collect()
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)  # the old one is gone with its hooks
    _loop(model, opt, ref, [mu, aw])
    assert not _equal(model, ref)
    opt.close()
    opt2 = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)  # close() releases the model too
    opt2.close()


# ---------------------------------------------------------------------------------------------------------------
# 7: reading params right after step()
# ---------------------------------------------------------------------------------------------------------------
def test_ema_after_step_with_wait_for():
    """``AveragedModel.update_parameters`` right after step() reads the weights outside any forward: the recipe
    ``opt.wait_for(model.parameters())`` (or ``opt.synchronize()``) makes it read the updated ones."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    model, opt, ref, mu, aw = _pair()
    ema, ema_ref = (AveragedModel(m, multi_avg_fn=get_ema_multi_avg_fn(0.9)) for m in (model, ref))

    def after(m, os_):
        if m is model:
            opt.wait_for(model.parameters())
        (ema if m is model else ema_ref).update_parameters(m)

    for s in range(3):
        for m, os_ in ((model, [opt]), (ref, [mu, aw])):
            m(X[s]).pow(2).mean().backward()
            for o in os_:
                o.step()
                o.zero_grad()
            after(m, os_)
    assert not _equal(ema.module, ema_ref.module)
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 3, 6 at world 2 (DDP), and 1, 2, 4 under FSDP2 + TP at 2x2
# ---------------------------------------------------------------------------------------------------------------
def _ddp_body(rank, world, how):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = TinyNet()
    ref = copy.deepcopy(base)
    xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * s + rank)) for s in range(3)]
    if how == "wrapped":  # OverlapMuon(ddp_model): attached automatically
        model = DDP(base, gradient_as_bucket_view=True)
        opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    else:  # DDP wraps the model, the optimizer is built on the inner module: found at its first forward
        model = DDP(base)
        opt = OverlapMuon(base, adamw_kwargs=ADAMW_KW, **HP)
    ref_ddp = DDP(ref)
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    mu = torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **HP)
    aw = torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)
    for s in range(3):
        for m, os_ in ((model, [opt]), (ref_ddp, [mu, aw])):
            m(xs[s]).pow(2).mean().backward()
            for o in os_:
                o.step()
                o.zero_grad()
    opt.synchronize()
    bad = _equal(base, ref)
    reruns = opt.stats["reruns"]
    opt.close()
    return bad, reruns


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["wrapped", "unattached"])
def test_ddp_exact_with_or_without_attach(how):
    """Bug: with DDP and no attach_ddp the waves read each rank's own un-averaged gradient and the replicas
    drifted apart silently. Now ``OverlapMuon(ddp_model)`` attaches itself, and an optimizer built on the inner
    module finds the DDP (without bucket views) at its first forward and attaches to it: exact, no re-run."""
    res = run_ranks(_ddp_body, 2, how, timeout=90)
    for bad, reruns in res:
        assert not bad, bad
        assert reruns == 0


def _fsdp_tp_body(rank, world, case):
    R, T = 2, 2
    results, reruns = [], 0
    for overlap in (True, False):
        torch.manual_seed(0)
        model, mesh = build_dtensor_model(TinyNet(), R, T)
        opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, **HP)
        for s in range(3):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
            model(x).pow(2).mean().backward()
            if case == "probe":  # a backward without step, then the real one
                opt.zero_grad()
                model(x * 2).pow(2).mean().backward()
            elif case == "clip":  # an in-place gradient edit after backward (clip_grad_norm_ itself cannot mix
                for p in model.parameters():  # TinyNet's 1-D and 2-D meshes in torch 2.13: aten.stack raises)
                    p.grad.mul_(0.5)
            elif case == "foreach":  # [Note: DTensor foreach versions]: torch 2.13 bumps no DTensor version here
                torch._foreach_mul_([p.grad for p in model.parameters()], 0.5)
            elif case == "clip_value":  # torch's clip_grad_value_ clamps in place with foreach ops
                torch.nn.utils.clip_grad_value_(model.parameters(), 1e-3)
            elif case == "hyper":
                opt.param_groups[0]["lr"] = 0.01 / (s + 1)
                opt.param_groups[0]["momentum"] = 0.85 + 0.03 * s
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        results.append([local(p).detach().clone() for p in model.parameters()])
        if overlap:
            reruns = opt.stats["reruns"]
        opt.close()
    return [n for n, (a, b) in enumerate(zip(*results)) if not torch.equal(a, b)], reruns


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", ["plain", "clip", pytest.param("foreach", marks=pytest.mark.slow),
                                  pytest.param("clip_value", marks=pytest.mark.slow), "hyper",
                                  pytest.param("probe", marks=pytest.mark.slow)])
def test_fsdp_tp_2x2_overlap_equals_sync(case):
    """Also: a plain loop re-runs nothing (FSDP2 and TP leave the gradients alone once their hooks fired), so
    the overlap is kept; clipping and a changed momentum re-run waves. ``foreach``/``clip_value``: bug, the
    in-place foreach ops that torch's clipping uses moved no DTensor version counter, so the waves computed from
    the unclipped gradients were committed silently; ``overlap_muon._version_fix`` now makes them bump it."""
    res = run_ranks(_fsdp_tp_body, 4, case, timeout=150)
    assert all(not bad for bad, _ in res), res
    assert all((reruns == 0) == (case in ("plain", "probe")) for _, reruns in res), res


def _ddp_fused_body(rank, world):
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = FusedQKV()
    ref = copy.deepcopy(base)
    model = DDP(base, gradient_as_bucket_view=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
        mu = torch.optim.Muon([p for p in ref.parameters() if p.ndim == 2], **HP)
        aw = torch.optim.AdamW([p for p in ref.parameters() if p.ndim != 2], **ADAMW_KW)
        ref_ddp = DDP(ref)
        for s in range(3):
            x = torch.randn(4, 12, generator=torch.Generator().manual_seed(10 * s + rank))
            for m, os_ in ((model, [opt]), (ref_ddp, [mu, aw])):
                m(x).pow(2).mean().backward()
                for o in os_:
                    o.step()
                    o.zero_grad()
    opt.synchronize()
    bad = _equal(base, ref)
    opt.close()
    return bad


@pytest.mark.timeout(120)
def test_ddp_weights_read_outside_their_module():
    assert all(not bad for bad in run_ranks(_ddp_fused_body, 2, timeout=90))


def test_world_size_one_sanity():
    assert not dist.is_initialized()


# ---------------------------------------------------------------------------------------------------------------
# max_grad_norm: the built-in clip, exact, keeping the overlap where clipping does not bite
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_norm", [0.05, 1e6])
def test_max_grad_norm_equals_clip_grad_norm(max_norm):
    model, opt, ref, mu, aw = _pair(max_grad_norm=max_norm)
    _loop(model, [opt][0], ref, [mu, aw],
          between=lambda m, o, s: torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm) if m is ref else None)
    assert not _equal(model, ref)
    bites = max_norm < 1
    assert opt.stats["clipped_steps"] == (3 if bites else 0)
    assert (opt.stats["reruns"] > 0) == bites  # no clipping: the speculative waves stand
    opt.close()


def test_max_grad_norm_rejects_plain_shards_on_a_domain_and_bad_values():
    with pytest.raises(ValueError, match="max_grad_norm"):
        OverlapMuon(TinyNet(), max_grad_norm=-1.0)


def _clip_2x2_body(rank, world, overlap):
    torch.manual_seed(0)
    model, mesh = build_dtensor_model(TinyNet(), 2, 2)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=overlap, max_grad_norm=0.05, **HP)
    for s in range(3):
        model(torch.randn(4, 12, generator=torch.Generator().manual_seed(s))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    out = [local(p).detach().clone() for p in model.parameters()], opt.stats["clipped_steps"]
    opt.close()
    return out


@pytest.mark.timeout(180)
def test_max_grad_norm_fsdp_tp_2x2_overlap_equals_sync():
    on = run_ranks(_clip_2x2_body, 4, True, timeout=150)
    off = run_ranks(_clip_2x2_body, 4, False, timeout=150)
    for (a, ca), (b, cb) in zip(on, off):
        assert ca == cb == 3
        assert all(torch.equal(x, y) for x, y in zip(a, b))


def _clip_norm_body(rank, world):
    """Issue 46, finding 5 (shown as the price of exactness): ``max_grad_norm`` reduces each DTensor gradient's norm
    by its own collective, as torch's own ``get_total_norm`` does on DTensor gradients: the total is bitwise
    torch's. Stacking the partial norms of a mesh into one collective (tried) changes it at world 4 (3.8e-6 here,
    gloo): the reduction order of a vector differs from a scalar's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    from overlap_muon._clip import clip_grads_by_total_norm_

    mesh = init_device_mesh("cpu", (world,))
    gen = torch.Generator().manual_seed(0)
    grads = [distribute_tensor(torch.randn(16, 8, generator=gen), mesh, [k]) for k in [Shard(0), Shard(1),
                                                                                         Replicate()] * 3]
    want = torch.nn.utils.get_total_norm(grads, foreach=False)
    want = want.full_tensor() if isinstance(want, DTensor) else want
    total, clipped = clip_grads_by_total_norm_(grads, 1e-3)
    return clipped and torch.equal(total, want)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_max_grad_norm_total_is_torchs_on_dtensor_grads(world):
    assert all(run_ranks(_clip_norm_body, world, timeout=100))


def _mismatch_body(rank, world):
    import os

    from tests.models import PlainShardNet, plain_opt

    if rank == 1:
        os.environ["OVERLAP_MUON_BATCH_NS"] = "1"  # a rank-local environment: a misconfigured launcher
    net = PlainShardNet(1, 2, 0, rank)
    try:
        plain_opt(net, 1, 2, 0, rank)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_ranks_with_different_options_fail_at_construction():
    """Ranks whose plans or options differ would pair their exchanges wrongly and hang: a clear error on every
    rank at construction instead (a hash of the plan compared across ranks)."""
    for msg in run_ranks(_mismatch_body, 2, timeout=90):
        assert msg is not None and "different options: batch_ns (OVERLAP_MUON_BATCH_NS): False on ranks 0, True on " \
            "ranks 1; every rank" in msg, msg  # the one option that differs, its values and where


def test_loss_built_from_the_params_without_a_forward_waits_at_step():
    """Found by a break test: a loss built from the weights directly (no forward of the model ever runs) read the
    weights before the last step's update landed: a silent difference. Now, with ``async_step`` (the default step
    waits anyway), ``step()`` sees that no forward wait ran since the last step, waits for its own updates and
    warns once; equal to torch.optim.Muon."""
    
    torch.manual_seed(0)
    model = nn.Module()
    model.a, model.b = nn.Linear(16, 24, bias=False), nn.Linear(24, 16, bias=False)
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, **HP, async_step=True, _testing=TestingSeam(ns_delay_s=0.05))  # the updates land late
    mu = torch.optim.Muon(ref.parameters(), **HP)
    coef = [torch.randn(p.shape, generator=torch.Generator().manual_seed(k)) for k, p in enumerate(model.parameters())]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m, o in ((model, opt), (ref, mu)):
                sum(((p * c) ** 2).sum() for p, c in zip(m.parameters(), coef)).backward()
                o.step()
                o.zero_grad()
    opt.synchronize()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert torch.equal(p.detach(), q.detach())
    assert sum("no forward of the model ran" in str(w.message) for w in caught) == 1
    opt.close()


def _clip_dtensor_tp_body(rank, world, bound=0.5, on_device=False):
    """The break test's case: TP 1x2 DTensors, a real backward, torch's clip_grad_norm_ (default foreach) between
    backward and step; the reference gets exactly the clipped gradients. ``on_device``: the clip wrapper acts as on
    a device (no host read of its coefficient)."""
    from torch.distributed.device_mesh import init_device_mesh

    from overlap_muon import _version_fix as version_fix
    if on_device:
        version_fix.host_read_free = lambda device: False
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    class Two(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(16, 24, bias=False)
            self.b = nn.Linear(24, 16, bias=False)

        def forward(self, x, r):
            return (self.a(x) * r).sum() + (self.b(r) * x).sum()

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    full = Two()
    model = copy.deepcopy(full)
    parallelize_module(model, mesh, {"a": ColwiseParallel(output_layouts=Replicate()),
                                     "b": RowwiseParallel(input_layouts=Replicate())})
    opt = OverlapMuon(model, device_mesh=mesh, overlap=True, **HP)
    ref = torch.optim.Muon(list(full.parameters()), **HP)
    for s in range(3):
        gen = torch.Generator().manual_seed(s)
        x, r = torch.randn(8, 16, generator=gen), torch.randn(8, 24, generator=gen)
        model(x, r).backward()
        for st in list(opt._rt.pipeline._pending.values()) if on_device else []:
            if st.h_pack is not None:  # a pack after the clip reads its bytes: no re-run (right, but none to count)
                st.h_pack.settle()
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), bound)
        for p, q in zip(full.parameters(), model.parameters()):
            p.grad = q.grad.full_tensor()
        opt.step()
        ref.step()
        opt.zero_grad()
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), full.parameters()) if not torch.equal(p.full_tensor(), q)]
    reruns = opt.stats["reruns"]
    opt.close()
    return bad, reruns


@pytest.mark.timeout(120)
@pytest.mark.parametrize("on_device,bound", [(False, 0.5), (True, 0.5), (True, 1e6)])
def test_clip_grad_norm_of_dtensor_grads_is_exact_with_overlap(on_device, bound):
    """Bug (found by a break test): with DTensor gradients, torch's ``clip_grad_norm_`` scales them with
    ``torch._foreach_mul_``, which in torch 2.13 moves neither version counter, so overlap mode committed the
    waves computed from the unclipped gradients (1.6e-3 off ``torch.optim.Muon`` after one step). Now the
    in-place foreach ops bump DTensor versions ([Note: DTensor foreach versions]) and those waves re-run. Where
    the clip wrapper reads no coefficient (a device), a clip that bites re-runs them by their content, and one
    that does not bite (its multiply by 1.0 moved the counters) re-runs nothing."""
    res = run_ranks(_clip_dtensor_tp_body, 2, bound, on_device, timeout=90)
    assert all(not bad and (reruns > 0) == (bound < 1) for bad, reruns in res), res


def test_version_fix_makes_foreach_bump_dtensor_versions():
    """What the fix does, on a world-1 mesh: ``_foreach_mul_`` and ``clip_grad_norm_`` move a DTensor gradient's
    version, the unscale op moves a plain tensor's; values are untouched; TorchScript still compiles calls to the
    wrapped functions and pickle still finds them (a break test found both broken by the first version)."""
    res = run_ranks(_version_fix_body, 1, timeout=60)
    assert res[0] == (True, True, True, True, True, True), res


def _version_fix_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from overlap_muon import _version_fix as version_fix
    mesh = init_device_mesh("cpu", (1,))
    version_fix.install(mesh)
    g = distribute_tensor(torch.arange(16.0).view(4, 4), mesh, [Shard(0)])
    v = g._version
    torch._foreach_mul_([g], 0.5)
    p = nn.Parameter(distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)]))
    p.grad = g
    v2 = g._version
    torch.nn.utils.clip_grad_norm_([p], 1e-3)
    x = torch.arange(3.0)
    torch._foreach_mul_([x], 2.0)
    y = torch.ones(2)
    vy = y._version
    torch._amp_foreach_non_finite_check_and_unscale_([y], torch.zeros(1), torch.full((1,), 0.5))

    def halve(xs: list[torch.Tensor]) -> None:
        torch._foreach_mul_(xs, 0.5)

    scripted = torch.jit.script(halve)
    z = [torch.ones(2)]
    scripted(z)
    import pickle

    return (g._version > v2 > v, version_fix.foreach_bumps_dtensor_versions(mesh),
            torch.equal(x, torch.tensor([0.0, 2.0, 4.0])), y._version > vy and torch.equal(y, torch.full((2,), 0.5)),
            torch.equal(z[0], torch.full((2,), 0.5)),
            pickle.loads(pickle.dumps(torch._foreach_mul_)) is torch._foreach_mul_)


def _version_fix_lifetime_body(rank, world):
    import logging

    from overlap_muon import _version_fix as version_fix
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("overlap_muon").addHandler(handler)
    logging.getLogger("overlap_muon").setLevel(logging.INFO)
    originals = (dist.all_reduce, getattr(torch, version_fix.AMP_UNSCALE))
    a, b = OverlapMuon(nn.Linear(4, 4)), OverlapMuon(nn.Linear(4, 4))
    wrapped = dist.all_reduce is not originals[0] and getattr(torch, version_fix.AMP_UNSCALE) is not originals[1]
    logged = [r.getMessage() for r in records if "wrapped" in r.getMessage()]
    a.close()
    kept = dist.all_reduce is not originals[0]  # b still needs it
    b.close()
    restored = (dist.all_reduce, getattr(torch, version_fix.AMP_UNSCALE)) == originals
    return wrapped, len(logged), kept, restored, set(version_fix._done)


@pytest.mark.timeout(120)
def test_version_fix_is_logged_and_removed_with_the_last_overlap_optimizer():
    """Building an optimizer patches torch functions for the whole process: it says so once (rank 0, logger
    ``overlap_muon``), and the last overlap-mode optimizer to close puts the originals back."""
    ((wrapped, logged, kept, restored, left),) = run_ranks(_version_fix_lifetime_body, 1, timeout=90)
    assert wrapped and logged == 1 and kept and restored and not left


@pytest.mark.parametrize("when", ["live", "closed"])
def test_swap_tensors_works_on_a_model_it_drives(when):
    """Bug (found with HF Trainer moving a fully_shard'ed model): the ownership registry held a weak reference to
    every param, and ``torch.utils.swap_tensors`` (``model.to()`` / ``to_empty()`` with swapping on, DTensor moves)
    refuses such a tensor, before and after ``close()``."""
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        model, opt, ref, mu, aw = _pair()
        if when == "closed":
            opt.close()
        torch.save(next(model.parameters()), io.BytesIO())  # the owner tag pickles (a weakref would not)
        model.to(torch.float64)
        model.to(torch.float32)
        model.to_empty(device="cpu")
        for p in model.parameters():
            torch.utils.swap_tensors(p, torch.nn.Parameter(torch.zeros_like(p)))
    finally:
        torch.__future__.set_swap_module_params_on_conversion(False)
    opt.close()


def _adamw_count_body(rank, world):
    model = TinyNet()
    if rank == 1:
        model.extra = nn.Parameter(torch.zeros(3))
    try:
        OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_ranks_with_different_adamw_params_fail_at_construction():
    """The step's agreement carries one flag per AdamW param ([Note: lazy state]): ranks that hold different
    numbers of them get a ValueError at construction, on every rank, instead of a mismatched collective later."""
    msgs = run_ranks(_adamw_count_body, 2, timeout=90)
    assert all(m and "different numbers of AdamW params" in m for m in msgs), msgs
