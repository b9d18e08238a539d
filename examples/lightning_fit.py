"""Lightning: OverlapMuon from configure_optimizers, with the one callback that keeps the overlap under DDP.

    python examples/lightning_fit.py                                        # one process
    torchrun --standalone --nproc-per-node 2 examples/lightning_fit.py      # strategy="ddp" on 2 ranks

A small module trains for 4 steps; prints how many waves re-ran in step() (0: every wave overlapped backward).
``tests/test_lightning.py`` compares the same fit bitwise with torch.optim.Muon + torch.optim.AdamW. Needs lightning
(the project's test extra installs it).
"""

import os

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from overlap_muon import OverlapMuon
from overlap_muon.lightning import OverlapMuonCallback


class Net(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 16, bias=False), nn.Tanh(), nn.Linear(16, 8, bias=False))
        self.scale = nn.Parameter(torch.ones(8))

    def training_step(self, batch, _):
        x, y = batch
        return ((self.body(x) * self.scale - y) ** 2).mean()

    def configure_optimizers(self):
        return OverlapMuon(self, lr=0.02, adamw_kwargs=dict(lr=3e-4))   # the LightningModule is the model


world = int(os.environ.get("WORLD_SIZE", "1"))
gen = torch.Generator().manual_seed(1)
data = DataLoader(TensorDataset(torch.randn(64, 12, generator=gen), torch.randn(64, 8, generator=gen)), batch_size=4)
trainer = L.Trainer(max_steps=4, accelerator="cpu", devices=world, strategy="ddp" if world > 1 else "auto",
                    callbacks=[OverlapMuonCallback()],  # under strategy="ddp": waves read DDP's averaged gradients
                    logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
trainer.fit(Net(), data)
opt = trainer.optimizers[0]
if trainer.global_rank == 0:
    print(f"{len(opt.muon_param_names)} matrices on Muon, {opt.stats['reruns']} waves re-run in step()")
opt.close()
