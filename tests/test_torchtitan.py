"""torchtitan 0.3.0's own model classes and parallelize function, with the optimizer built by the
docs/usage.md "With torchtitan" snippet, run verbatim (extracted from the doc, so the two cannot drift).

Gradients are synthetic (the same full values on every rank, each rank's shard set as its ``.grad``), as in the
other parity tests: a real backward under FSDP/TP sums in another order than one process does, and the point here
is the optimizer on torchtitan's layouts. Every param is compared with ``torch.equal`` to one process running
``torch.optim.Muon`` (the fused ``wqkv`` as its Q, K and V parts, each its own param) and ``torch.optim.AdamW``.
torchtitan needs triton to import: ``tests/torchtitan_stub.py`` stands in for its one kernel module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.dist_utils import run_ranks
from tests.snippets import doc_snippet
from tests.torchtitan_stub import import_torchtitan

STEPS = 3
def _tiny_llama3():
    """torchtitan's Llama3 class, tiny: 2 layers, dim 64, 4 query heads over 2 KV groups (GQA), head_dim 16."""
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    dim, vocab = 64, 128
    cfg = llama3.Llama3Model.Config(
        dim=dim, vocab_size=vocab,
        tok_embeddings=Embedding.Config(num_embeddings=vocab, embedding_dim=dim, param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=dim, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=dim, out_features=vocab, param_init=llama3._output_linear_init(dim)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=True, n_layers=2, dim=dim, n_heads=4, n_kv_heads=2, hidden_dim=96, attn_backend="flex",
            rope=ComplexRoPE.Config(dim=16, max_seq_len=64, theta=10000, scaling="none")))
    set_llama3_sharding_config(cfg, enable_sp=False)
    return cfg.build()


