"""Lightning 2.6 (``lightning.pytorch``) driving ``OverlapMuon`` from ``configure_optimizers``: bitwise the same
``Trainer`` run with ``torch.optim.Muon`` + ``torch.optim.AdamW`` on the same split, and under ``strategy="ddp"`` (2
CPU ranks, launched here: Lightning sees ``LOCAL_RANK`` and launches nothing) the overlap kept by
:class:`overlap_muon.lightning.OverlapMuonCallback`: no wave re-runs.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, Deep, MuonAdamW, snapshot_mismatches

L = pytest.importorskip("lightning", reason="the tests drive Lightning's own Trainer")

STEPS = 4


class Lit(L.LightningModule):
    """Deep's linears to Muon, the gain to AdamW; ``make_opt(module)`` is its ``configure_optimizers``."""

    def __init__(self, make_opt) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net, self.gain, self.make_opt = Deep(n=4, d=16), nn.Parameter(torch.ones(16)), make_opt

    def training_step(self, batch, _):
        (x,) = batch
        return (self.net(x) * self.gain).pow(2).mean()

    def configure_optimizers(self):
        return self.make_opt(self)


class _Snapshots(L.Callback):
    """The module's params after every optimizer step (``model.snapshots``)."""

    def on_train_batch_end(self, trainer, pl_module, *_):
        if trainer.global_step > len(pl_module.snapshots):
            pl_module.snapshots.append([p.detach().clone() for p in pl_module.parameters()])


def _fit(make_opt, world: int, callbacks: list, trainer_kw: dict):
    """``Trainer.fit`` of a small module for STEPS steps; ``make_opt(module)`` is its ``configure_optimizers``,
    ``trainer_kw`` more of ``Trainer``'s arguments; the module keeps its params after every step (``snapshots``)."""
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)))
    model = Lit(make_opt)
    model.snapshots = []
    callbacks = [*callbacks, _Snapshots()]
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=world, num_nodes=1,
                        strategy="ddp" if world > 1 else "auto", callbacks=callbacks, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        **trainer_kw)
    trainer.fit(model, DataLoader(data, batch_size=4))
    return model


def _lightning_body(rank, world, trainer_kw, callback=True):
    """Both runs on this rank; returns (differing params, re-runs, waves)."""
    from overlap_muon import OverlapMuon
    from overlap_muon.lightning import OverlapMuonCallback

    if world > 1:
        os.environ["LOCAL_RANK"] = str(rank)  # the launcher is ours: Lightning joins the process group we made
    made: list = []
    model = _fit(lambda m: made.append(OverlapMuon(m, **HP, adamw_kwargs=ADAMW_KW)) or made[-1], world,
                 [OverlapMuonCallback()] if callback else [], trainer_kw)
    opt = made[0]
    names = set(opt.muon_param_names)
    ref = _fit(lambda m: MuonAdamW([p for n, p in m.named_parameters() if n in names],
                                   [p for n, p in m.named_parameters() if n not in names]), world, [], trainer_kw)
    opt.synchronize()
    bad = [n for (n, p), q in zip(model.named_parameters(), ref.parameters()) if not torch.equal(p, q)]
    bad += snapshot_mismatches(model.snapshots, ref.snapshots, STEPS)
    reruns, waves, ns = opt.stats["reruns"], len(opt.waves), opt.stats["ns_matrices"]
    opt.close()
    return bad, reruns, waves, ns, len(names)


_SLOW = pytest.mark.slow  # the default tier keeps one case of each: DDP plain, then one device for the others


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world, trainer_kw", [
    pytest.param(2, {}, id="ddp-plain"), pytest.param(1, {}, id="one-plain", marks=_SLOW),
    pytest.param(1, {"accumulate_grad_batches": 2}, id="one-accumulate"),
    pytest.param(2, {"accumulate_grad_batches": 2}, id="ddp-accumulate", marks=_SLOW),
    pytest.param(1, {"gradient_clip_val": 1e3}, id="one-clip", marks=_SLOW),
    pytest.param(2, {"gradient_clip_val": 1e3}, id="ddp-clip", marks=_SLOW),
    pytest.param(1, {"gradient_clip_val": 1e-4}, id="one-clip_bites"),
    pytest.param(2, {"gradient_clip_val": 1e-4}, id="ddp-clip_bites", marks=_SLOW)])
def test_lightning_configure_optimizers_bitwise_and_overlapped(world, trainer_kw):
    """One device and ``strategy="ddp"``: bitwise, and no wave re-runs, also with gradient accumulation and a clip
    that does not bite; a clip that bites changes the gradients after backward, so those steps re-run their waves
    (exact; ``OverlapMuon(max_grad_norm=...)`` clips inside the step instead). Accumulating, NS runs once per matrix
    per step from the second step on: on one device the waves launch from the backward learned to be the last
    ([Note: learned accumulation] in ``scheduler/dispatch.py``; the first step's first backward launches them
    too); under DDP, Lightning skips DDP's sync on the first micro-batches, and with it the readiness signals."""
    out = run_ranks(_lightning_body, world, trainer_kw, timeout=250)
    for bad, reruns, waves, _, _ in out:
        assert bad == [], bad
        assert (reruns > 0) == (trainer_kw.get("gradient_clip_val") == 1e-4), (reruns, waves)
    acc = trainer_kw.get("accumulate_grad_batches", 1)
    if "gradient_clip_val" not in trainer_kw:
        for _, _, _, ns, mats in out:  # each DDP replica runs every NS (a domain of one rank)
            assert ns == mats * (STEPS + (acc - 1 if world == 1 else 0)), (ns, mats)


