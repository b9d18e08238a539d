"""OverlapMuon as torchtitan and Hugging Face users build models (issue 16): named mesh dims and replicate dims, the
mesh error alone, the default Muon/AdamW split and its log, HF ``Conv1D`` weights, AdamW param groups.

The models here copy the libraries' layouts and names, so that these checks run without either library (the real
classes are in ``tests/test_torchtitan.py`` and ``tests/test_hf_trainer.py``): ``TitanLike`` has the module
names torchtitan's Llama3 had before it fused Q, K and V, and its ``parallelize_llama`` TP plan (without sequence parallel) on meshes named as torchtitan names them; ``LlamaLike`` has
HF ``LlamaForCausalLM``'s names and ``get_input/output_embeddings``; ``Conv1D`` is HF's ``pytorch_utils.Conv1D``.
Parity is ``torch.equal``: against overlap off and duplicated mode on the same mesh, or against ``torch.optim.Muon``
+ ``torch.optim.AdamW`` in one process.
"""

from __future__ import annotations

import copy
import logging
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, local

VOCAB, D, FF = 32, 16, 24


class RMSNorm(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def _attend(q, k, v):
    return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v


# ---------------------------------------------------------------------------------------------------------------
# torchtitan-like Llama: names and TP plan of torchtitan.models.llama3 (parallelize_llama, no sequence parallel)
# ---------------------------------------------------------------------------------------------------------------
class _TitanAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wq, self.wk, self.wv = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.wo = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.wo(_attend(self.wq(x), self.wk(x), self.wv(x)))


class _TitanFF(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w3 = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.w2 = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class _TitanBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attention_norm, self.attention = RMSNorm(D), _TitanAttention()
        self.ffn_norm, self.feed_forward = RMSNorm(D), _TitanFF()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLike(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleDict({str(i): _TitanBlock() for i in range(n_layers)})
        self.norm = RMSNorm(D)
        self.output = nn.Linear(D, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


TITAN_MUON = [f"layers.{i}.{n}.weight" for i in range(2) for n in
              ("attention.wq", "attention.wk", "attention.wv", "attention.wo", "feed_forward.w1", "feed_forward.w3",
               "feed_forward.w2")]


def _parallelize_titan(model: TitanLike, mesh, dp_dims: tuple[str, ...]) -> None:
    """torchtitan's Llama plan: TP over ``mesh["tp"]``, then FSDP2 (HSDP over two dp dims) per block and root."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = mesh["tp"]
    parallelize_module(model, tp, {"tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
                                   "output": ColwiseParallel(output_layouts=Replicate())})
    for block in model.layers.values():
        parallelize_module(block, tp, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(), "feed_forward.w1": ColwiseParallel(),
            "feed_forward.w3": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(),
        })
    dp = mesh[dp_dims] if len(dp_dims) > 1 else mesh[dp_dims[0]]
    for block in model.layers.values():
        fully_shard(block, mesh=dp)
    fully_shard(model, mesh=dp)


def _titan_body(rank, world, shape, names):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_dims = tuple(n for n in names if n != "tp")
    dp_index = 0
    for n in dp_dims:  # the data-parallel index of this rank: its coordinate over the dp dims
        dp_index = dp_index * mesh[n].size() + mesh[n].get_local_rank()
    out, nsd = {}, {}
    for tag, kw in (("overlap", dict(overlap=True)), ("sync", dict(overlap=False)),
                    ("duplicated", dict(overlap=True, mode="duplicated")), ("dp_slots", dict(overlap=True, dp_slots=True)),
                    ("dp_slots_sync", dict(overlap=False, dp_slots=True, wave_slots=None)),
                    ("dp_slots_team", dict(overlap=True, dp_slots=True, surplus="team"))):
        torch.manual_seed(0)
        model = TitanLike()
        _parallelize_titan(model, mesh, dp_dims)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            opt = OverlapMuon(model, device_mesh=mesh, remat_dim="dp_shard", tp_dim="tp", adamw_kwargs=ADAMW_KW,
                              **({"wave_slots": 2} | kw), **HP)
        # surplus with DP slots is not run: a warning says so where DP slots are on (a dp_replicate dim)
        warned = any("not combined with DP slots" in str(w.message) for w in caught)
        assert warned == (tag == "dp_slots_team" and "dp_replicate" in names), (tag, [str(w.message) for w in caught])
        ns = opt.stats
        assert opt.muon_param_names == TITAN_MUON, opt.muon_param_names
        for s in range(3):
            tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(100 * s + dp_index))
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out[tag] = [local(p).detach().clone() for p in model.parameters()]
        dom = (opt.domain.remat_size, opt.domain.tp_size)
        nsd[tag] = ns["ns_matrices"]
        opt.close()
    bad = {tag: [i for i, (a, b) in enumerate(zip(out["overlap"], out[tag])) if not torch.equal(a, b)]
           for tag in ("sync", "duplicated", "dp_slots", "dp_slots_sync", "dp_slots_team")}
    return bad, dom, nsd


@pytest.mark.timeout(300)
@pytest.mark.parametrize("shape,names,domain", [  # the default tier keeps the 3-D mesh with both dp dims
    pytest.param((1, 2), ("dp_shard", "tp"), (1, 2), marks=pytest.mark.slow),
    pytest.param((2, 2), ("dp_shard", "tp"), (2, 2), marks=pytest.mark.slow),
    ((2, 1, 2), ("dp_replicate", "dp_shard", "tp"), (1, 2)),
    pytest.param((2, 2, 1), ("dp_replicate", "dp_shard", "tp"), (2, 1), marks=pytest.mark.slow),
])
def test_torchtitan_named_mesh_bitwise(shape, names, domain):
    """Bug: a mesh named as torchtitan names it was rejected ("a 2-D device_mesh must have dims ('remat', 'tp')").
    Now ``remat_dim``/``tp_dim`` name the domain's dims; a ``dp_replicate`` dim is outside the domain (each replica
    is a domain of its own). Overlap on equals overlap off, duplicated mode and DP slots (HSDP replicas sharing the
    NS work, sync and overlap) bit for bit."""
    world = 1
    for s in shape:
        world *= s
    res = run_ranks(_titan_body, world, shape, names, timeout=270)
    for bad, dom, _ in res:
        assert dom == domain
        assert bad == {"sync": [], "duplicated": [], "dp_slots": [], "dp_slots_sync": [], "dp_slots_team": []}, bad
    # DP slots (dp_replicate meshes): the replicas share the NS work, each matrix is orthogonalized once per step
    # in the job instead of once per replica; without a replicate dim the option changes nothing.
    total = {tag: sum(n[tag] for _, _, n in res) for tag in ("overlap", "dp_slots", "dp_slots_sync")}
    replicas = shape[0] if names[0] == "dp_replicate" else 1
    assert total["overlap"] == replicas * total["dp_slots"] == replicas * total["dp_slots_sync"], total


def _wrong_name_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("shards", "tp"))
    torch.manual_seed(0)
    model = TitanLike()
    _parallelize_titan(model, mesh, ("shards",))
    try:
        OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, **HP)  # remat_dim defaults to "remat"
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_wrong_mesh_name_is_one_short_error():
    """Bug: a wrongly named mesh gave its one true clause followed by dozens of false per-param "has local shape
    ... on a 1x1 domain" clauses (4 KB for a 12-matrix model). Now the mesh error alone, naming the dims."""
    for msg in run_ranks(_wrong_name_body, 2, timeout=90):
        assert msg is not None
        assert "('shards', 'tp')" in msg and "remat_dim='remat'" in msg, msg
        assert "local shape" not in msg and "Muon param" not in msg, msg
        assert len(msg) < 500, msg


def test_mesh_dims_rules():
    """The dim rules, without a process group (``mesh_dims`` reads only ``ndim`` and ``mesh_dim_names``)."""
    from types import SimpleNamespace

    from overlap_muon._discovery import mesh_dims

    def mesh(*names):
        return SimpleNamespace(ndim=len(names), mesh_dim_names=names or None)

    assert mesh_dims(mesh("remat", "tp")) == (("remat", "tp"), None)
    assert mesh_dims(mesh("dp_shard", "tp"), "dp_shard") == (("dp_shard", "tp"), None)
    assert mesh_dims(mesh("dp_replicate", "dp_shard", "tp"), "dp_shard") == (("dp_shard", "tp"), None)
    assert mesh_dims(mesh("dp", "tp"), None) == ((None, "tp"), None)
    assert mesh_dims(mesh("tp")) == ((None, "tp"), None)
    assert mesh_dims(mesh("dp_shard")) == (("dp_shard", None), None)  # 1-D: remat unless named tp_dim
    assert "tp_dim='model'" in mesh_dims(mesh("dp_shard", "tp"), "dp_shard", "model")[1]
    assert "both" in mesh_dims(mesh("a", "b"), "a", "a")[1]
    # the defaults take the frameworks' names: torchtitan's, an HSDP mesh's, Lightning's
    assert mesh_dims(mesh("fsdp", "tp")) == (("fsdp", "tp"), None)
    assert mesh_dims(mesh("dp_replicate", "dp_shard", "tp")) == (("dp_shard", "tp"), None)
    assert mesh_dims(mesh("data_parallel", "tensor_parallel")) == (("data_parallel", "tensor_parallel"), None)
    assert mesh_dims(mesh("tensor_parallel")) == ((None, "tensor_parallel"), None)


# ---------------------------------------------------------------------------------------------------------------
# the default split, on HF Llama's names, with and without tied embeddings
# ---------------------------------------------------------------------------------------------------------------
class _HFAttention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(D, D, bias=False) for _ in range(3))
        self.o_proj = nn.Linear(D, D, bias=False)

    def forward(self, x):
        return self.o_proj(_attend(self.q_proj(x), self.k_proj(x), self.v_proj(x)))


class _HFMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(D, FF, bias=False), nn.Linear(D, FF, bias=False)
        self.down_proj = nn.Linear(FF, D, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _HFLayer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm, self.self_attn = RMSNorm(D), _HFAttention()
        self.post_attention_layernorm, self.mlp = RMSNorm(D), _HFMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class _HFBody(nn.Module):
    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        self.layers = nn.ModuleList([_HFLayer() for _ in range(n_layers)])
        self.norm = RMSNorm(D)

    def forward(self, tokens):
        h = self.embed_tokens(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.norm(h)


class LlamaLike(nn.Module):
    """HF ``LlamaForCausalLM``'s names; ``tie``: ``lm_head.weight`` is ``model.embed_tokens.weight``."""

    def __init__(self, n_layers: int = 2, tie: bool = False) -> None:
        super().__init__()
        self.model = _HFBody(n_layers)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        if tie:
            self.lm_head.weight = self.model.embed_tokens.weight

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def get_output_embeddings(self):
        return self.lm_head

    def forward(self, tokens):
        return self.lm_head(self.model(tokens))


HF_MUON = [f"model.layers.{i}.{n}.weight" for i in range(2) for n in
           ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
            "mlp.up_proj", "mlp.down_proj")]


def _train_vs_torch(model, opt_kw, muon_names, adamw_groups_ref=None, steps=3, sched=None):
    """Train ``model`` with OverlapMuon and a copy with torch.optim.Muon (``muon_names``) + AdamW; the params that
    differ (``torch.equal``) and the optimizer."""
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP, **opt_kw)
    named = dict(ref.named_parameters())
    mu = torch.optim.Muon([named[n] for n in muon_names], **HP)
    rest = [p for n, p in named.items() if n not in muon_names]
    aw = torch.optim.AdamW(adamw_groups_ref(ref) if adamw_groups_ref else rest, **ADAMW_KW)
    scheds = [sched(o) for o in (opt, mu, aw)] if sched else []
    for s in range(steps):
        tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(s))
        for m, os_ in ((model, [opt]), (ref, [mu, aw])):
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            for o in os_:
                o.step()
                o.zero_grad()
        for sc in scheds:
            sc.step()
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    return bad, opt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tie", [False, True])
def test_default_split_llama_embeddings_and_head_to_adamw(tie):
    """Bug: HF Llama's ``lm_head.weight`` went to Muon, and with tied embeddings ``embed_tokens.weight`` too. Now
    embeddings, weights tied to them and the output head go to AdamW; rank 0 logs the split (a table and a summary
    with counts and bytes); training equals torch.optim.Muon on the projections + AdamW on the rest."""
    torch.manual_seed(0)
    model = LlamaLike(tie=tie)
    log = logging.getLogger("overlap_muon")
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda r: records.append(r.getMessage())  # type: ignore[method-assign]
    level = log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        bad, opt = _train_vs_torch(model, {}, HF_MUON)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    text = "\n".join(records)
    assert opt.muon_param_names == HF_MUON
    assert not bad, bad
    rows = text.splitlines()
    assert any(r.split()[:3] == ["muon", "model.layers.*.self_attn.q_proj.weight", "x2"] for r in rows), rows
    emb = ["model.embed_tokens.weight", "=", "lm_head.weight"] if tie else ["model.embed_tokens.weight"]
    assert any(r.split()[1:1 + len(emb)] == emb and r.split()[0] == "adamw[0]" for r in rows), rows
    assert tie or any(r.split()[:2] == ["adamw[0]", "lm_head.weight"] for r in rows), rows
    n_adamw = sum(1 for _ in model.parameters()) - len(HF_MUON)
    muon_bytes = 2 * (4 * D * D + 3 * D * FF) * 4
    assert f"{len(HF_MUON)} Muon matrices ({muon_bytes} B), {n_adamw} AdamW params" in text, text
    opt.close()


def test_default_split_torchtitan_names():
    """torchtitan's ``output`` head and ``tok_embeddings`` go to AdamW by default."""
    opt = OverlapMuon(TitanLike(), **HP)
    assert opt.muon_param_names == TITAN_MUON
    opt.close()


# ---------------------------------------------------------------------------------------------------------------
# HF Conv1D (GPT-2): weights stored (in, out)
# ---------------------------------------------------------------------------------------------------------------
class Conv1D(nn.Module):
    """What ``transformers.pytorch_utils.Conv1D`` is: ``y = x @ W + b`` with ``W`` stored ``(nx, nf)``."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf, self.nx = nf, nx
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.2)
        self.bias = nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).reshape(*x.shape[:-1], self.nf)


class _Conv1DAsLinear(nn.Linear):
    def forward(self, x):  # Conv1D's ops on the same values and strides: forward and gradients match bit for bit
        w = self.weight.t().contiguous()
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), w).reshape(*x.shape[:-1], w.shape[1])


class GPT2Like(nn.Module):
    """GPT-2's names: ``wte`` tied to the output, a body of Conv1D (``c_attn`` (D, 3D), ``c_fc`` (D, FF), ...)."""

    def __init__(self, linear: bool = False) -> None:
        super().__init__()
        self.wte = nn.Embedding(VOCAB, D)
        self.ln = nn.LayerNorm(D)
        make = (lambda nf, nx: _Conv1DAsLinear(nx, nf)) if linear else Conv1D
        self.c_attn, self.c_proj = make(3 * D, D), make(D, D)
        self.c_fc, self.c_proj2 = make(FF, D), make(D, FF)

    def forward(self, tokens):
        h = self.wte(tokens)
        q, k, v = self.c_attn(self.ln(h)).split(D, dim=-1)
        h = h + self.c_proj(_attend(q, k, v))
        h = h + self.c_proj2(F.gelu(self.c_fc(h)))
        return h @ self.wte.weight.t()


GPT2_MUON = ["c_attn.weight", "c_proj.weight", "c_fc.weight", "c_proj2.weight"]


def _gpt2_pair(seed: int = 0):
    torch.manual_seed(seed)
    conv = GPT2Like()
    lin = GPT2Like(linear=True)
    with torch.no_grad():
        for (n, p), q in zip(conv.named_parameters(), lin.parameters()):
            q.copy_(p.t() if n in GPT2_MUON else p)
    return conv, lin


@pytest.mark.timeout(120)
@pytest.mark.parametrize("adjust_lr_fn", [None, "match_rms_adamw"])
def test_conv1d_weights_are_muon_matrices_as_their_transpose(adjust_lr_fn):
    """Bug: GPT-2's Conv1D body silently went to AdamW (only the tied ``wte`` went to Muon); with a ``p.ndim == 2``
    filter the lr ratio saw the transposed shape. Now Conv1D weights are Muon matrices, orthogonalized and lr-scaled
    as the (out, in) linear they are: equal bit for bit to torch.optim.Muon on the equivalent nn.Linear model."""
    conv, lin = _gpt2_pair()
    hp = dict(HP, adjust_lr_fn=adjust_lr_fn)
    opt = OverlapMuon(conv, adamw_kwargs=ADAMW_KW, wave_slots=1, **hp)
    assert opt.muon_param_names == GPT2_MUON
    named = dict(lin.named_parameters())
    mu = torch.optim.Muon([named[n] for n in GPT2_MUON], **hp)
    aw = torch.optim.AdamW([p for n, p in named.items() if n not in GPT2_MUON], **ADAMW_KW)
    for s in range(3):
        tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(s))
        for m, os_ in ((conv, [opt]), (lin, [mu, aw])):
            F.cross_entropy(m(tokens).flatten(0, 1), tokens.flatten()).backward()
            for o in os_:
                o.step()
                o.zero_grad()
    opt.synchronize()
    bad = [n for (n, p), q in zip(conv.named_parameters(), lin.parameters())
           if not torch.equal(p, q.t() if n in GPT2_MUON else q)]
    assert not bad, bad
    opt.close()


