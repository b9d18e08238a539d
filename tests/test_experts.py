"""MoE experts on their own domain: grouped 3-D ``(E, P, Q)`` weights and per-expert linears, sharded over
EP x ETP beside a dense remat x TP domain, bitwise equal to ``torch.optim.Muon`` on every expert matrix as its own
param ([Note: two domains] in ``overlap_muon/_discovery.py``)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import HP, PARTITION, TinyNet, block, build_dtensor_model, build_plain_model, explicit_groups, local, set_grad

E, H, D = 4, 9, 6  # 4 experts; (H, D) = (9, 6) splits unevenly (5/4) over ETP 2
STEPS = 3


def _full_experts(seed: int = 1) -> dict[str, torch.Tensor]:
    """The global expert weights: two grouped (E, P, Q) weights and E per-expert linears."""
    gen = torch.Generator().manual_seed(seed)
    out = {"moe.w_in": torch.randn(E, H, D, generator=gen), "moe.w_out": torch.randn(E, D, H, generator=gen)}
    for e in range(E):
        out[f"moe.lin{e}"] = torch.randn(H, D, generator=gen)
    return out


def _expert_grads(step: int) -> dict[str, torch.Tensor]:
    return {k: torch.randn(v.shape, generator=torch.Generator().manual_seed(1000 + 17 * step + i))
            for i, (k, v) in enumerate(_full_experts().items())}


def _dense_grads(full: TinyNet, step: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(500 + step)
    return {n: torch.randn(p.shape, generator=gen) for n, p in full.named_parameters()}


def _missing(step: int, ep: int) -> bool:
    """Step 1: the experts of EP index 0 get no tokens (no gradient); EP index 1's do."""
    return step == 1 and ep == 0


