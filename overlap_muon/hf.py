"""Hugging Face ``Trainer``: keep the overlap under the DDP that ``Trainer`` wraps the model in.

``Trainer`` wraps the model in ``DistributedDataParallel`` inside ``train()`` (through Accelerate), after the
optimizer exists, with ``gradient_as_bucket_view=False``. Under that DDP the gradient-ready hooks see each rank's
local gradient, and DDP's averaging then changes every gradient in place: ``step()`` re-runs every wave (exact, no
overlap). :class:`OverlapMuonCallback` asks Accelerate for ``gradient_as_bucket_view=True`` before the wrap and
attaches the optimizer to the DDP module when training begins (``OverlapMuon.attach_ddp``), so the waves read DDP's
averaged gradients as each bucket's all-reduce completes. Without DDP (one process, FSDP2, Hugging Face's own TP/FSDP
loading) it does nothing. ``Trainer``'s gradient clipping needs nothing here: a clip whose coefficient is 1 changes
no gradient and moves no counter ([Note: a clip that does not bite] in ``version_fix.py``).

Usage (one line after building the ``Trainer``)::

    trainer.add_callback(OverlapMuonCallback(trainer))

Needs ``transformers`` and ``accelerate`` (imported with this module).
"""

from __future__ import annotations

import weakref
from typing import Any

from accelerate.utils import DistributedDataParallelKwargs
from torch.nn.parallel import DistributedDataParallel
from transformers import TrainerCallback

from .optimizer import OverlapMuon

__all__ = ["OverlapMuonCallback"]


class OverlapMuonCallback(TrainerCallback):
    """A ``TrainerCallback`` that attaches the trainer's :class:`OverlapMuon` to the DDP module ``train()`` builds.

    Args:
        trainer: a ``transformers.Trainer`` built with ``optimizers=(OverlapMuon(...), scheduler)``, before
            ``train()``. Held weakly.

    Raises:
        TypeError: the trainer's optimizer is not an ``OverlapMuon``.
    """

    def __init__(self, trainer: Any) -> None:
        if not isinstance(trainer.optimizer, OverlapMuon):
            raise TypeError("OverlapMuonCallback: the Trainer's optimizer is "
                            f"{type(trainer.optimizer).__name__}, not an OverlapMuon; build the Trainer with "
                            "optimizers=(OverlapMuon(model, ...), scheduler)")
        self._trainer = weakref.ref(trainer)
        self._opt = weakref.ref(trainer.optimizer)
        accelerator = trainer.accelerator
        if accelerator.ddp_handler is None:
            accelerator.ddp_handler = DistributedDataParallelKwargs()
        accelerator.ddp_handler.gradient_as_bucket_view = True  # attach_ddp reads the averaged bucket in place

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer, opt = self._trainer(), self._opt()
        wrapped = getattr(trainer, "model_wrapped", None) if trainer is not None else None
        if opt is not None and isinstance(wrapped, DistributedDataParallel):
            opt.attach_ddp(wrapped)