def _conv1d_fsdp_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))
    out = []
    for model in _gpt2_pair():
        fully_shard(model, mesh=mesh)
        opt = OverlapMuon(model, device_mesh=mesh, remat_dim="dp_shard", adamw_kwargs=ADAMW_KW,
                          **dict(HP, adjust_lr_fn="original"))
        for s in range(3):
            tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(10 * s + rank))
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        out.append({n: p.full_tensor() for n, p in model.named_parameters()})
        opt.close()
    conv, lin = out
    return [n for n in conv if not torch.equal(conv[n], lin[n].t() if n in GPT2_MUON else lin[n])]


@pytest.mark.timeout(120)
def test_conv1d_fsdp2_world2_equals_linear():
    """Conv1D weights sharded by FSDP2 over 2 ranks (rows of the stored (in, out) matrix): routed as stored, NS on the
    transpose at the home; equal bit for bit to the nn.Linear model on the same mesh."""
    for bad in run_ranks(_conv1d_fsdp_body, 2, timeout=90):
        assert not bad, bad


# ---------------------------------------------------------------------------------------------------------------
# AdamW param groups: schedulers and DCP
# ---------------------------------------------------------------------------------------------------------------
NO_DECAY = {"params": lambda n, p: p.ndim == 1, "weight_decay": 0.0}
EMB = {"params": ["model.embed_tokens.weight"], "lr": 1e-2}


