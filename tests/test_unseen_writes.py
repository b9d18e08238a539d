"""Writes no record sees, between backward and ``step()``: each loop is one users write (PyTorch's distributed
tutorial, ``vector_to_parameters``, collectives below the wrapped names, DDP built after the optimizer), compared
with ``torch.equal`` against ``torch.optim.Muon`` + ``torch.optim.AdamW`` after every step. The records (version
counters, wrapped functions) miss them all; the commit's content check catches them by their bytes ([Note: content
fingerprints] in ``overlap_muon/_wave_state.py``). Each was silent before it (checked on the code without it)."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.dist_utils import run_ranks
from tests.models import TinyNet
from tests.test_wave_inputs import MODES, _diff, _opt, _pair, _ref_opts, _run


def _grads(m: nn.Module) -> list[torch.Tensor]:
    return [p.grad for p in m.parameters() if p.grad is not None]


def _edit(kind: str):
    """A write to every gradient between backward and ``step()`` that moves no version counter."""
    def edit(m, opts, s):
        if kind == "data":  # .data has a version counter of its own
            for g in _grads(m):
                g.data.mul_(0.5)
        elif kind == "vector_to_parameters":  # torch's own helper: assigns .data
            gs = _grads(m)
            vec = torch.nn.utils.parameters_to_vector(gs)
            torch.nn.utils.vector_to_parameters(vec * 0.5, gs)
        elif kind == "numpy":  # the planted write: no code of the optimizer names numpy
            for g in _grads(m):
                g.numpy()[...] *= 0.5
    return edit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["data", "vector_to_parameters", "numpy"])
def test_unrecorded_gradient_writes_are_caught(kind, mode):
    """``g.data.mul_``, ``vector_to_parameters`` and (planted, caught with no code written for it) an in-place
    write through ``g.numpy()``: every wave re-runs, bitwise equal to torch after every step."""
    model, opt, ref, ref_opts = _pair(mode)
    assert _run(model, opt, ref, ref_opts, after_backward=_edit(kind)) is None
    assert opt.stats["reruns.content"] > 0, dict(opt.stats)
    opt.close()


@pytest.mark.timeout(120)
def test_content_check_off_misses_them():
    """``content_check=False`` leaves the records alone, and they miss a ``.data`` write: the case this check
    exists for (the same loop as above, no re-run, a difference from torch)."""
    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt, ref_opts = _opt("default", model, content_check=False), _ref_opts(ref)
    assert _run(model, opt, ref, ref_opts, after_backward=_edit("data")) is not None
    assert opt.stats["reruns"] == 0
    opt.close()


def _collective_body(rank, world, kind, mode):
    """Data parallelism by hand after backward, through a path the optimizer does not wrap."""
    from torch.distributed import distributed_c10d

    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt, ref_opts = _opt(mode, model), _ref_opts(ref)
    pg = distributed_c10d._get_default_group()

    def average(m, opts, s):
        for g in _grads(m):
            if kind == "tutorial":  # PyTorch's "Writing Distributed Applications with PyTorch"
                dist.all_reduce(g.data, op=dist.ReduceOp.SUM)
                g.data /= world
            elif kind == "c10d_module":
                distributed_c10d.all_reduce(g)
            else:  # a ProcessGroup method: C++ below every Python name
                pg.allreduce([g]).wait()

    xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(50 * s + rank)) for s in range(4)]
    bad = _run(model, opt, ref, ref_opts, after_backward=average, xs=xs)
    opt.synchronize()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    others = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(others, flat)
    out = bad, opt.stats["reruns"], all(torch.equal(o, others[0]) for o in others)
    opt.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["tutorial", "c10d_module", "process_group"])
def test_gradients_averaged_below_the_wrapped_names(kind, mode):
    """``dist.all_reduce(g.data)`` + ``g.data /= world``, ``distributed_c10d.all_reduce(g)``, and
    ``ProcessGroup.allreduce([g]).wait()`` after backward, on 2 ranks: re-runs, bitwise equal to torch, replicas
    equal."""
    for bad, reruns, replicas_equal in run_ranks(_collective_body, 2, kind, mode, timeout=200):
        assert bad is None, bad
        assert reruns > 0 and replicas_equal


def _ddp_later_body(rank, world, variant, mode, when="after_forward", bucket_view=True):
    """DDP built after the optimizer, not attached by the user; two micro-batches per step, without ``no_sync()``
    (``"accumulate"``) or with it and ``zero_grad(set_to_none=False)`` (``"no_sync"``). ``when``:
    ``"after_forward"``, wrapped after the model's first forward (the optimizer's watch for a DDP has ended: DDP's
    C++ reducer is a writer no record sees); ``"before_forward"``, wrapped before it (found and attached).
    Returns the first differing step, the re-runs and the NS matrices per step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = TinyNet()
    ref = copy.deepcopy(base)
    opt, ref_opts = _opt(mode, base), _ref_opts(ref)
    if when == "after_forward":
        with torch.no_grad():
            base(torch.zeros(1, 12))
    pairs = ((DDP(base, gradient_as_bucket_view=bucket_view), [opt]),
             (DDP(ref, gradient_as_bucket_view=bucket_view), ref_opts))
    xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(30 * s + rank)) for s in range(8)]
    first_bad, ns = None, []
    for s in range(4):
        before = opt.stats["ns_matrices"]
        for ddp, opts in pairs:
            for micro in range(2):
                quiet = variant == "no_sync" and micro == 0
                with ddp.no_sync() if quiet else contextlib.nullcontext():
                    ddp(xs[2 * s + micro]).pow(2).mean().backward()
            for o in opts:
                o.step()
            for o in opts:
                o.zero_grad(set_to_none=variant != "no_sync")
        opt.wait_for(base.parameters())
        ns.append(opt.stats["ns_matrices"] - before)
        bad = _diff(base, ref)
        if bad and first_bad is None:
            first_bad = (s, bad)
    opt.synchronize()
    out = first_bad, opt.stats["reruns"], ns, len(opt.muon_param_names)
    opt.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("variant", ["accumulate", "no_sync"])