@pytest.mark.timeout(300)
def test_lightning_ddp_without_the_callback_keeps_the_overlap():
    """``strategy="ddp"`` without ``OverlapMuonCallback``: Lightning wraps the module in DDP
    (``gradient_as_bucket_view=False``) after ``configure_optimizers`` built the optimizer. Bug: 16 re-runs of 36
    waves and 4 extra-backward re-runs, unless the user knew the callback. Now the DDP is found at its first
    forward and attached: bitwise, no re-run."""
    for bad, reruns, waves, _, _ in run_ranks(_lightning_body, 2, {}, False, timeout=250):
        assert bad == [] and reruns == 0, (bad, reruns, waves)


def _resume_body(rank, world, folder):
    """4 steps at once, and 2 steps, a Lightning checkpoint, then a new Trainer resuming to step 4 from it."""
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch.utils.data import DataLoader, TensorDataset

    from overlap_muon import OverlapMuon
    from overlap_muon.lightning import OverlapMuonCallback

    def fit(steps, ckpt=None, save=False):
        model = Lit(lambda m: OverlapMuon(m, **HP, adamw_kwargs=ADAMW_KW))
        callbacks = [OverlapMuonCallback()] + ([ModelCheckpoint(dirpath=folder, every_n_train_steps=2,
                                                               save_top_k=-1)] if save else [])
        trainer = L.Trainer(max_steps=steps, accelerator="cpu", devices=1, callbacks=callbacks, logger=False,
                            enable_checkpointing=save, enable_progress_bar=False, enable_model_summary=False)
        data = TensorDataset(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)))  # 2 steps an epoch
        trainer.fit(model, DataLoader(data, batch_size=4), ckpt_path=ckpt)
        trainer.optimizers[0].close()
        return model

    whole = fit(4)
    fit(2, save=True)
    resumed = fit(4, ckpt=os.path.join(folder, "epoch=0-step=2.ckpt"))
    return [n for (n, p), q in zip(whole.named_parameters(), resumed.parameters()) if not torch.equal(p, q)]


@pytest.mark.timeout(200)
def test_lightning_checkpoint_resumes_bitwise(tmp_path):
    """Lightning's checkpoint (``ModelCheckpoint``; ``Trainer.fit(ckpt_path=...)`` reloads the optimizer's
    ``state_dict``): 2 steps, save, resume to 4 ends bitwise where 4 steps at once do. The checkpoint closes an epoch:
    resumed mid-epoch, Lightning restarts a plain ``DataLoader``'s epoch, whatever the optimizer."""
    assert run_ranks(_resume_body, 1, str(tmp_path), timeout=150) == [[]]


def _model_parallel_body(rank, world, tp):
    """``ModelParallelStrategy``, FSDP2 over ``data_parallel`` or (``tp``) Lightning's TP plan over ``tensor_parallel``
    in ``configure_model``: OverlapMuon(self) finds the mesh of the sharded params by itself; overlap on and off, the
    same fit."""
    from lightning.pytorch.strategies import ModelParallelStrategy
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    from torch.utils.data import DataLoader, TensorDataset

    from overlap_muon import OverlapMuon
    from overlap_muon.lightning import OverlapMuonCallback

    os.environ["LOCAL_RANK"] = str(rank)

    class Sharded(Lit):
        def forward(self, x):  # FSDP2 gathers the root's params around forward, which training_step is not
            return self.net(x) * self.gain

        def training_step(self, batch, _):
            (x,) = batch
            return self(x).pow(2).mean()

        def configure_model(self):
            if tp:  # pairs: column-wise then row-wise, the activation between them sharded
                plan = {f"layers.{i}": ColwiseParallel() if i % 2 == 0 else RowwiseParallel() for i in range(4)}
                parallelize_module(self.net, self.device_mesh["tensor_parallel"], plan)
                return
            for layer in self.net.layers:
                fully_shard(layer, mesh=self.device_mesh["data_parallel"])
            fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def fit(overlap):
        made: list = []
        model = Sharded(lambda m: made.append(OverlapMuon(m, **HP, adamw_kwargs=ADAMW_KW, overlap=overlap))
                        or made[-1])
        trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=world, num_nodes=1,
                            strategy=ModelParallelStrategy(data_parallel_size=1 if tp else world,
                                                           tensor_parallel_size=world if tp else 1),
                            callbacks=[OverlapMuonCallback()], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False)
        data = TensorDataset(torch.randn(64, 16, generator=torch.Generator().manual_seed(1)))
        trainer.fit(model, DataLoader(data, batch_size=4))
        made[0].synchronize()
        out = [p.full_tensor() if hasattr(p, "full_tensor") else p.detach() for p in model.parameters()], \
            made[0].stats["reruns"]
        made[0].close()
        return out

    (on, reruns), (off, _) = fit(True), fit(False)
    return all(torch.equal(a, b) for a, b in zip(on, off)), reruns


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["fsdp2", "tp2"])
def test_lightning_model_parallel(tp):
    """``ModelParallelStrategy`` on 2 CPU ranks, FSDP2 or TP applied in ``configure_model``: ``OverlapMuon(self)``
    needs no ``device_mesh`` (the params' one mesh is taken, its dims recognized by Lightning's names), bitwise
    overlap off, no wave re-runs."""
    for same, reruns in run_ranks(_model_parallel_body, 2, tp, timeout=250):
        assert same and reruns == 0, (same, reruns)
