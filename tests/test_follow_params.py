"""The optimizer follows params replaced after it was built ([Note: following the param groups] in
``overlap_muon/_binding.py``).

Accelerate's FSDP2 preparation builds the optimizer first, then ``fully_shard``s the model and swaps every
``param_groups`` entry for its sharded param; a user may also ``fully_shard`` by hand after building it. Before the
optimizer followed the groups, neither trained a single Muon param, silently. Each loop here is compared with
``torch.equal`` against the same batches on an unsharded model driven by ``torch.optim.Muon`` + ``AdamW``.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, TinyNet, full_mismatches, fully_shard_tiny, torch_ref_opts

X = [torch.randn(4, 12, generator=torch.Generator().manual_seed(700 + s)) for s in range(4)]


def _accelerate_fsdp2_order(opt: torch.optim.Optimizer, model: nn.Module, mesh) -> None:
    """What ``Accelerator._prepare_fsdp2`` does to an optimizer built before ``fully_shard`` (accelerate 1.x):
    placeholders carrying each old param's address, ``fully_shard``, then its own switching function. Its FSDP2
    plugin refuses a machine without an accelerator, so its steps are replayed around the real function."""
    from accelerate.utils.fsdp_utils import fsdp2_switch_optimizer_parameters

    old = {n: p.data_ptr() for n, p in model.named_parameters()}
    for group in opt.param_groups:
        for i, p in enumerate(group["params"]):
            group["params"][i] = torch.empty(1, dtype=p.dtype)
            group["params"][i].data_ptr = p.data_ptr()
    fully_shard_tiny(model, mesh)
    new = dict(model.named_parameters())
    fsdp2_switch_optimizer_parameters(opt, {old[n]: new[n] for n in old})


def _body(rank, world, order, steps, **kw):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    ref_opts = torch_ref_opts(ref)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP, **kw)
    mesh = init_device_mesh("cpu", (world,))
    if order == "accelerate":
        _accelerate_fsdp2_order(opt, model, mesh)
    else:
        fully_shard_tiny(model, mesh)
    reruns, in_backward = [], []
    for s in range(steps):
        launched = opt.stats["waves_launched"]
        model(X[s]).pow(2).mean().backward()  # every rank the same batch: FSDP2's average is the batch's gradient
        in_backward.append(opt.stats["waves_launched"] - launched)
        before = opt.stats["reruns"]
        opt.step()
        reruns.append(opt.stats["reruns"] - before)
        opt.zero_grad()
        ref(X[s]).pow(2).mean().backward()
        for o in ref_opts:
            o.step()
            o.zero_grad()
    opt.synchronize()
    bad, trained = full_mismatches(model, ref), opt.stats["ns_matrices"] > 0
    opt.close()
    return bad, trained, reruns, in_backward


@pytest.mark.timeout(200)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("order", ["accelerate", "fully_shard_after"])
def test_params_replaced_after_construction_are_trained(order, world):
    """Bug: Accelerate's FSDP2 order (and ``fully_shard`` after the optimizer) left the optimizer on the old params:
    3 steps changed no Muon param, with no error. Now every param is bitwise the reference's, and no wave re-runs
    (the first step launches every wave in ``step()``; later ones launch in backward, from the new params' hooks)."""
    if order == "accelerate":
        pytest.importorskip("accelerate", reason="Accelerate's own switching function is what this test replays")
    out = run_ranks(_body, world, order, 3, timeout=180)
    for bad, trained, reruns, in_backward in out:
        assert bad == [] and trained and reruns == [0, 0, 0], (bad, trained, reruns)
        assert in_backward[0] == 0 and min(in_backward[1:]) > 0, in_backward  # the hooks moved to the new params


def _state_then_shard_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    model = TinyNet()
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    model(X[0]).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    before = [p.detach().clone() for p in model.parameters()]
    fully_shard_tiny(model, init_device_mesh("cpu", (world,)))
    model(X[1]).pow(2).mean().backward()
    try:
        opt.step()
    except ValueError as e:
        unchanged = all(torch.equal(p.full_tensor().detach(), b) for p, b in zip(model.parameters(), before))
        return str(e), unchanged
    return None, False


@pytest.mark.timeout(120)
def test_sharding_after_state_exists_is_a_clear_error():
    """Momentum of a whole matrix does not fit its shard: a ValueError on every rank, naming the fix, and nothing
    changed (the weights are still those of the first step)."""
    for msg, unchanged in run_ranks(_state_then_shard_body, 2, timeout=100):
        assert msg is not None and "does not fit the new param" in msg and "load_state_dict" in msg, msg
        assert unchanged


def test_foreign_param_in_groups_is_a_clear_error():
    """A group entry that is neither the param it replaced nor one of the model's: a ValueError naming it."""
    model = TinyNet()
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP)
    opt.param_groups[0]["params"][0] = nn.Parameter(torch.zeros(3, 3))
    model(X[0]).pow(2).mean().backward()
    with pytest.raises(ValueError, match=r"not the model's.*\(3, 3\)"):
        opt.step()
    opt.close()
