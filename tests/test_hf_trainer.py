"""Hugging Face ``Trainer`` (transformers 5.x, with Accelerate) driving ``OverlapMuon``: exact, and the overlap kept.

Each case trains a tiny ``LlamaForCausalLM`` twice with the same ``TrainingArguments`` (same seed, so the same
batches): once with ``OverlapMuon``, once with ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split, and
compares the weights with ``torch.equal``. It also counts the waves re-run in ``step()``: before [Note: a clip that
does not bite] (``overlap_muon/_version_fix.py``) and :class:`overlap_muon.hf.OverlapMuonCallback`, every wave of
every step re-ran under ``Trainer``, whatever ``max_grad_norm``.
"""

from __future__ import annotations

import copy
import logging
import os
import tempfile

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, MuonAdamW, local, snapshot_mismatches

pytest.importorskip("transformers", reason="the tests drive transformers' own Trainer")
pytest.importorskip("accelerate", reason="transformers' Trainer runs on Accelerate")

STEPS = 3


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2))


def _fit(model: nn.Module, opt: torch.optim.Optimizer | None, max_grad_norm: float, callback: bool,
         factory: dict | None = None, accumulate: int = 1, reentrant: bool = False):
    """``Trainer.train()`` for STEPS steps (Trainer's default linear lr decay, no checkpoints), with ``opt`` or, given
    ``factory`` (OverlapMuon's keyword arguments), Trainer's factory route; returns the trainer, whose
    ``snapshots`` are the model's params after every step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments

    class Snapshots(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trainer.snapshots.append([local(p).detach().clone() for p in model.parameters()])

    from overlap_muon.hf import OverlapMuonFactory

    gen = torch.Generator().manual_seed(1)
    ds = [{"input_ids": torch.randint(0, 64, (16,), generator=gen), "labels": torch.randint(0, 64, (16,), generator=gen)}
          for _ in range(16)]
    args = TrainingArguments(output_dir=tempfile.mkdtemp(), max_steps=STEPS, per_device_train_batch_size=2,
                             report_to=[], use_cpu=True, save_strategy="no", max_grad_norm=max_grad_norm,
                             logging_steps=1, disable_tqdm=True, seed=0, gradient_accumulation_steps=accumulate,
                             gradient_checkpointing=reentrant,
                             gradient_checkpointing_kwargs={"use_reentrant": True} if reentrant else None)
    route = dict(optimizers=(opt, None)) if factory is None else dict(optimizer_cls_and_kwargs=(OverlapMuonFactory,
                                                                                                 factory))
    trainer = Trainer(model=model, args=args, train_dataset=ds, **route)
    trainer.snapshots = []
    trainer.add_callback(Snapshots())
    if callback:
        from overlap_muon.hf import OverlapMuonCallback

        trainer.add_callback(OverlapMuonCallback(trainer))
    trainer.train()
    return trainer


def _trainer_body(rank, world, max_grad_norm, callback=True, fsdp=False, factory=False, accumulate=1,
                  reentrant=False):
    """Both runs on this rank; returns (differing params, re-runs, waves per step, steps where clipping bit)."""
    logging.disable(logging.WARNING)
    # Accelerate reads torchrun's variables: with them it wraps DDP; at world 1 it runs the plain loop without them.
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    if world == 1:
        for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            del os.environ[name]
    model = _tiny_llama()
    ref = copy.deepcopy(model)
    kw = {}
    if fsdp:  # fully_shard by hand, then Trainer (it moves the model with swap_tensors: DTensor params)
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("remat",))
        for m in (model, ref):
            for layer in m.model.layers:
                fully_shard(layer, mesh=mesh)
            fully_shard(m, mesh=mesh)
        kw = dict(device_mesh=mesh)
    if factory:  # Trainer builds it inside train()
        trainer = _fit(model, None, max_grad_norm, callback, factory=dict(**HP, adamw_kwargs=ADAMW_KW, **kw))
        opt = trainer.optimizer.optimizer  # Accelerate's AcceleratedOptimizer wraps it
    else:
        opt = OverlapMuon(model, **HP, adamw_kwargs=ADAMW_KW, **kw)
        trainer = _fit(model, opt, max_grad_norm, callback, accumulate=accumulate, reentrant=reentrant)
    muon_names = set(opt.muon_param_names)
    bit = sum(h["grad_norm"] + 1e-6 > max_grad_norm > 0 for h in trainer.state.log_history if "grad_norm" in h)
    named = dict(ref.named_parameters())
    ref_trainer = _fit(ref, MuonAdamW([named[n] for n in named if n in muon_names],
                                      [named[n] for n in named if n not in muon_names]), max_grad_norm, False,
                       accumulate=accumulate, reentrant=reentrant)
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters())
           if not torch.equal(local(p).detach(), local(q).detach())]
    bad += snapshot_mismatches(trainer.snapshots, ref_trainer.snapshots, STEPS)
    reruns, waves = opt.stats["reruns"], len(opt.waves)
    ns = (opt.stats["ns_matrices"], len(muon_names))
    opt.close()
    return bad, reruns, waves, bit, ns


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("max_grad_norm", [pytest.param(0.0, marks=pytest.mark.slow), 1.0,
                                           pytest.param(100.0, marks=pytest.mark.slow)])  # 0 and 100: long tier
def test_trainer_keeps_the_overlap_and_is_exact(max_grad_norm, world):
    """World 1 (no DDP) and world 2 (Trainer's DDP, with the callback): bitwise the reference, and waves re-run
    only on the first step where clipping bites: the steps after it launch their waves after the clip ([Note:
    learned clipping] in ``scheduler/dispatch.py``) (``max_grad_norm=0``: Trainer still clips with ``inf`` to log
    the norm; ``100``: never bites; ``1.0``: bites on every step of this model)."""
    for bad, reruns, waves, bit, _ in run_ranks(_trainer_body, world, max_grad_norm, timeout=250):
        assert bad == [], bad
        assert reruns == waves * min(bit, 1), (reruns, waves, bit)
        if max_grad_norm != 1.0:
            assert bit == 0 and reruns == 0


@pytest.mark.timeout(300)
def test_trainer_factory_route_keeps_the_overlap():
    """``optimizer_cls_and_kwargs=(OverlapMuonFactory, {...})``: Trainer builds the optimizer inside ``train()``; the
    callback, added before it exists, finds it there and attaches it to Trainer's DDP: bitwise, 0 re-runs."""
    for bad, reruns, waves, bit, _ in run_ranks(_trainer_body, 2, 100.0, factory=True, timeout=250):
        assert bad == [] and bit == 0 and reruns == 0, (bad, reruns, waves)


@pytest.mark.timeout(200)
def test_fully_shard_then_trainer():
    """``fully_shard`` by hand, then ``Trainer`` (which moves the model with ``swap_tensors``): it trains, bitwise the
    reference, with no re-runs. (At world 2 Accelerate wraps an FSDP2 model in DDP and DDP fails on its DTensors,
    whatever the optimizer: Trainer needs its own FSDP plugin there, which refuses a machine without a GPU.)"""
    for bad, reruns, _, _, _ in run_ranks(_trainer_body, 1, 0.0, False, True, timeout=150):
        assert bad == [] and reruns == 0, (bad, reruns)


@pytest.mark.timeout(200)
def test_trainer_gradient_accumulation_without_no_sync():
    """``gradient_accumulation_steps=2`` in one process (Accelerate has no DDP to skip): bitwise, no re-runs, and NS
    once per matrix per step from the second step on ([Note: learned accumulation] in
    ``scheduler/dispatch.py``): only the first step's first backward runs NS beyond that."""
    for bad, reruns, _, _, (ns, mats) in run_ranks(_trainer_body, 1, 100.0, accumulate=2, timeout=150):
        assert bad == [] and reruns == 0, (bad, reruns)
        assert ns == mats * (STEPS + 1), (ns, mats)


def _accelerate_clip_fsdp2_body(rank, world, max_norm):
    """The clipping Trainer does, ``Accelerator.clip_grad_norm_``, on FSDP2 (DTensor) gradients at world 2."""
    from accelerate import Accelerator
    from torch.distributed.device_mesh import init_device_mesh

    from tests.models import TinyNet, fully_shard_tiny

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    accelerator = Accelerator(cpu=True)
    torch.manual_seed(0)
    model = TinyNet()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("remat",))
    fully_shard_tiny(model, mesh)
    opt = OverlapMuon(model, device_mesh=mesh, **HP, adamw_kwargs=ADAMW_KW)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(3))
    bites = []
    for _ in range(STEPS):
        model(x).pow(2).mean().backward()
        norm = accelerator.clip_grad_norm_(model.parameters(), max_norm)
        bites.append(bool(local(norm) + 1e-6 > max_norm))
        opt.step()
        opt.zero_grad()
    reruns, waves = opt.stats["reruns"], len(opt.waves)
    opt.close()
    return reruns, waves, sum(bites)


