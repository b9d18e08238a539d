"""Checkpoints: ``OverlapMuon.state_dict()`` / ``load_state_dict()`` and ``torch.distributed.checkpoint`` (DCP).

Every resume test trains ``K`` steps, checkpoints, trains ``N`` more steps (run A), then builds a fresh model and
optimizer from different initial values, loads the checkpoint and trains the same ``N`` steps (run B): A and B must
be bitwise equal (params, Muon momentum, AdamW state), overlap on.

The distributed checks of one world size run in one spawn (spawning is the slow part) from a module-scoped
fixture; each test asserts its own entry of the per-rank result dicts.
"""

from __future__ import annotations

import copy
import os
import traceback

import pytest
import torch
import torch.distributed as dist
from torch import nn

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, MUON_2D, PlainShardNet, TinyNet, build_dtensor_model, local, plain_opt, set_grad

K, N = 2, 3  # steps before the checkpoint, steps after it


# ---------------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------------
def _train_plain(net, opt, steps, skip=()):
    for s in steps:
        cs, _ = net.local_grads(s)
        net(cs, skip=skip).backward()
        opt.step()
        opt.zero_grad()


def _snapshot(model, opt) -> dict[str, torch.Tensor]:
    """Local blocks of every param and every optimizer state tensor, keyed by param name (clones)."""
    opt.synchronize()
    out = {}
    for n, p in model.named_parameters():
        out[f"param {n}"] = local(p).detach().clone()
        for k, v in opt.state.get(p, {}).items():
            if isinstance(v, torch.Tensor):
                out[f"state {n}.{k}"] = local(v).detach().clone()
    return out


def _diff(a: dict, b: dict, tag: str) -> list[str]:
    bad = [f"{tag}: keys differ: {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []
    for k in sorted(set(a) & set(b)):
        if not torch.equal(a[k], b[k]):
            bad.append(f"{tag}: {k} differs")
    return bad


def _same(a, b) -> bool:
    """Deep equality of state_dict-like structures; tensors bitwise."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and torch.equal(
            local(a), local(b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _structure(sd: dict):
    """What must be identical on every rank: state keys with their entry names, groups' params, the meta."""
    return (
        {pid: sorted(st) for pid, st in sd["state"].items()},
        [(g["params"], {k: v for k, v in g.items() if k != "params"}) for g in sd["param_groups"]],
        sd.get("overlap_muon"),
    )


def _guard(fn, *args) -> list[str]:
    """Run one check inside a rank; an exception becomes a failure string so the other checks still run."""
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported to the test
        return [f"raised:\n{traceback.format_exc()}"]


# ---------------------------------------------------------------------------------------------------------------
# checks run inside ranks
# ---------------------------------------------------------------------------------------------------------------
def _check_same_keys_plain(R, T, g, t):
    """Keys identical on every rank; l5 never gets a gradient and has no state on any rank ([Note: lazy state])."""
    net = PlainShardNet(R, T, g, t)
    opt = plain_opt(net, R, T, g, t, overlap=True)
    _train_plain(net, opt, range(2), skip=("l5",))
    sd = opt.state_dict()
    bad = []
    used = [pid for pid, p in zip(sd["param_groups"][0]["params"], opt.param_groups[0]["params"]) if p is not net.l5.weight]
    if len(used) != len(net.SHAPES) - 1 or not all(pid in sd["state"] for pid in used):
        bad.append(f"{R}x{T}: not every used Muon param has a state entry: {sorted(sd['state'])} vs {used}")
    if net.l5.weight in opt.state:
        bad.append(f"{R}x{T}: the never-used param has state")
    bad += _all_ranks_equal(_structure(sd), f"{R}x{T} plain")
    opt.close()
    return bad


def _check_same_keys_dtensor(R, T, g, t):
    """DTensor TinyNet; proj.weight never gets a gradient, norm.bias only on rank 0."""
    torch.manual_seed(0)
    full = TinyNet()
    model, mesh = build_dtensor_model(full, R, T)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=True, **HP)
    gen = torch.Generator().manual_seed(3)
    for s in range(2):
        for n, p in model.named_parameters():
            fg = torch.randn(p.shape, generator=gen)
            # proj.weight: no gradient anywhere; norm.bias (AdamW): a gradient on rank 0 only
            if n != "proj.weight" and (n != "norm.bias" or dist.get_rank() == 0):
                set_grad(p, fg, None, R, T, g, t)
        opt.step()
        opt.zero_grad()
    sd = opt.state_dict()
    bad = []
    if len(sd["state"]) != sum(len(gr["params"]) for gr in sd["param_groups"]) - 1 or model.proj.weight in opt.state:
        bad.append(f"{R}x{T} dtensor: {len(sd['state'])} state entries (proj.weight never had a gradient)")

    bad += _all_ranks_equal(_structure(sd), f"{R}x{T} dtensor")
    opt.close()
    return bad