def test_ddp_built_after_the_optimizer(variant, mode):
    """DDP's C++ reducer writes the bucket views after a wave has read them: caught by their bytes, bitwise equal
    to torch after every step (the replicas diverged by up to 8e-3 before)."""
    for bad, _reruns, _, _ in run_ranks(_ddp_later_body, 2, variant, mode, timeout=200):
        assert bad is None, bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("bucket_view", [True, False])
def test_ddp_wrapped_later_is_attached(bucket_view, mode):
    """DDP wrapped around the model after the optimizer was built, before its first forward (Hugging Face's
    Trainer and Lightning wrap so, with ``gradient_as_bucket_view=False``): found at its first forward and attached
    as ``OverlapMuon(ddp_model)`` would be, so the waves read DDP's averaged buckets: no re-run, NS once per matrix
    per step from step 2 (gradient accumulation without ``no_sync()``), bitwise equal to torch."""
    for bad, reruns, ns, mats in run_ranks(_ddp_later_body, 2, "accumulate", mode, "before_forward", bucket_view,
                                           timeout=200):
        assert bad is None, bad
        assert reruns == 0 and ns[1:] == [mats] * 3, (reruns, ns)


# ---------------------------------------------------------------------------------------------------------------
# param_groups is the groups; a param that left its group; checkpoints matched by position
# ---------------------------------------------------------------------------------------------------------------
def _regroup(kind: str):
    """Between backward and ``step()``: horovod's LR scaling replaces a group dict; DeepSpeed-style code rebinds
    the whole list to new dicts."""
    def edit(m, opts, s):
        for o in opts:
            if kind == "replace_dict":  # the AdamW group: OverlapMuon's last, the reference AdamW's only one
                if not isinstance(o, torch.optim.Muon):
                    o.param_groups[-1] = dict(o.param_groups[-1], lr=o.param_groups[-1]["lr"] * 0.5)
            else:
                o.param_groups = [dict(g, lr=g["lr"] * 0.5) for g in o.param_groups]
    return edit


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("kind", ["replace_dict", "rebind_list"])
def test_param_groups_replaced_are_followed(kind, mode):
    """Bug: the Muon part followed a replaced group dict or list, the inner AdamW kept the dicts of construction
    time and their old lr (silent)."""
    model, opt, ref, ref_opts = _pair(mode)
    assert _run(model, opt, ref, ref_opts, after_backward=_regroup(kind)) is None
    opt.close()


