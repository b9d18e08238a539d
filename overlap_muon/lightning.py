"""Lightning 2.x: ``configure_optimizers`` returns ``OverlapMuon(self, ...)``; one callback keeps the overlap under DDP.

With ``strategy="ddp"`` Lightning wraps the ``LightningModule`` in ``DistributedDataParallel`` without bucket
views; the optimizer finds that DDP at the first forward and attaches to it (``hooks.watch_for_ddp``; [Note: DDP
readiness] in ``hooks/ddp_readiness.py``), so the waves read DDP's averaged gradients with no callback.
:class:`OverlapMuonCallback` also asks the strategy for ``gradient_as_bucket_view=True`` at ``setup`` (before the
wrap: ``.grad`` is then the bucket itself, no copy) and attaches each ``OverlapMuon`` of the trainer to the DDP
module when fitting starts. Without DDP (one device, ``ModelParallelStrategy``'s FSDP2 and TP) it does nothing.

Usage (one line)::

    trainer = lightning.Trainer(..., callbacks=[OverlapMuonCallback()])

Needs ``lightning`` (imported with this module).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from .optimizer import OverlapMuon

__all__ = ["OverlapMuonCallback"]


class OverlapMuonCallback(Callback):
    """A Lightning ``Callback`` that attaches the trainer's :class:`OverlapMuon` optimizers to the DDP module Lightning
    builds (``strategy="ddp"``); nothing otherwise."""

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        strategy = trainer.strategy
        # DDPStrategy(**kwargs) keeps the DDP keyword arguments here (no public setter): the wrap comes after setup
        kwargs = getattr(strategy, "_ddp_kwargs", None) if isinstance(strategy, DDPStrategy) else None
        if isinstance(kwargs, dict):
            kwargs.setdefault("gradient_as_bucket_view", True)  # a value the user chose stays (then one more copy)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            return
        for opt in trainer.optimizers:
            if not isinstance(opt, OverlapMuon):
                continue
            opt.attach_ddp(ddp)  # with or without bucket views ([Note: DDP readiness])