def _llama3_body(rank, world, tp, container=False):
    import_torchtitan()
    from torch.distributed.tensor import DTensor
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import parallelize_llama

    from overlap_muon import QKVSplit
    from tests.models import set_grad

    torch.manual_seed(0)
    model = _tiny_llama3()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    par = ParallelismConfig(tensor_parallel_degree=tp, enable_sequence_parallel=False, spmd_backend="partial_dtensor")
    dims = ParallelDims.from_config(par, world)
    dims.build_mesh()
    parallelize_llama(model, parallel_dims=dims, parallelism=par, compile_config=CompileConfig(), ac_config=None,
                      training=TrainingConfig(mixed_precision_param="float32", mixed_precision_reduce="float32"),
                      dump_folder="/tmp")
    if container:  # chosen in torchtitan's config: the container its Trainer builds from config.optimizer
        from overlap_muon.torchtitan import OverlapMuonContainer

        attn = model.layers["0"].attention
        qkv = QKVSplit(n_heads=attn.n_heads, n_kv_heads=attn.n_kv_heads, head_dim=attn.head_dim, layout="grouped")
        opts = OverlapMuonContainer.Config(
            lr=0.02, adamw=dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1),
            options=dict(split={"layers.*.attention.qkv_linear.wqkv.weight": qkv},
                         adamw_groups=[{"params": lambda n, p: p.ndim == 1, "weight_decay": 0.0}]),
        ).build(model_parts=[model])
        opt = opts.optimizers[0]
    else:
        scope = {"model": model}
        exec(doc_snippet("docs/usage.md", "With torchtitan"), scope)  # the doc's snippet, verbatim
        opt = opts = scope["opt"]
    named = dict(model.named_parameters())
    # The reference: one process, wqkv as its Q, K, V parts (each its own Muon param), the rest whole.
    split = QKVSplit(n_heads=4, n_kv_heads=2, head_dim=16, layout="grouped")
    muon, pieces = {}, {}
    for n in opt.muon_param_names:
        if n.endswith("wqkv.weight"):
            pieces[n] = split.parts(tuple(full[n].shape))
            for k, rows in enumerate(pieces[n]):
                muon[(n, k)] = nn.Parameter(full[n][rows].clone())
        else:
            muon[(n, None)] = nn.Parameter(full[n].clone())
    adamw = {n: nn.Parameter(full[n].clone()) for n in full if n not in opt.muon_param_names}
    mu = torch.optim.Muon(list(muon.values()), lr=0.02)
    aw = torch.optim.AdamW([{"params": [p for p in adamw.values() if p.ndim != 1]},
                            {"params": [p for p in adamw.values() if p.ndim == 1], "weight_decay": 0.0}],
                           lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1)
    for s in range(STEPS):
        gen = torch.Generator().manual_seed(100 + s)
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in full.items()}
        for n, p in named.items():
            if isinstance(p, DTensor):
                set_grad(p, grads[n], None, 1, 1, 0, 0)
            else:
                p.grad = grads[n].clone()
        for (n, k), p in muon.items():
            p.grad = (grads[n] if k is None else grads[n][pieces[n][k]]).clone()
        for n, p in adamw.items():
            p.grad = grads[n].clone()
        opts.step()
        opts.zero_grad()
        mu.step()
        aw.step()
    opt.synchronize()
    bad = []
    for n, p in named.items():
        got = p.full_tensor() if isinstance(p, DTensor) else p.detach()
        if n in adamw:
            exp = adamw[n].detach()
        elif n in pieces:
            exp = torch.empty_like(full[n])
            for k, rows in enumerate(pieces[n]):
                exp[rows] = muon[(n, k)].detach()
        else:
            exp = muon[(n, None)].detach()
        if not torch.equal(got, exp):
            bad.append(n)
    mesh_names = tuple(named["layers.0.attention.qkv_linear.wqkv.weight"].device_mesh.mesh_dim_names)
    names = opt.muon_param_names
    opt.close()
    return bad, mesh_names, names


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,tp", [(1, 1), (2, 1), (4, 2)], ids=["world1", "fsdp2", "fsdp2_tp2"])
def test_llama3_doc_snippet_bitwise(world, tp):
    """torchtitan's Llama3 class under its own ``parallelize_llama`` (``spmd_backend="partial_dtensor"``: the
    default ``spmd_types`` backend refuses plain params in ``fully_shard`` on this path), on CPU gloo: world 1 (FSDP
    over one rank), FSDP 2, and FSDP 2 x TP 2 (``wqkv`` ``(_StridedShard(0), Shard(0))`` on ``("fsdp", "tp")``).
    The snippet's ``split=`` orthogonalizes ``wqkv``'s Q, K, V (torchtitan's grouped rows) as three matrices."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    for bad, mesh_names, names in run_ranks(_llama3_body, world, tp, timeout=500):
        assert mesh_names == (("fsdp", "tp") if tp > 1 else ("fsdp",)), mesh_names
        assert "lm_head.weight" not in names and "layers.1.attention.qkv_linear.wqkv.weight" in names, names
        assert not bad, bad


@pytest.mark.timeout(600)
def test_llama3_container_from_config_fsdp2():
    """The same at FSDP 2 with the optimizer chosen in torchtitan's config: ``OverlapMuonContainer.Config(...)``
    built on the model part as torchtitan's ``Trainer`` builds ``config.optimizer`` (the split and the AdamW groups
    passed through ``options``), on the params' own mesh."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    for bad, mesh_names, _ in run_ranks(_llama3_body, 2, 1, True, timeout=500):
        assert mesh_names == ("fsdp",) and not bad, (mesh_names, bad)