def _all_ranks_equal(obj, tag) -> list[str]:
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return []
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, obj)
    return [f"{tag}: rank {r}'s state_dict structure differs from rank 0's"
            for r, o in enumerate(gathered) if o != gathered[0]]


def _check_resume_plain(R, T, g, t, path):
    """torch.save / torch.load of the optimizer and the model; A (no stop) == B (resumed) bitwise."""
    net = PlainShardNet(R, T, g, t)
    opt = plain_opt(net, R, T, g, t, overlap=True)
    _train_plain(net, opt, range(K))
    osd = opt.state_dict()  # waits for the last step's waves first (model.state_dict() alone does not)
    torch.save({"model": net.state_dict(), "optim": osd}, path)
    _train_plain(net, opt, range(K, K + N))
    a = _snapshot(net, opt)
    opt.close()

    net2 = PlainShardNet(R, T, g, t, seed=1)  # other initial values: the load must overwrite them
    opt2 = plain_opt(net2, R, T, g, t, overlap=True)
    ckpt = torch.load(path)
    net2.load_state_dict(ckpt["model"])
    opt2.load_state_dict(ckpt["optim"])
    _train_plain(net2, opt2, range(K, K + N))
    b = _snapshot(net2, opt2)
    opt2.close()
    return _diff(a, b, f"plain {R}x{T} resume")