def _ref_groups(ref):
    named = dict(ref.named_parameters())
    emb = [named["model.embed_tokens.weight"]]
    nod = [p for n, p in named.items() if p.ndim == 1]
    rest = [p for n, p in named.items() if n not in HF_MUON and p.ndim != 1 and p is not emb[0]]
    return [{"params": nod, "weight_decay": 0.0}, {"params": emb, "lr": 1e-2}, {"params": rest}]


@pytest.mark.timeout(120)
def test_adamw_groups_with_scheduler_bitwise():
    """Bug: no per-group AdamW settings (``adamw_kwargs`` was global, ``add_param_group`` raises). Now ``adamw_groups``
    gives the AdamW part several groups (no weight decay on norms, another lr for the embedding), which a scheduler
    drives like any group; equal to torch.optim.AdamW with the same groups bit for bit."""
    torch.manual_seed(0)
    model = LlamaLike()
    sched = lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))  # noqa: E731
    bad, opt = _train_vs_torch(model, dict(adamw_groups=[NO_DECAY, EMB]), HF_MUON, _ref_groups, steps=4, sched=sched)
    assert not bad, bad
    groups = [(g["algorithm"], len(g["params"]), g["weight_decay"], g["lr"] * 5) for g in opt.param_groups]
    n_norms = 2 * 2 + 1  # 4 steps of the scheduler: every lr is 1/5 of its group's initial lr
    assert groups == [("muon", 14, HP["weight_decay"], HP["lr"]), ("adamw", n_norms, 0.0, ADAMW_KW["lr"]),
                      ("adamw", 1, ADAMW_KW["weight_decay"], 1e-2), ("adamw", 1, ADAMW_KW["weight_decay"],
                                                                   ADAMW_KW["lr"])], groups
    opt.close()