@pytest.mark.timeout(60)
def test_param_that_left_its_group_is_named():
    """Bug: removing a param from its group said the groups hold "params that are not the model's"."""
    model, opt, ref, ref_opts = _pair("default")
    _run(model, opt, ref, ref_opts, steps=1)
    opt.param_groups[-1]["params"] = opt.param_groups[-1]["params"][:-1]
    model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(ValueError, match=r"left or joined their param group.*'out.weight'|left or joined.*left it"):
        opt.step()
    opt.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_checkpoint_after_pruning_loads_by_position(how, tmp_path):
    """Bug: a checkpoint saved after pruning (or ``parametrize``) mid-training did not load into a model pruned the
    same way ("``down.weight`` vs ``down.weight_orig``"); torch matches by position and resumes bitwise, and so
    does OverlapMuon now. A real mismatch names position, names and shapes."""
    from torch.nn.utils import parametrize, prune

    from tests.test_wave_inputs import X, _Doubled

    def change(m: nn.Module) -> None:
        if how == "prune":
            prune.l1_unstructured(m.down, "weight", amount=0.3)
        else:
            parametrize.register_parametrization(m.down, "weight", _Doubled())

    model, opt, ref, ref_opts = _pair("default")
    assert _run(model, opt, ref, ref_opts, steps=1) is None
    for m in (model, ref):
        change(m)
    assert _run(model, opt, ref, ref_opts, steps=2) is None
    saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    opt.close()
    torch.manual_seed(1)
    fresh = TinyNet()
    change(fresh)
    fresh.load_state_dict(saved_model)
    opt2 = _opt("default", fresh)
    opt2.load_state_dict(saved_opt)
    assert _run(fresh, opt2, ref, ref_opts, steps=2, xs=X[2:]) is None
    bad = copy.deepcopy(saved_opt)
    bad["overlap_muon"]["muon_params"][2] = ("down.weight", [3, 3], None)
    with pytest.raises(ValueError, match=r"Muon param 2: 'down.weight' \(3, 3\).*here"):
        opt2.load_state_dict(bad)
    opt2.close()


# ---------------------------------------------------------------------------------------------------------------
# async_step: pruning or a parametrization right after step() reads the landed update
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["prune", "parametrize"])
def test_async_step_prune_after_step_reads_the_update(how):
    """Bug: under ``async_step``, ``prune.l1_unstructured`` right after ``step()`` made its mask from the weights
    before their update (differing from torch everywhere from then on, no re-run). Pruning and parametrizations
    re-register the weight before they read it; that registration now waits for its update."""
    from torch.nn.utils import parametrize, prune

    from tests.seams import TestingSeam
    from tests.test_wave_inputs import _Doubled

    model, opt, ref, ref_opts = _pair("async_step", seam=TestingSeam(ns_delay_s=0.05))

    def change(m, opts, s):
        if s == 1:
            for lin in (m.up, m.gate, m.down):
                if how == "prune":
                    prune.l1_unstructured(lin, "weight", amount=0.5)
                else:
                    parametrize.register_parametrization(lin, "weight", _Doubled())

    assert _run(model, opt, ref, ref_opts, after_step=change) is None
    opt.close()