def _reference(full: TinyNet, ep_size: int, steps: int = STEPS) -> dict[str, torch.Tensor]:
    """torch.optim.Muon on the dense Muon matrices and on every expert matrix as its own param."""
    params = {n: nn.Parameter(p.detach().clone()) for n, p in full.named_parameters() if n in PARTITION}
    experts = _full_experts()
    for name in ("moe.w_in", "moe.w_out"):
        for e in range(E):
            params[f"{name}[{e}]"] = nn.Parameter(experts[name][e].clone())
    for e in range(E):
        params[f"moe.lin{e}"] = nn.Parameter(experts[f"moe.lin{e}"].clone())
    mu = torch.optim.Muon(list(params.values()), **HP)
    per_ep = E // ep_size
    for s in range(steps):
        dg, eg = _dense_grads(full, s), _expert_grads(s)
        for n, p in params.items():
            base, _, idx = n.partition("[")
            e = int(idx[:-1]) if idx else int(n[len("moe.lin"):]) if n.startswith("moe.lin") else None
            if e is not None and _missing(s, e // per_ep):
                p.grad = None
            elif e is None:
                p.grad = dg[n].clone()
            else:
                p.grad = (eg[base][e] if idx else eg[n]).clone()
        mu.step()
    return {n: p.detach() for n, p in params.items()}


class Experts(nn.Module):
    """This rank's experts: grouped ``w_in`` (rows split by ETP) and ``w_out`` (columns split), and per-expert
    linears ``lin{k}`` (k local), as DTensors on the expert mesh or as plain blocks."""

    def __init__(self, ep: int, et: int, ep_size: int, etp: int, mesh=None) -> None:
        super().__init__()
        full, per = _full_experts(), E // ep_size
        mine = range(ep * per, (ep + 1) * per)
        if mesh is not None:
            from torch.distributed.tensor import Shard, distribute_tensor

            self.w_in = nn.Parameter(distribute_tensor(full["moe.w_in"], mesh, [Shard(0), Shard(1)]))
            self.w_out = nn.Parameter(distribute_tensor(full["moe.w_out"], mesh, [Shard(0), Shard(2)]))
            for k, e in enumerate(mine):
                self.register_parameter(f"lin{k}", nn.Parameter(distribute_tensor(full[f"moe.lin{e}"], mesh["etp"],
                                                                                   [Shard(0)])))
            return
        self.w_in = nn.Parameter(torch.stack([block(full["moe.w_in"][e], 0, 1, etp, 0, et) for e in mine]))
        self.w_out = nn.Parameter(torch.stack([block(full["moe.w_out"][e], 1, 1, etp, 0, et) for e in mine]))
        self.w_in.partition_dim, self.w_out.partition_dim = 0, 1
        self.w_in.full_shape, self.w_out.full_shape = (H, D), (D, H)
        for k, e in enumerate(mine):
            w = nn.Parameter(block(full[f"moe.lin{e}"], 0, 1, etp, 0, et).clone())
            w.partition_dim, w.full_shape = 0, (H, D)
            self.register_parameter(f"lin{k}", w)


def _synthetic_backward(model: nn.Module, grads: dict[str, torch.Tensor]) -> None:
    """Backward of ``sum((local(p) * grads[n]).sum())``: every listed param's gradient is exactly ``grads[n]``, and
    the grad-ready hooks fire as in a real backward (so overlap mode launches its waves from them)."""
    terms = [(local_param(p) * grads[n]).sum() for n, p in model.named_parameters() if n in grads]
    if terms:
        sum(terms).backward()


def local_param(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return p.to_local() if isinstance(p, DTensor) else p


def _expert_block(name: str, e_local: int, ep: int, et: int, ep_size: int, etp: int, grads) -> torch.Tensor:
    """This rank's block of a global expert tensor of ``grads`` (a dict of full tensors)."""
    e = ep * (E // ep_size) + e_local
    if name in ("w_in", "w_out"):
        return block(grads[f"moe.{name}"][e], 0 if name == "w_in" else 1, 1, etp, 0, et)
    return block(grads[f"moe.lin{e}"], 0, 1, etp, 0, et)


def _body(rank, world, R, T, ep_size, etp, form, crossed, overlap, fused, mode):
    """One grid point on ``world`` ranks: dense R x T (g, t) = divmod(rank, T); experts EP x ETP with
    (ep, et) = divmod(rank, etp), or (crossed) et = rank // ep_size, ep = rank % ep_size."""
    torch.manual_seed(0)
    g, t = divmod(rank, T)
    if crossed:
        et, ep = divmod(rank, ep_size)
    else:
        ep, et = divmod(rank, etp)
    full = TinyNet()
    ref = _reference(full, ep_size)
    kw: dict = dict(experts="moe.*", overlap=overlap, fused_a2a=fused, mode=mode, **HP)
    if form == "dtensor":
        from torch.distributed.device_mesh import init_device_mesh

        dense, mesh = build_dtensor_model(full, R, T)
        dims, shape = (("etp", "ep"), (etp, ep_size)) if crossed else (("ep", "etp"), (ep_size, etp))
        emesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
        kw |= dict(device_mesh=mesh, expert_mesh=emesh)
        experts = Experts(ep, et, ep_size, etp, mesh=emesh)
    else:
        dense = build_plain_model(full, R, T, g, t)
        kw["tp_group"], kw["remat_group"] = explicit_groups(R, T, g, t)
        groups = [dist.new_group([j * ep_size + i if crossed else i * etp + j for j in range(etp)])
                  for i in range(ep_size)] if etp > 1 else None
        kw["etp_group"] = groups[ep] if groups else None
        experts = Experts(ep, et, ep_size, etp)
    model = nn.Module()
    model.dense, model.moe = dense, experts
    opt = OverlapMuon(model, **kw)
    for s in range(STEPS):
        dg, eg = _dense_grads(full, s), _expert_grads(s)
        egrads = {}
        if not _missing(s, ep):
            for n, p in experts.named_parameters():
                if n in ("w_in", "w_out"):
                    egrads[n] = torch.stack([_expert_block(n, k, ep, et, ep_size, etp, eg) for k in range(E // ep_size)])
                else:
                    egrads[n] = _expert_block(n, int(n[3:]), ep, et, ep_size, etp, eg)
        if form == "dtensor":  # FSDP2 + TP dense grads are set, expert grads come from a backward
            for n, p in dense.named_parameters():
                set_grad(p, dg[n], PARTITION.get(n), R, T, g, t)
            _synthetic_backward(experts, {n: v.contiguous() for n, v in egrads.items()})
        else:  # every Muon gradient from one backward: the hooks launch dense and expert waves interleaved
            dgl = {f"dense.{n}": (block(dg[n], PARTITION[n], R, T, g, t) if n in PARTITION else dg[n]).contiguous()
                   for n, _ in dense.named_parameters()}
            _synthetic_backward(model, dgl | {f"moe.{n}": v.contiguous() for n, v in egrads.items()})
        opt.step()
        opt.zero_grad()
    opt.synchronize()
    bad = []
    for n in PARTITION:
        got = local(dict(dense.named_parameters())[n]).detach()
        if not torch.equal(got, block(ref[n], PARTITION[n], R, T, g, t)):
            bad.append(f"dense {n}")
    for n, p in experts.named_parameters():
        loc = local(p).detach()
        for k in range(E // ep_size) if n in ("w_in", "w_out") else [None]:
            e = ep * (E // ep_size) + (k if k is not None else int(n[3:]))
            exp = block(ref[f"moe.{n}[{e}]" if k is not None else f"moe.lin{e}"], 1 if n == "w_out" else 0, 1, etp, 0, et)
            if not torch.equal(loc[k] if k is not None else loc, exp):
                bad.append(f"expert {n} (global expert {e})")
    stats = dict(opt.stats)
    opt.close()
    return bad, stats


def _check(results):
    for r, (bad, _) in enumerate(results):
        assert not bad, f"rank {r}: {bad}"


def test_world1_grouped_and_linear_experts_bitwise():
    for overlap in (False, True):
        _check([_body(0, 1, 1, 1, 1, 1, "plain", False, overlap, True, "layer_sharded")])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("form", ["dtensor", pytest.param("plain", marks=pytest.mark.slow)])
def test_ep2_etp2_beside_remat2_tp2(form):
    """4 ranks: dense remat 2 x TP 2, experts EP 2 x ETP 2 (grouped 3-D weights split by rows and by columns,
    per-expert linears), sync and overlap, fused and two-stage, layer-sharded and duplicated; EP index 0's experts
    have no gradient at step 1 (their ranks' expert waves are empty, the dense ones are not): no hang, and the
    result equals torch.optim.Muon, which skips them that step."""
    configs = [(False, True, "layer_sharded"), (True, True, "layer_sharded"), (True, False, "layer_sharded"),
               (False, True, "duplicated")]

    def run(crossed):
        for overlap, fused, mode in configs:
            _check(run_ranks(_body, 4, 2, 2, 2, 2, form, crossed, overlap, fused, mode, timeout=150))

    run(False)
    if form == "plain":
        run(True)  # ETP groups {0, 2}, {1, 3} cross the TP groups {0, 1}, {2, 3}


@pytest.mark.timeout(180)
def test_experts_without_etp_are_local():
    """EP 2, ETP 1 (the training job's layout): each rank's experts are its own, NS'd where they live."""
    res = run_ranks(_body, 2, 1, 2, 2, 1, "plain", False, True, True, "layer_sharded", timeout=120)
    _check(res)


def _uneven_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    emesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ep",))
    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(torch.randn(3, 4, 4), emesh, [Shard(0)]))  # 2 experts here, 1 there
    try:
        OverlapMuon(model, experts="w", expert_mesh=emesh)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(120)
def test_uneven_experts_per_rank_is_an_error_everywhere():
    for msg in run_ranks(_uneven_body, 2, timeout=90):
        assert "has 3 experts over EP size 2" in msg, msg


def test_expert_param_errors_name_the_param():
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(2, 3, 4, 5))
    with pytest.raises(ValueError, match=r"'w'.*\(2, 3, 4, 5\)"):
        OverlapMuon(model, experts="w")
    with pytest.raises(TypeError, match="experts must be"):
        OverlapMuon(nn.Linear(2, 2), experts=3)
    model = nn.Module()
    model.w = nn.Parameter(torch.randn(2, 3, 4))
    with pytest.raises(ValueError, match="selected by experts= but not by muon_filter"):
        OverlapMuon(model, experts="w", muon_filter=lambda n, p: False)


def _mismatch_body(rank, world, overlap):
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    model = nn.Module()
    model.dense = nn.Linear(4, 4, bias=False)  # replicated dense matrix, every rank has its gradient
    model.w = nn.Parameter(torch.randn(2, 6, 4))
    model.w.partition_dim, model.w.full_shape = 0, (12, 4)
    opt = OverlapMuon(model, experts="w", etp_group=groups[rank // 2], overlap=overlap, tp_group=None)
    model.dense.weight.grad = torch.ones(4, 4)
    if rank != 1:  # rank 1 lacks the expert gradient its ETP peer (rank 0) has
        model.w.grad = torch.ones(2, 6, 4)
    before = model.w.detach().clone(), model.dense.weight.detach().clone()
    try:
        opt.step()
    except ValueError as e:
        unchanged = torch.equal(before[0], model.w.detach()) and torch.equal(before[1], model.dense.weight.detach())
        return str(e), unchanged
    return "no error", None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("overlap", [False, True])
def test_expert_gradient_mismatch_is_an_error_everywhere(overlap):
    """Rank 1 lacks an expert gradient that its ETP peer has: a ValueError on all 4 ranks (the other EP index
    included), nothing applied, no hang."""
    for rank, (msg, unchanged) in enumerate(run_ranks(_mismatch_body, 4, overlap, timeout=90)):
        assert "gradient on some ranks" in msg, (rank, msg)
        assert unchanged, rank


def test_expert_selector_mistakes_are_errors():
    """A pattern that matches nothing, and a bias stack caught by a broad pattern, are errors (not AdamW params or
    matrices in silence); a split entry may name one matrix of a grouped weight by its exact name."""
    from overlap_muon import GateUpSplit
    model = nn.Module()
    model.experts = nn.Module()
    model.experts.w13 = nn.Parameter(torch.randn(2, 8, 4))
    model.experts.w13_bias = nn.Parameter(torch.randn(2, 8))
    with pytest.raises(ValueError, match=r"experts patterns \['moe\.expert\.\*'\] match no param"):
        OverlapMuon(model, experts="moe.expert.*")
    with pytest.raises(ValueError, match=r"'experts.w13_bias'.*a bias"):
        OverlapMuon(model, experts="experts.*")
    model.experts.w2 = nn.Parameter(torch.randn(2, 4, 8))
    with pytest.warns(UserWarning, match=r"3-D params \['experts.w2'\] are not selected; they go to AdamW"):
        opt = OverlapMuon(model, experts="experts.w13", split={"experts.w13[0]": GateUpSplit()})
    assert opt.muon_param_names == ["experts.w13[0]", "experts.w13[1]"]
    assert [m.parts is not None for m in opt._muon] == [True, False]
    opt.close()


def _layout_mistakes_body(rank, world, case):
    import warnings

    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    model = nn.Module()
    if case == "uneven_plain":
        model.w = nn.Parameter(torch.randn(2 - rank, 6, 4))  # 2 experts on rank 0, 1 on rank 1
        kw = {}
    elif case == "forgot_etp":
        model.w = nn.Parameter(torch.randn(2, 3, 4))
        model.w.partition_dim = 0  # a row shard of (2, 6, 4) over ETP 2, but no etp_group
        kw = {}
    else:  # "dtensor_etp1": the README's placements on an ("ep", "etp") mesh whose etp dim has size 1
        emesh = init_device_mesh("cpu", (2, 1), mesh_dim_names=("ep", "etp"))
        full = torch.randn(4, 6, 4, generator=torch.Generator().manual_seed(0))
        model.w = nn.Parameter(distribute_tensor(full, emesh, [Shard(0), Shard(1)]))
        kw = {"expert_mesh": emesh}
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = OverlapMuon(model, experts="w", **kw)
    except ValueError as e:
        return "error", str(e)
    if case == "dtensor_etp1":  # 2 local experts, each a whole matrix: equal to torch.optim.Muon on each
        ref = [nn.Parameter(full[2 * rank + e].clone()) for e in range(2)]
        mu = torch.optim.Muon(ref, lr=1e-3, weight_decay=0.1)
        g = torch.randn(4, 6, 4, generator=torch.Generator().manual_seed(1))
        for e, p in enumerate(ref):
            p.grad = g[2 * rank + e].clone()
        mu.step()
        model.w.grad = distribute_tensor(g, emesh, [Shard(0), Shard(1)])
        opt.step()
        opt.synchronize()
        return "ok", all(torch.equal(model.w.to_local()[e], ref[e].detach()) for e in range(2))
    opt.close()
    return "warned", [str(w.message) for w in caught]


@pytest.mark.timeout(120)
def test_grouped_weights_without_experts_warn_with_the_pattern():
    """3-D params without ``experts=`` go to AdamW (a ``Conv1d`` weight is 3-D too, so no default takes them), with a
    warning on rank 0 naming them and the ``experts=`` pattern that gives them Muon; that pattern then warns no more."""
    model = nn.Module()
    model.layers = nn.ModuleList(nn.Module() for _ in range(2))
    for layer in model.layers:
        layer.experts = nn.Module()
        layer.experts.w13 = nn.Parameter(torch.randn(2, 8, 4))
        layer.experts.w2 = nn.Parameter(torch.randn(2, 4, 8))
        layer.proj = nn.Linear(4, 4, bias=False)
    with pytest.warns(UserWarning, match=re.escape("give them Muon with experts='layers.*.experts.*'")):
        opt = OverlapMuon(model)
    assert opt.muon_param_names == ["layers.0.proj.weight", "layers.1.proj.weight"]
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt = OverlapMuon(model, experts="layers.*.experts.*")
    assert len(opt.muon_param_names) == 10
    opt.close()


def test_expert_layout_mistakes_are_reported():
    """Plain experts held unevenly: an error naming the expert counts (not a plan mismatch at an unrelated param).
    Shards carrying ``partition_dim`` without an ETP group: a warning on rank 0 (they are taken as whole matrices).
    ``Shard(1)`` over a size-1 ETP dim is the whole matrix, not an error."""
    for kind, msg in run_ranks(_layout_mistakes_body, 2, "uneven_plain", timeout=90):
        assert kind == "error" and "hold different expert params" in msg and "('w', 2)" in msg, msg
    res = run_ranks(_layout_mistakes_body, 2, "forgot_etp", timeout=90)
    assert res[0][0] == "warned" and any("partition_dim" in m for m in res[0][1]), res
    for kind, ok in run_ranks(_layout_mistakes_body, 2, "dtensor_etp1", timeout=90):
        assert kind == "ok" and ok is True, (kind, ok)


def _qwen3_moe_model(world: int, layout: str) -> tuple[nn.Module, dict[str, torch.Tensor], object]:
    """A tiny Qwen3-MoE's params on a 1-D ``("tp",)`` mesh: ``"hf"``, Hugging Face's model class under its own
    stock TP plan (whatever the installed release places); ``"built"``, the fused expert layout of transformers'
    ``packed_colwise`` plan built here with ``distribute_tensor`` (``gate_up_proj`` ``(E, 2I, H)``
    ``_StridedShard(1, split_factor=2)``, ``down_proj`` ``(E, H, I)`` ``Shard(2)``, a dense ``Shard(0)`` weight),
    the same local shards as transformers 5.24 gives, with no transformers needed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    torch.manual_seed(0)
    if layout == "hf":
        import transformers
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
        from transformers.distributed.tensor_parallel import apply_tensor_parallelism

        cfg = Qwen3MoeConfig(vocab_size=64, hidden_size=16, intermediate_size=32, moe_intermediate_size=24,
                             num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=4,
                             num_experts=4, num_experts_per_tok=2)
        model = Qwen3MoeForCausalLM(cfg)
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
        tp_plan, _, _ = model._resolve_parallel_plans(transformers.DistributedConfig(tp_size=world))
        apply_tensor_parallelism(model, mesh, tp_plan)  # HF's placements, the local shards chunked from `full`
        return model, full, mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    full = {"model.layers.0.self_attn.q_proj.weight": torch.randn(16, 16),
            "model.layers.0.mlp.experts.gate_up_proj": torch.randn(4, 48, 16),
            "model.layers.0.mlp.experts.down_proj": torch.randn(4, 16, 24)}
    pls = [[Shard(0)], [_StridedShard(1, split_factor=2)], [Shard(2)]]
    model = nn.Module()
    for (n, t), pl in zip(full.items(), pls):
        *path, leaf = n.split(".")
        owner = model
        for part in path:
            if not hasattr(owner, part):
                owner.add_module(part, nn.Module())
            owner = getattr(owner, part)
        owner.register_parameter(leaf, nn.Parameter(distribute_tensor(t.clone(), mesh, pl, src_data_rank=None)))
    return model, full, mesh


def _qwen3_moe_tp_body(rank, world, overlap, layout, expect):
    """Synthetic gradients (the same full values on every rank), then OverlapMuon against torch.optim.Muon on every
    full matrix, one process. ``expect``: the expert layout the test process found (``"strided"``: each rank holds
    its block of the gate half and of the up half; ``"replicated"``: every rank holds every expert whole)."""
    from torch.distributed.tensor import DTensor

    from tests.models import set_grad

    model, full, mesh = _qwen3_moe_model(world, layout)
    named = dict(model.named_parameters())
    gate_up = named["model.layers.0.mlp.experts.gate_up_proj"]
    if expect == "strided":
        pl = gate_up.placements[0]
        assert type(pl).__name__ == "_StridedShard" and (pl.dim, pl.split_factor) == (1, 2), gate_up.placements
    else:
        assert not isinstance(gate_up, DTensor), gate_up.placements
    opt = OverlapMuon(model, device_mesh=mesh, tp_dim="tp", expert_mesh=mesh, etp_dim="tp",
                      experts="model.layers.*.mlp.experts.*_proj", overlap=overlap, **HP)
    ref = {}
    for n in opt.muon_param_names:  # the full matrices OverlapMuon gives Muon, each its own param
        base, _, e = n.partition("[")
        ref[n] = nn.Parameter((full[base][int(e[:-1])] if e else full[base]).clone())
    mu = torch.optim.Muon(list(ref.values()), **HP)
    for s in range(STEPS):
        gen = torch.Generator().manual_seed(100 + s)
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in full.items()}
        for n, p in named.items():
            set_grad(p, grads[n], None, 1, world, 0, rank) if isinstance(p, DTensor) else setattr(p, "grad",
                                                                                                  grads[n].clone())
        for n, p in ref.items():
            base, _, e = n.partition("[")
            p.grad = (grads[base][int(e[:-1])] if e else grads[base]).clone()
        opt.step()
        opt.zero_grad()
        mu.step()
    opt.synchronize()
    bad = []
    for n, r in ref.items():
        base, _, e = n.partition("[")
        p = named[base]
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if not torch.equal(got[int(e[:-1])] if e else got, r.detach()):
            bad.append(n)
    opt.close()
    return bad, sorted(n for n in ref if "gate_up" in n)


def _check_qwen3_moe(overlap: bool, layout: str, expect: str) -> None:
    for bad, names in run_ranks(_qwen3_moe_tp_body, 2, overlap, layout, expect, timeout=200):
        assert names == [f"model.layers.0.mlp.experts.gate_up_proj[{e}]" for e in range(4)], names
        assert not bad, bad


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlap", [False, True])
def test_strided_gate_up_etp2_bitwise(overlap):
    """The fused expert ``gate_up_proj`` sharded ``_StridedShard(dim=1, split_factor=2)`` (gate and up halves each
    split over TP, transformers' ``packed_colwise``), built on a CPU mesh by the test itself. Bug: refused
    ("expected Shard(1), Shard(2) or Replicate"). Now each home assembles the true ``(2I, H)`` matrix from both
    ranks' interleaved pieces ([Note: strided expert rows] in ``overlap_muon/split.py``): world 2, ETP 2, every expert
    and dense Muon matrix ``torch.equal`` to one process's torch.optim.Muon. ``2I = 48 > H = 16``: NS's Gram sums
    over the rows in their order, so rows left in the assembled (interleaved) order fail this test (checked)."""
    _check_qwen3_moe(overlap, "built", "strided")


@pytest.mark.timeout(240)
@pytest.mark.parametrize("overlap", [False, True])
def test_hf_qwen3_moe_tp_plan_bitwise(overlap):
    """Hugging Face's Qwen3-MoE under its own stock TP plan, as the installed release places it (transformers
    5.24: the strided fused experts above; 5.25 moved the experts to ``base_model_ep_plan``, so its TP plan leaves
    them replicated on every rank): every expert and dense Muon matrix ``torch.equal`` to torch.optim.Muon."""
    pytest.importorskip("transformers", reason="transformers is not installed (Hugging Face's Qwen3-MoE TP plan)")
    from tests.upstream import qwen3_moe_expert_layout

    _check_qwen3_moe(overlap, "hf", qwen3_moe_expert_layout())


def test_upstream_layout_change_is_one_line(monkeypatch):
    """An upstream release that changes the layout a test builds on fails that test with one line naming the
    package, its version and the change (here: a Qwen3-MoE TP plan rule for the experts that no release had)."""
    pytest.importorskip("transformers", reason="transformers is not installed")
    import transformers
    from transformers import Qwen3MoeConfig

    from tests.upstream import qwen3_moe_expert_layout

    plan = dict(Qwen3MoeConfig.base_model_tp_plan, **{"layers.*.mlp.experts.gate_up_proj": "some_new_rule"})
    monkeypatch.setattr(Qwen3MoeConfig, "base_model_tp_plan", plan)
    with pytest.raises(pytest.fail.Exception) as info:
        qwen3_moe_expert_layout()
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith(f"upstream changed: transformers {transformers.__version__}: "), msg
    assert "some_new_rule" in msg and not info.value.pytrace, msg


def _efsdp_model(mesh, pl, full):
    from torch.distributed.tensor import distribute_tensor

    model = nn.Module()
    model.w = nn.Parameter(distribute_tensor(full, mesh, pl, src_data_rank=None))
    return model


def _efsdp_body(rank, world, efsdp, pl_kind, overlap, path=None):
    """Grouped experts ``(E, 6, 4)`` on ``("efsdp", "ep")``; 2 steps, then (with ``path``) a DCP round trip into a
    fresh model and optimizer and a third step on both, each expert compared with ``torch.optim.Muon``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    ep = world // efsdp
    mesh = init_device_mesh("cpu", (efsdp, ep), mesh_dim_names=("efsdp", "ep"))
    E = 2 * world
    full = torch.randn(E, 6, 4, generator=torch.Generator().manual_seed(0))
    pl = [_StridedShard(0, split_factor=ep), Shard(0)] if pl_kind == "titan" else [Shard(1), Replicate()]
    model = _efsdp_model(mesh, pl, full)
    kw = dict(experts="w", expert_mesh=mesh, overlap=overlap, **HP)
    try:
        opt = OverlapMuon(model, **kw)
    except ValueError as e:
        return "error", str(e)
    # which experts this rank holds: the same layout applied to the experts' indices
    mine = distribute_tensor(torch.arange(E, dtype=torch.float32)[:, None, None].expand(E, 6, 4).contiguous(), mesh,
                             pl, src_data_rank=None).to_local()[:, 0, 0].long().tolist()
    ref = [nn.Parameter(full[e].clone()) for e in mine]
    mu = torch.optim.Muon(ref, **HP)
    gen = torch.Generator().manual_seed(1)

    def step(m, o, g):
        m.w.grad = distribute_tensor(g, mesh, pl, src_data_rank=None)
        o.step()
        o.zero_grad()

    def ref_step(g):
        for e, p in zip(mine, ref):
            p.grad = g[e].clone()
        mu.step()
        mu.zero_grad()

    for _ in range(2):
        g = torch.randn(E, 6, 4, generator=gen)
        step(model, opt, g)
        ref_step(g)
    opt.synchronize()
    ok = all(torch.equal(model.w.to_local()[j], ref[j].detach()) for j in range(len(mine)))
    if path is not None:
        msd, osd = get_state_dict(model, opt)
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
        model2 = _efsdp_model(mesh, pl, torch.zeros(E, 6, 4))
        opt2 = OverlapMuon(model2, **kw)
        msd2, osd2 = get_state_dict(model2, opt2)
        sd = {"model": msd2, "optim": osd2}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        g = torch.randn(E, 6, 4, generator=gen)
        step(model2, opt2, g)
        ref_step(g)
        opt2.synchronize()
        ok = ok and all(torch.equal(model2.w.to_local()[j], ref[j].detach()) for j in range(len(mine)))
        opt2.close()
    opt.close()
    return "ok", (ok, len(mine))


@pytest.mark.timeout(120)
def test_torchtitan_efsdp_size1_layout_is_accepted():
    """``parallelize_deepseekv3`` with EP gives the grouped experts ``(_StridedShard(0, sf=2), Shard(0))`` on
    ``("efsdp", "ep")``. Bug: refused even with efsdp of size 1, where the strided shard is the whole tensor. Now
    accepted (EP 2, bitwise torch.optim.Muon per expert)."""
    for kind, out in run_ranks(_efsdp_body, 2, 1, "titan", True, timeout=90):
        assert kind == "ok" and out == (True, 2), (kind, out)


@pytest.mark.timeout(200)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_torchtitan_ep2_x_expert_fsdp2_bitwise_with_dcp(overlap, tmp_path):
    """EP 2 x expert FSDP 2 on 4 ranks, torchtitan 0.3's layout ``(_StridedShard(0, sf=2), Shard(0))``: the expert
    FSDP dim shards the experts further, so every rank holds whole matrices of 2 of the 8 experts and runs their NS
    itself. Was refused ("an expert FSDP dim, which is not supported yet"). Bitwise ``torch.optim.Muon`` per
    expert, through a DCP round trip into a fresh model and optimizer."""
    for kind, out in run_ranks(_efsdp_body, 4, 2, "titan", overlap, str(tmp_path / "ckpt"), timeout=180):
        assert kind == "ok" and out == (True, 2), (kind, out)


@pytest.mark.timeout(120)
def test_expert_fsdp_splitting_each_matrix_is_a_clear_error():
    """``Shard(1)`` over an expert FSDP dim of size 2 splits every expert matrix's rows: not supported yet, an error
    naming the param, its shape and the dim."""
    for kind, msg in run_ranks(_efsdp_body, 2, 2, "rows", True, timeout=90):
        assert kind == "error" and "'efsdp'" in msg and "expert FSDP" in msg and "(4, 6, 4)" in msg, msg