def _check_dcp_dtensor(R, T, path, stepped, flatten=False):
    """FSDP2 + TP TinyNet: get_state_dict -> dcp.save; fresh model/optimizer; dcp.load -> set_state_dict.

    ``stepped``: the fresh optimizer has taken a step (it has state) before loading; else it has none, and DCP
    makes its load template with a zero-gradient step at lr 0, as for a torch optimizer.

    ``flatten``: ``StateDictOptions(flatten_optimizer_state_dict=True)`` (every param group entry, e.g. the
    Muon group's ``ns_coefficients`` tuple and ``algorithm`` string, stored per param FQN)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    options = StateDictOptions(flatten_optimizer_state_dict=flatten)

    xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(50 + s)) for s in range(K + N)]

    def train(model, opt, steps):
        for s in steps:
            model(xs[s]).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model, mesh = build_dtensor_model(TinyNet(), R, T)
    opt = OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, overlap=True, **HP)
    train(model, opt, range(K))
    msd, osd = get_state_dict(model, opt, options=options)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    train(model, opt, range(K, K + N))
    a = _snapshot(model, opt)
    opt.close()

    torch.manual_seed(1)
    model2, mesh2 = build_dtensor_model(TinyNet(), R, T)
    opt2 = OverlapMuon(model2, device_mesh=mesh2, adamw_kwargs=ADAMW_KW, overlap=True, **HP)
    if stepped:
        train(model2, opt2, range(1))
    msd2, osd2 = get_state_dict(model2, opt2, options=options)
    sd = {"model": msd2, "optim": osd2}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=options)
    train(model2, opt2, range(K, K + N))
    b = _snapshot(model2, opt2)
    opt2.close()
    return _diff(a, b, f"dcp {R}x{T} stepped={stepped} flatten={flatten}")


def _dist_checks(rank, world, R, T, tmp):
    g, t = divmod(rank, T)
    out = {
        "keys_plain": _guard(_check_same_keys_plain, R, T, g, t),
        "keys_dtensor": _guard(_check_same_keys_dtensor, R, T, g, t),
        "resume_plain": _guard(_check_resume_plain, R, T, g, t, os.path.join(tmp, f"plain_rank{rank}.pt")),
    }
    for stepped, flatten in ((False, False), (True, False), (True, True)):
        key = f"dcp_{stepped}_{flatten}"
        d = os.path.join(tmp, key)  # one directory shared by the ranks
        out[key] = _guard(_check_dcp_dtensor, R, T, d, stepped, flatten)
    return out


GRIDS = [(1, 2), (2, 2)]


@pytest.fixture(scope="module", params=GRIDS, ids=[f"{r}x{t}" for r, t in GRIDS])
def dist_results(request, tmp_path_factory):
    R, T = request.param
    tmp = str(tmp_path_factory.mktemp(f"ckpt_{R}x{T}"))
    res = run_ranks(_dist_checks, R * T, R, T, tmp, timeout=100)
    return (R, T), res


def _failures(dist_results, key):
    (R, T), res = dist_results
    return [f"rank {r}: {f}" for r, d in enumerate(res) for f in d[key]]


# ---------------------------------------------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.timeout(120)
def test_state_dict_keys_same_on_every_rank(dist_results):
    """State is created lazily ([Note: lazy state]), and a sharded checkpoint (DCP) needs the same keys on every
    rank: a param with no gradient anywhere has no state anywhere; an AdamW param with a gradient on one rank only
    has state on every rank."""
    bad = _failures(dist_results, "keys_plain") + _failures(dist_results, "keys_dtensor")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
def test_resume_plain_distributed_bitwise(dist_results):
    bad = _failures(dist_results, "resume_plain")
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(60)
def test_resume_plain_single_process_bitwise(tmp_path):
    bad = _check_resume_plain(1, 1, 0, 0, str(tmp_path / "ckpt.pt"))
    bad += _check_same_keys_plain(1, 1, 0, 0)
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
def test_dcp_resume_dtensor(dist_results):
    """get_state_dict / dcp.save / dcp.load / set_state_dict round trip on FSDP2 + TP, as a user writes it."""
    bad = _failures(dist_results, "dcp_False_False")
    assert not bad, "\n".join(bad[:4])


@pytest.mark.timeout(120)
def test_dcp_resume_dtensor_into_a_stepped_optimizer(dist_results):
    """The same round trip into an optimizer that already has state (nested and flattened optimizer state
    dicts): resumed == not stopped, bitwise."""
    bad = _failures(dist_results, "dcp_True_False") + _failures(dist_results, "dcp_True_True")
    assert not bad, "\n".join(bad[:4])


@pytest.mark.timeout(60)
def test_model_state_dict_after_step_sees_applied_update():
    """Regression for a silent checkpoint corruption: ``torch.save(model.state_dict())`` right after
    ``opt.step()`` in overlap mode must not save params whose Muon update has not landed yet."""
    net = PlainShardNet(1, 1, 0, 0)
    opt = OverlapMuon(net, adamw_kwargs=ADAMW_KW, overlap=True, _testing=TestingSeam(ns_delay_s=0.3), **MUON_2D, **HP)
    cs, _ = net.local_grads(0)
    net(cs).backward()
    opt.step()
    saved = {k: v.clone() for k, v in net.state_dict().items()}  # what torch.save would serialize
    opt.synchronize()
    stale = [k for k, v in net.state_dict().items() if not torch.equal(v, saved[k])]
    opt.close()
    assert not stale, f"model.state_dict() right after step() returned pre-update values for {stale}"


# ---------------------------------------------------------------------------------------------------------------
# checkpoints that do not fit: ValueError, nothing changed
# ---------------------------------------------------------------------------------------------------------------
class _EmbNet(nn.Module):
    """An embedding (AdamW) whose vocabulary size varies while every Muon matrix keeps its shape."""

    def __init__(self, vocab: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, 8)
        self.fc = nn.Linear(8, 8, bias=False)

    def forward(self, idx):
        return self.fc(self.emb(idx))


def _trained_tiny(seed=0, lr=0.5, **kw):
    torch.manual_seed(seed)
    model = TinyNet(**kw)
    opt = OverlapMuon(model, adamw_kwargs=dict(ADAMW_KW, lr=lr), **dict(HP, lr=lr), overlap=True)
    x = torch.randn(4, model.norm.normalized_shape[0])
    for _ in range(2):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def _assert_rejected(opt, model, bad_sd, match):
    before = copy.deepcopy(opt.state_dict())
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=match):
        opt.load_state_dict(bad_sd)
    assert _same(opt.state_dict(), before), "a rejected checkpoint changed the optimizer's state_dict"
    assert all(torch.equal(p, params[n]) for n, p in model.named_parameters())
    # still usable and unchanged hyper-parameters
    assert opt.param_groups[0]["lr"] == before["param_groups"][0]["lr"]


@pytest.mark.timeout(60)
def test_load_mismatched_muon_shape_is_value_error_and_changes_nothing():
    model, opt = _trained_tiny()
    _, other = _trained_tiny(seed=1, h=24)  # up/gate/down have other full shapes
    _assert_rejected(opt, model, other.state_dict(), r"up\.weight")
    opt.close()
    other.close()


@pytest.mark.timeout(60)
def test_load_renamed_param_loads_by_position_as_torch():
    """A Muon param renamed in the checkpoint (pruning saves ``weight_orig`` where the model had ``weight``) loads:
    torch matches a checkpoint by position and shape, not name. A different shape is refused, naming both."""
    model, opt = _trained_tiny()
    _, other = _trained_tiny(seed=1)
    sd = other.state_dict()
    meta = sd["overlap_muon"]["muon_params"]
    meta[0] = ("layers.0.up.weight",) + tuple(meta[0][1:])
    opt.load_state_dict(sd)
    meta[0] = ("layers.0.up.weight", [5, 5], meta[0][2])
    _assert_rejected(opt, model, sd, r"Muon param 0: 'layers\.0\.up\.weight' \(5, 5\)")
    opt.close()
    other.close()


@pytest.mark.timeout(60)
def test_load_mismatched_momentum_without_meta_is_value_error():
    """A checkpoint without the "overlap_muon" entry (as DCP's set_state_dict passes it) is still checked."""
    model, opt = _trained_tiny()
    _, other = _trained_tiny(seed=1)
    sd = other.state_dict()
    del sd["overlap_muon"]
    pid = sd["param_groups"][0]["params"][0]
    sd["state"][pid]["momentum_buffer"] = torch.zeros(3, 3)
    _assert_rejected(opt, model, sd, r"momentum .*up\.weight")
    opt.close()
    other.close()


@pytest.mark.timeout(60)
def test_load_wrong_param_count_is_value_error():
    model, opt = _trained_tiny()
    big = nn.Sequential(TinyNet(), nn.Linear(13, 5))
    other = OverlapMuon(big, adamw_kwargs=ADAMW_KW, **HP)
    _assert_rejected(opt, model, other.state_dict(), r"Muon params|param group")
    opt.close()
    other.close()


@pytest.mark.timeout(60)
def test_load_mismatched_adamw_state_shape_is_value_error():
    """Same Muon matrices, an embedding of another vocabulary size: the AdamW moments do not fit."""
    torch.manual_seed(0)
    a, b = _EmbNet(50), _EmbNet(60)
    opt_a = OverlapMuon(a, adamw_kwargs=ADAMW_KW, **HP)
    opt_b = OverlapMuon(b, adamw_kwargs=ADAMW_KW, **HP)
    idx = torch.arange(8)
    for model, opt in ((a, opt_a), (b, opt_b)):
        model(idx).sum().backward()
        opt.step()
        opt.zero_grad()
    try:
        _assert_rejected(opt_a, a, opt_b.state_dict(), r"emb\.weight|exp_avg|shape")
    finally:
        opt_a.close()
        opt_b.close()