@pytest.mark.timeout(150)
@pytest.mark.parametrize("max_norm", [float("inf"), 1e-3])
def test_accelerate_clip_on_fsdp2_grads(max_norm):
    """FSDP2 at world 2: a clip that does not bite (``inf``, Trainer's logging clip) re-runs nothing; one that bites
    every step re-runs every wave of its first step, and the steps after it launch their waves after the clip
    ([Note: learned clipping] in ``scheduler/dispatch.py``)."""
    for reruns, waves, bit in run_ranks(_accelerate_clip_fsdp2_body, 2, max_norm, timeout=120):
        assert reruns == waves * min(bit, 1) and bit == (0 if max_norm == float("inf") else STEPS), (reruns, waves,
                                                                                                      bit)


def test_callback_without_the_trainer_takes_accelerates_optimizer():
    """Built without the trainer, the callback takes the optimizer Accelerate wraps (the DDP itself is found at
    its first forward: ``test_trainer_ddp_without_the_callback_keeps_the_overlap``), and refuses another
    optimizer."""
    import types
    import warnings

    from overlap_muon.hf import OverlapMuonCallback
    from tests.models import Deep

    model = Deep(n=2)
    opt = OverlapMuon(model, **HP)
    wrapped = types.SimpleNamespace(optimizer=opt)  # as Accelerate's AcceleratedOptimizer holds it
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        OverlapMuonCallback().on_train_begin(types.SimpleNamespace(world_size=2), None, None, optimizer=wrapped)
    with pytest.raises(TypeError, match="not an OverlapMuon"):
        OverlapMuonCallback().on_train_begin(types.SimpleNamespace(world_size=1), None, None,
                                             optimizer=torch.optim.SGD(model.parameters(), lr=0.1))
    opt.close()


