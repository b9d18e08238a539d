"""The contract by construction: ``step()`` orders its updates before whatever comes next.

Nine ordinary training loops, each with the defaults (overlap on), compared with ``torch.equal`` against the same
loop driving ``torch.optim.Muon`` + ``torch.optim.AdamW``. Before the step barrier ([Note: the step barrier] in
``overlap_muon/_runtime.py``) each of them gave a different model or wasted memory with overlap on. Cases 1, 6, 7
and 8 also run with ``async_step=True``, whose contract covers them.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, TinyNet, full_mismatches, fully_shard_tiny, local, torch_ref_opts, train_pair

X = [torch.randn(4, 12, generator=torch.Generator().manual_seed(300 + s)) for s in range(6)]
# A test seam makes NS slow, as a large model's is, so that the updates are still in flight when the loop reads or
# writes after step(): each case fails deterministically without the barrier. Every user-facing option is default.
SLOW = dict(_testing=TestingSeam(ns_delay_s=0.02))
MODES = [pytest.param({}, id="default"), pytest.param({"async_step": True}, id="async_step")]
# test_8_gradients_reduced_by_hand keeps async_step at world 2 in the default tier (the mode the reads matter most in)
_MODES_8 = [pytest.param({}, id="default", marks=pytest.mark.slow), MODES[1]]


def _pair(model_cls=TinyNet, **kw):
    """(model, OverlapMuon, reference model, [torch Muon, torch AdamW]) on identical weights."""
    torch.manual_seed(0)
    model = model_cls()
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP, **{**SLOW, **kw})
    return model, opt, ref, torch_ref_opts(ref)


def _differ(a: nn.Module, b: nn.Module) -> list[str]:
    return [n for (n, p), q in zip(a.named_parameters(), b.parameters()) if not torch.equal(local(p).detach(), q)]


def _train(model, opt, ref, ref_opts, steps, between=None) -> None:
    train_pair(model, opt, ref, ref_opts, X, steps, between)


def _finish(model, opt, ref) -> list[str]:
    """Wait for everything, compare with the reference, close."""
    opt.synchronize()
    bad = _differ(model, ref)
    opt.close()
    return bad


def _state_bytes(*opts: torch.optim.Optimizer) -> int:
    return sum(local(v).numel() * v.element_size() for o in opts for st in o.state.values() for v in st.values()
               if isinstance(v, torch.Tensor))


# ---------------------------------------------------------------------------------------------------------------
# 1: static gradient buffers zeroed in place right after step()
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_1_zero_grad_in_place_right_after_step(mode):
    """CUDA-graph and TransformerEngine loops keep ``.grad`` allocated. Bug: the queued apply committed momentum
    from the zeroed ``.grad``; wrong from step 0."""
    model, opt, ref, ref_opts = _pair(**mode)
    for s in range(3):
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            m(X[s]).pow(2).mean().backward()
            for o in opts:
                o.step()
            m.zero_grad(set_to_none=False)
    assert not _finish(model, opt, ref)


# ---------------------------------------------------------------------------------------------------------------
# 2: warm-up steps, then the initial weights and optimizer state reloaded
# ---------------------------------------------------------------------------------------------------------------
def test_2_model_load_state_dict_right_after_warmup_steps():
    """modded-nanogpt warms its kernels up with a few steps, then restores the initial model and optimizer.
    Bug: the late applies landed on the reloaded weights."""
    model, opt, ref, ref_opts = _pair()
    init_model, init_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    init_ref = [copy.deepcopy(o.state_dict()) for o in ref_opts]
    _train(model, opt, ref, ref_opts, range(2))
    model.load_state_dict(init_model)
    opt.load_state_dict(init_opt)
    ref.load_state_dict(init_model)
    for o, sd in zip(ref_opts, init_ref):
        o.load_state_dict(sd)
    assert not _differ(model, ref)  # the reloaded weights stay as loaded
    _train(model, opt, ref, ref_opts, range(2, 5))
    assert not _finish(model, opt, ref)


# ---------------------------------------------------------------------------------------------------------------
# 3: a step post-hook reads the weights
# ---------------------------------------------------------------------------------------------------------------
def test_3_step_post_hook_reads_updated_weights():
    """torchtitan precomputes float8 scales in an optimizer step post-hook. Bug: it read pre-update weights."""
    model, opt, ref, ref_opts = _pair()
    seen, ref_seen = [], []
    opt.register_step_post_hook(lambda *_: seen.append([p.detach().clone() for p in model.parameters()]))
    ref_opts[1].register_step_post_hook(lambda *_: ref_seen.append([p.detach().clone() for p in ref.parameters()]))
    _train(model, opt, ref, ref_opts, range(3))
    assert len(seen) == len(ref_seen) == 3
    assert all(torch.equal(a, b) for snap, ref_snap in zip(seen, ref_seen) for a, b in zip(snap, ref_snap))
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# 4: torch.distributed.optim.PostLocalSGDOptimizer around the optimizer (world 1 and 2)
# ---------------------------------------------------------------------------------------------------------------
def _post_local_sgd_body(rank, world):
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    model, opt, ref, ref_opts = _pair()
    wrapped = PostLocalSGDOptimizer(opt, PeriodicModelAverager(period=1, warmup_steps=0))
    ref_avg = PeriodicModelAverager(period=1, warmup_steps=0)
    for s in range(4):
        x = X[(s + rank) % len(X)]  # local SGD: each rank trains on its own data, then the params are averaged
        model(x).pow(2).mean().backward()
        wrapped.step()
        wrapped.zero_grad()
        ref(x).pow(2).mean().backward()
        for o in ref_opts:
            o.step()
        ref_avg.average_parameters([p for o in ref_opts for p in o.param_groups[0]["params"]])  # those with a grad
        for o in ref_opts:
            o.zero_grad()
    return _finish(model, opt, ref)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2])
def test_4_post_local_sgd_optimizer_around_it(world):
    """Bug: the averager read and wrote the params before the Muon updates landed; both ranks drifted."""
    assert run_ranks(_post_local_sgd_body, world, timeout=120) == [[]] * world


# ---------------------------------------------------------------------------------------------------------------
# 5: FSDP2's model.unshard() before the forward (world 1 and 2)
# ---------------------------------------------------------------------------------------------------------------
def _unshard_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    full = TinyNet()
    ref = copy.deepcopy(full)
    ref_opts = torch_ref_opts(ref)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("remat",))
    model = copy.deepcopy(full)
    fully_shard_tiny(model, mesh)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, **HP, **SLOW)
    for s in range(3):
        model.unshard()  # explicit prefetch, as in PyTorch's FSDP2 example: gathers before any forward pre-hook
        model(X[s]).pow(2).mean().backward()  # every rank the same batch: FSDP2's average is the batch's gradient
        opt.step()
        opt.zero_grad()
        ref(X[s]).pow(2).mean().backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    opt.synchronize()
    bad = full_mismatches(model, ref)
    opt.close()
    return bad


@pytest.mark.timeout(150)
@pytest.mark.parametrize("world", [1, 2])
def test_5_fsdp2_unshard_before_forward(world):
    """Bug: FSDP2 gathered the shards before any forward pre-hook of ours could wait; every param differed."""
    assert run_ranks(_unshard_body, world, timeout=120) == [[]] * world


# ---------------------------------------------------------------------------------------------------------------
# 6: gradual unfreezing, weights read in a parent
# ---------------------------------------------------------------------------------------------------------------
class FusedQKV(nn.Module):
    """The parent builds a fused QKV from its children's weights: q/k/v's own forwards never run."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v = (nn.Linear(12, 12, bias=False) for _ in range(3))
        self.out = nn.Linear(36, 12, bias=False)
        self.norm = nn.LayerNorm(12)

    def forward(self, x):
        return self.out(F.linear(self.norm(x), torch.cat([self.q.weight, self.k.weight, self.v.weight])))