def test_adamw_groups_errors():
    with pytest.raises(ValueError, match="'nope.weight', which is not a param"):
        OverlapMuon(LlamaLike(), adamw_groups=[{"params": ["nope.weight"]}])
    with pytest.raises(ValueError, match="a Muon param"):
        OverlapMuon(LlamaLike(), adamw_groups=[{"params": ["model.layers.0.mlp.up_proj.weight"]}])
    with pytest.raises(TypeError, match="'params' entry"):
        OverlapMuon(LlamaLike(), adamw_groups=[{"lr": 1.0}])


def _dcp_groups_body(rank, world, path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp_shard",))

    def build(seed):
        torch.manual_seed(seed)
        model = LlamaLike()
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        opt = OverlapMuon(model, device_mesh=mesh, remat_dim="dp_shard", adamw_kwargs=ADAMW_KW,
                          adamw_groups=[NO_DECAY, EMB], **HP)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        return model, opt, sched

    def train(model, opt, sched, steps):
        for s in steps:
            tokens = torch.randint(0, VOCAB, (2, 6), generator=torch.Generator().manual_seed(10 * s + rank))
            F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten()).backward()
            opt.step()
            opt.zero_grad()
            sched.step()

    model, opt, sched = build(0)
    train(model, opt, sched, range(2))
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "sched": sched.state_dict()}, checkpoint_id=path)
    train(model, opt, sched, range(2, 4))
    opt.synchronize()
    a = [local(p).detach().clone() for p in model.parameters()]
    lrs_a = [g["lr"] for g in opt.param_groups]
    opt.close()

    model2, opt2, sched2 = build(1)
    msd2, osd2 = get_state_dict(model2, opt2)
    sd = {"model": msd2, "optim": osd2, "sched": sched2.state_dict()}
    dcp.load(sd, checkpoint_id=path)
    set_state_dict(model2, opt2, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    sched2.load_state_dict(sd["sched"])
    train(model2, opt2, sched2, range(2, 4))
    opt2.synchronize()
    b = [local(p).detach().clone() for p in model2.parameters()]
    lrs_b = [g["lr"] for g in opt2.param_groups]
    groups = [(g["weight_decay"], len(g["params"])) for g in opt2.param_groups]
    opt2.close()
    return [i for i, (x, y) in enumerate(zip(a, b)) if not torch.equal(x, y)], lrs_a == lrs_b, groups


@pytest.mark.timeout(180)
def test_adamw_groups_dcp_round_trip(tmp_path):
    """FSDP2 at world 2 with three AdamW groups and a scheduler: get_state_dict -> dcp.save; a fresh model and
    optimizer; dcp.load -> set_state_dict; training on equals training through, bit for bit, group settings kept."""
    for bad, same_lrs, groups in run_ranks(_dcp_groups_body, 2, str(tmp_path / "ckpt"), timeout=150):
        assert not bad, bad
        assert same_lrs
        assert [wd for wd, _ in groups] == [HP["weight_decay"], 0.0, ADAMW_KW["weight_decay"],
                                            ADAMW_KW["weight_decay"]]


def test_many_param_errors_are_counted_not_listed():
    """One cause repeated over many params (here a filter that picks 24 1-D params) shows 8 messages and a count."""
    model = nn.Sequential(*[nn.LayerNorm(4) for _ in range(12)])
    with pytest.raises(ValueError, match=r"Muon needs a real 2-D matrix; and 16 more$"):
        OverlapMuon(model, muon_filter=lambda n, p: True)


def _tp_dim_named_otherwise_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("model",))
    m = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False))
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "1": RowwiseParallel()})
    try:
        OverlapMuon(m, device_mesh=mesh)
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.timeout(60)
def test_tp_mesh_dim_with_another_name_says_tp_dim():
    """Found by a new-user test: a 1-D TP mesh named "model" is read as the remat dim (documented), and the error
    suggested FSDP2's layout only; it now names ``tp_dim=`` as well."""
    for msg in run_ranks(_tp_dim_named_otherwise_body, 2, timeout=50):
        assert "on the remat dim 'model'" in msg and "tp_dim='model'" in msg, msg


def _fsdp1_body(rank, world, use_orig_params):
    from torch.distributed.fsdp import FullyShardedDataParallel

    torch.manual_seed(0)
    model = FullyShardedDataParallel(nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)), device_id=torch.device("cpu"),
                                     use_orig_params=use_orig_params)
    with pytest.raises(ValueError) as e:
        OverlapMuon(model)
    return str(e.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("use_orig_params", [False, True])
def test_fsdp1_is_a_clear_error_on_every_rank(use_orig_params):
    """FSDP1 (``FullyShardedDataParallel``, Lightning's ``FSDPStrategy``) flattens the weights: a ``ValueError`` on
    every rank naming the flat parameters and ``fully_shard`` (FSDP2) as the fix, not an AdamW-only optimizer."""
    for msg in run_ranks(_fsdp1_body, 2, use_orig_params, timeout=90):
        assert "FSDP1 flat parameters" in msg and "fully_shard" in msg, msg