@pytest.mark.timeout(200)
def test_trainer_reentrant_checkpointing_accumulation():
    """``gradient_checkpointing_kwargs={"use_reentrant": True}`` (public QLoRA/FSDP recipes) with
    ``gradient_accumulation_steps=2``. Bug: the accumulation was never learned (the decoder layers' hooks fire in
    nested graph tasks): NS 3 times per step. Now bitwise, no re-runs, NS once per matrix per step from step 2."""
    for bad, reruns, _, _, (ns, mats) in run_ranks(_trainer_body, 1, 100.0, accumulate=2, reentrant=True,
                                                   timeout=150):
        assert bad == [] and reruns == 0, (bad, reruns)
        assert ns == mats * (STEPS + 1), (ns, mats)


@pytest.mark.timeout(300)
def test_trainer_ddp_without_the_callback_keeps_the_overlap():
    """World 2 without ``OverlapMuonCallback``: Trainer wraps the model in DDP (``gradient_as_bucket_view=False``)
    inside ``train()``, after the optimizer exists. Bug: 56 of 112 waves re-ran unless the user knew the callback.
    Now the DDP is found at its first forward and attached: bitwise the reference, no re-run."""
    for bad, reruns, waves, bit, _ in run_ranks(_trainer_body, 2, 100.0, False, timeout=250):
        assert bad == [] and bit == 0 and reruns == 0, (bad, reruns, waves)

