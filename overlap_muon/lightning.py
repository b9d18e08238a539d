"""Lightning 2.x: ``configure_optimizers`` returns ``OverlapMuon(self, ...)``; one callback keeps the overlap under DDP.

With ``strategy="ddp"`` Lightning wraps the ``LightningModule`` in ``DistributedDataParallel`` before it calls
``configure_optimizers``, without bucket views: the optimizer, built on the module, then sees each rank's local
gradient through its per-param hooks, and DDP's averaging edits every gradient in place, so ``step()`` re-runs every
wave (exact, no overlap). :class:`OverlapMuonCallback` asks the strategy for ``gradient_as_bucket_view=True`` at
``setup`` (before the wrap) and, when fitting starts, attaches each ``OverlapMuon`` of the trainer to the DDP module
(``OverlapMuon.attach_ddp``): the waves read DDP's averaged gradients as each bucket's all-reduce completes. Without
DDP (one device, ``ModelParallelStrategy``'s FSDP2 and TP) it does nothing.

Usage (one line)::

    trainer = lightning.Trainer(..., callbacks=[OverlapMuonCallback()])

Needs ``lightning`` (imported with this module).
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch import Callback
from lightning.pytorch.strategies import DDPStrategy
from torch.nn.parallel import DistributedDataParallel

from .messages import warn_user
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
            kwargs.setdefault("gradient_as_bucket_view", True)  # a value the user chose stays (on_fit_start warns)

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        ddp = trainer.strategy.model
        if not isinstance(ddp, DistributedDataParallel):
            return
        for opt in trainer.optimizers:
            if not isinstance(opt, OverlapMuon):
                continue
            if ddp.gradient_as_bucket_view:
                opt.attach_ddp(ddp)
            else:
                warn_user("OverlapMuonCallback: Lightning's DDP was built without gradient_as_bucket_view, so every "
                          "wave re-runs in step() (exact, no overlap); use strategy=DDPStrategy("
                          "gradient_as_bucket_view=True)")