@pytest.mark.parametrize("mode", MODES)
def test_6_gradual_unfreezing_with_weights_read_in_a_parent(mode):
    """Bug: which params get a forward wait was decided once, at the first step; q/k/v, frozen then, were read
    stale once unfrozen. (``async_step``: coverage is now checked whenever the set of params with a gradient
    grows.)"""
    torch.manual_seed(0)
    model = FusedQKV()
    ref = copy.deepcopy(model)
    for m in (model, ref):
        for lin in (m.q, m.k, m.v):
            lin.weight.requires_grad_(False)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, wave_slots=1, **HP, **SLOW, **mode)
    ref_opts = torch_ref_opts(ref)
    with pytest.warns(UserWarning, match="q.weight") if mode else contextlib.nullcontext():
        _train(model, opt, ref, ref_opts, range(2))
        for m in (model, ref):
            for lin in (m.q, m.k, m.v):
                lin.weight.requires_grad_(True)
        _train(model, opt, ref, ref_opts, range(2, 5))
    assert not _finish(model, opt, ref)


# ---------------------------------------------------------------------------------------------------------------
# 7: roll back the optimizer between backward() and step()
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_7_optimizer_load_state_dict_between_backward_and_step(mode):
    """A spike guard reloads the last good optimizer state after backward. Bug: that step applied no Muon update
    at all (the waves backward had launched were dropped and never launched again)."""
    model, opt, ref, ref_opts = _pair(**mode)
    _train(model, opt, ref, ref_opts, range(2))
    good = {id(o): copy.deepcopy(o.state_dict()) for o in [opt, *ref_opts]}
    _train(model, opt, ref, ref_opts, range(2, 3), between=lambda m, opts, s: [o.load_state_dict(good[id(o)])
                                                                              for o in opts])
    _train(model, opt, ref, ref_opts, range(3, 4))
    assert not _finish(model, opt, ref)