@pytest.mark.bf16_heavy
def test_deepseek_v3_moe_experts_world1_bitwise():
    """torchtitan's MoE model class (DeepSeek-V3 ``debugmodel``, 2 of its layers: one dense, one MoE with 8 experts)
    with the doc's ``experts=`` pattern, ``layers.*.moe.routed_experts.inner_experts.w*`` (grouped ``w1_EFD``,
    ``w2_EDF``, ``w3_EFD``, each ``(8, 256, 256)``): every expert matrix gets torch.optim.Muon as its own param, the
    dense matrices (shared experts included) Muon whole, the rest AdamW, bitwise, at world 1. EP 2 is not run here:
    the efsdp/ep placements it gives are covered by ``tests/test_experts.py``."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    from torchtitan.models import deepseek_v3

    from overlap_muon import OverlapMuon
    cfg = deepseek_v3.model_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    torch.manual_seed(0)
    model = cfg.build()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape) * 0.05)
    full = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = OverlapMuon(model, experts="layers.*.moe.routed_experts.inner_experts.w*", lr=0.02,
                      adamw_kwargs=dict(lr=3e-4, weight_decay=0.1))
    names = opt.muon_param_names
    assert "layers.1.moe.routed_experts.inner_experts.w2_EDF[7]" in names, names
    ref = {}
    for n in names:
        base, _, e = n.partition("[")
        ref[n] = nn.Parameter((full[base][int(e[:-1])] if e else full[base]).clone())
    bases = {n.partition("[")[0] for n in names}
    adamw = {n: nn.Parameter(v.clone()) for n, v in full.items() if n not in bases}
    mu = torch.optim.Muon(list(ref.values()), lr=0.02)
    aw = torch.optim.AdamW(list(adamw.values()), lr=3e-4, weight_decay=0.1)
    for s in range(2):
        gen = torch.Generator().manual_seed(100 + s)
        grads = {n: torch.randn(v.shape, generator=gen) for n, v in full.items()}
        for n, p in model.named_parameters():
            p.grad = grads[n].clone()
        for n, p in ref.items():
            base, _, e = n.partition("[")
            p.grad = (grads[base][int(e[:-1])] if e else grads[base]).clone()
        for n, p in adamw.items():
            p.grad = grads[n].clone()
        opt.step()
        mu.step()
        aw.step()
    opt.synchronize()
    got = dict(model.named_parameters())
    bad = [n for n in ref if not torch.equal(got[n.partition("[")[0]][int(n.partition("[")[2][:-1])]
                                             if "[" in n else got[n], ref[n].detach())]
    bad += [n for n in adamw if not torch.equal(got[n], adamw[n].detach())]
    opt.close()
    assert not bad, bad


def test_torchtitan_flat_checkpoint_resumes_bitwise():
    """torchtitan's checkpoint helpers (``components.optimizer.utils``: ``init_optim_state``'s zero-gradient, ``lr=0``
    step, then the FQN-keyed flat state dict its checkpointer saves and loads) on ``OverlapMuon``: every param group
    names its params (``param_names``), the state step leaves the weights as they were, and a run resumed from the
    saved weights and flat state ends bitwise where the uninterrupted run does."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    import copy

    from torchtitan.components.optimizer.utils import (get_flat_optim_state_dict, init_optim_state,
                                                       load_flat_optim_state_dict)

    from overlap_muon import OverlapMuon
    from tests.models import ADAMW_KW, HP, Deep

    def build(model):
        model.gain = nn.Parameter(torch.ones(16))
        return model

    def steps(model, opt, seeds):
        for s in seeds:
            x = torch.randn(4, 16, generator=torch.Generator().manual_seed(s))
            (model(x) * model.gain).pow(2).sum().backward()
            opt.step()
            opt.zero_grad()

    torch.manual_seed(0)
    model = build(Deep(n=3))
    opt = OverlapMuon(model, **HP, adamw_kwargs=ADAMW_KW)
    assert all(len(g["param_names"]) == len(g["params"]) for g in opt.param_groups)
    fresh = [p.detach().clone() for p in model.parameters()]
    init_optim_state(opt)  # the zero step on a fresh optimizer changes no weight
    assert all(torch.equal(a, b) for a, b in zip(fresh, model.parameters()))
    steps(model, opt, [1, 2])
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(get_flat_optim_state_dict(opt))
    assert "state.layers.0.weight.momentum_buffer" in saved_opt and "state.gain.exp_avg" in saved_opt
    steps(model, opt, [3, 4])
    opt.close()

    torch.manual_seed(0)
    resumed = build(Deep(n=3))
    resumed.load_state_dict(saved_model)
    opt2 = OverlapMuon(resumed, **HP, adamw_kwargs=ADAMW_KW)
    init_optim_state(opt2)
    load_flat_optim_state_dict(opt2, saved_opt)
    steps(resumed, opt2, [3, 4])
    opt2.close()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))


def _container_body(rank, world, folder):
    import_torchtitan()
    import copy

    from torchtitan.components.checkpointer.dcp import CheckpointManager
    from torchtitan.components.optimizer import LRSchedulersContainer

    from overlap_muon.torchtitan import OverlapMuonContainer
    from tests.models import ADAMW_KW, HP, MuonAdamW

    def grads(model, step):
        gen = torch.Generator().manual_seed(step)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)

    def run(model, opts, scheds, steps):
        for s in steps:
            grads(model, s)
            opts.step()
            scheds.step()
            opts.zero_grad()

    def build(model):
        opts = OverlapMuonContainer.Config(**HP, adamw=ADAMW_KW).build(model_parts=[model])
        scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=6)
        ckpt = CheckpointManager(CheckpointManager.Config(enable=True, interval=1, last_save_model_only=False),
                                 dataloader=None, model_parts=[model], optimizers=opts, lr_schedulers=scheds,
                                 states={}, sd_adapter=None, base_folder=folder)
        return opts, scheds, ckpt

    torch.manual_seed(0)
    model = _tiny_llama3()
    ref = copy.deepcopy(model)
    opts, scheds, ckpt = build(model)
    names = set(opts.optimizers[0].muon_param_names)
    named = dict(ref.named_parameters())
    ref_opt = MuonAdamW([p for n, p in named.items() if n in names], [p for n, p in named.items() if n not in names])
    ref_sched = torch.optim.lr_scheduler.LambdaLR(ref_opt, scheds.schedulers[0].lr_lambdas[0])
    run(model, opts, scheds, [0, 1, 2])
    ckpt.save(curr_step=3)
    ckpt.close()
    run(model, opts, scheds, [3, 4, 5])
    run(ref, ref_opt, ref_sched, range(6))
    same_as_torch = all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))
    for opt in opts:
        opt.close()

    torch.manual_seed(1)  # other initial weights: the checkpoint must bring them
    resumed = _tiny_llama3()
    opts2, scheds2, ckpt2 = build(resumed)
    loaded = ckpt2.load(step=3)
    run(resumed, opts2, scheds2, [3, 4, 5])
    same_as_uninterrupted = all(torch.equal(a, b) for a, b in zip(model.parameters(), resumed.parameters()))
    ckpt2.close()
    for opt in opts2:
        opt.close()
    return same_as_torch, loaded, same_as_uninterrupted


def test_container_chosen_in_config_with_scheduler_and_checkpointer(tmp_path):
    """``OverlapMuonContainer.Config(...).build(model_parts=...)``, as torchtitan's ``Trainer`` builds
    ``config.optimizer``, with torchtitan's own ``LRSchedulersContainer`` (warmup then linear decay, over every
    group): bitwise ``torch.optim.Muon`` + ``AdamW`` under the same ``LambdaLR``; torchtitan's ``CheckpointManager``
    (DCP, FQN-keyed flat optimizer state) saves at step 3 and a new model, container and scheduler loaded from it end
    bitwise where the uninterrupted run does."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    assert run_ranks(_container_body, 1, str(tmp_path), timeout=150) == [(True, True, True)]


def test_container_two_model_parts_one_rank():
    """Two model parts on one rank (the virtual stages of an interleaved pipeline schedule, each with its own names):
    one ``OverlapMuon`` each, stepped, scheduled and checkpointed together, bitwise ``torch.optim.Muon`` + ``AdamW``
    on the same split; the flat state dict holds each part's state under its own names."""
    why = import_torchtitan()
    if why:
        pytest.skip(why)
    import copy

    from torchtitan.components.optimizer import LRSchedulersContainer

    from overlap_muon.torchtitan import OverlapMuonContainer
    from tests.models import ADAMW_KW, HP, Deep, MuonAdamW

    def part(name, n):
        m = nn.Module()
        setattr(m, name, Deep(n=n))
        setattr(m, f"{name}_gain", nn.Parameter(torch.ones(16)))
        return m

    torch.manual_seed(0)
    parts = [part("a", 2), part("b", 3)]
    refs = copy.deepcopy(parts)
    opts = OverlapMuonContainer.Config(**HP, adamw=ADAMW_KW).build(model_parts=parts)
    scheds = LRSchedulersContainer.Config(warmup_steps=2).build(optimizers=opts, training_steps=4)
    assert len(opts) == 2
    ref_opts = [MuonAdamW([p for p in r.parameters() if p.ndim == 2], [p for p in r.parameters() if p.ndim == 1])
                for r in refs]
    ref_scheds = [torch.optim.lr_scheduler.LambdaLR(o, scheds.schedulers[0].lr_lambdas[0]) for o in ref_opts]
    for s in range(4):
        gen = torch.Generator().manual_seed(s)
        for a, b in zip([p for m in parts for p in m.parameters()], [p for m in refs for p in m.parameters()]):
            a.grad = torch.randn(a.shape, generator=gen)
            b.grad = a.grad.clone()
        opts.step()
        scheds.step()
        opts.zero_grad()
        for o, sch in zip(ref_opts, ref_scheds):
            o.step()
            sch.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for m, r in zip(parts, refs) for a, b in zip(m.parameters(), r.parameters()))
    flat = opts.state_dict()
    assert {k for k in flat if k.endswith("momentum_buffer")} == {
        *(f"state.a.layers.{i}.weight.momentum_buffer" for i in range(2)),
        *(f"state.b.layers.{i}.weight.momentum_buffer" for i in range(3))}
    for opt in opts:
        opt.close()