# ---------------------------------------------------------------------------------------------------------------
# 8: gradients reduced by hand with in-place collectives (world 1 and 2)
# ---------------------------------------------------------------------------------------------------------------
def _by_hand(how: str, grad: torch.Tensor) -> None:
    world = dist.get_world_size()
    if how == "all_reduce":
        dist.all_reduce(grad)
    elif how == "reduce_scatter_tensor":  # each rank's chunk of the stacked gradients: the sum over ranks
        with warnings.catch_warnings():  # deprecated in torch 2.13 for reduce_scatter_single; still used widely
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(grad, torch.cat([grad] * world))
    else:
        dist.broadcast(grad, src=0)


def _by_hand_body(rank, world, how, mode):
    model, opt, ref, ref_opts = _pair(**mode)
    for s in range(3):
        x = X[(s + rank) % len(X)]  # each rank its own batch: the hand reduction makes the replicas agree
        for m, opts in ((model, [opt]), (ref, ref_opts)):
            m(x).pow(2).mean().backward()
            for p in m.parameters():
                _by_hand(how, p.grad)
            for o in opts:
                o.step()
                o.zero_grad()
    opt.synchronize()
    bad, reruns = _differ(model, ref), opt.stats["reruns"]
    opt.close()
    return bad, reruns


@pytest.mark.timeout(150)
@pytest.mark.parametrize("mode", _MODES_8)
@pytest.mark.parametrize("how", ["all_reduce", "reduce_scatter_tensor", "broadcast"])
@pytest.mark.parametrize("world", [pytest.param(1, marks=pytest.mark.slow), 2])  # world 1: the long tier
def test_8_gradients_reduced_by_hand(world, how, mode):
    """modded-nanogpt's simple trainer all-reduces gradients by hand (no DDP). Bug: c10d writes in place without
    moving a version counter, so the waves built from each rank's own gradient were committed; the ranks drifted
    apart. Now the collectives bump the counters ([Note: in-place collectives] in ``_version_fix.py``)."""
    res = run_ranks(_by_hand_body, world, how, mode, timeout=120)
    assert all(not bad for bad, _ in res), res
    assert all(reruns > 0 for _, reruns in res), res  # the stale check saw the edit


# ---------------------------------------------------------------------------------------------------------------
# 9: LoRA: the base weights frozen
# ---------------------------------------------------------------------------------------------------------------
class LoRALinear(nn.Module):
    def __init__(self, d_in: int, d_out: int, rank: int = 2) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.lora_a = nn.Linear(d_in, rank, bias=False)
        self.lora_b = nn.Linear(rank, d_out, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.1)

    def forward(self, x):
        return self.base(x) + self.lora_b(self.lora_a(x))


class LoRANet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(12)
        self.blocks = nn.ModuleList(LoRALinear(12, 12) for _ in range(3))

    def forward(self, x):
        x = self.norm(x)
        for b in self.blocks:
            x = x + F.gelu(b(x))
        return x


def test_9_lora_frozen_base_costs_no_optimizer_memory():
    """Bug: momentum for every frozen matrix and AdamW moments for every frozen vector, created at construction:
    16x torch's state bytes. Now a param gets state at its first gradient, as in torch."""
    torch.manual_seed(0)
    model = LoRANet()
    for n, p in model.named_parameters():
        p.requires_grad_("lora_" in n)
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    ref_opts = torch_ref_opts(ref)
    assert _state_bytes(opt) == 0
    _train(model, opt, ref, ref_opts, range(3))
    opt.synchronize()
    assert _state_bytes(opt) == _state_bytes(*ref_opts) > 0
    assert len(opt.state) == sum(len(o.state) for o in ref_opts)
    assert not _finish(model, opt, ref)
