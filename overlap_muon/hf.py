"""Hugging Face ``Trainer``: choosing ``OverlapMuon`` there, and keeping the overlap under the DDP it wraps the model in.

Two routes choose it: ``Trainer(..., optimizers=(OverlapMuon(model, ...), None))``, or Trainer's factory protocol,
``Trainer(..., optimizer_cls_and_kwargs=(OverlapMuonFactory, {...}))``: ``Trainer.create_optimizer`` calls a factory
that is not an optimizer class as ``factory()(model, **kwargs)``, which builds ``OverlapMuon`` on the model Trainer
trains. (``optimizer_cls_and_kwargs=(OverlapMuon, ...)`` cannot work: Trainer then passes param groups, and
``OverlapMuon`` needs the model; an ``optim="..."`` string cannot either: Trainer's optimizer registry is private.)

``Trainer`` wraps the model in ``DistributedDataParallel`` inside ``train()`` (through Accelerate), after the
optimizer exists, with ``gradient_as_bucket_view=False``. The optimizer finds that DDP at its first forward and
attaches to it (``hooks.watch_for_ddp``; [Note: DDP readiness] in ``hooks/ddp_readiness.py``): the waves read
DDP's averaged buckets, with no callback. :class:`OverlapMuonCallback`, given the trainer, also asks Accelerate for
``gradient_as_bucket_view=True`` before the wrap (``.grad`` is then the bucket itself: no copy, less memory) and
attaches the optimizer (either route) when training begins. Without DDP (one process, FSDP2, Hugging Face's own
TP/FSDP loading) it does nothing. ``Trainer``'s gradient clipping needs nothing here: a clip whose coefficient is 1
changes no gradient and moves no counter ([Note: a clip that does not bite] in ``_version_fix.py``).

Usage (one line after building the ``Trainer``, on either route)::

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

__all__ = ["OverlapMuonCallback", "OverlapMuonFactory"]


class OverlapMuonFactory:
    """Trainer's optimizer factory: ``optimizer_cls_and_kwargs=(OverlapMuonFactory, kwargs)`` builds
    ``OverlapMuon(model, **kwargs)`` on the model ``Trainer`` trains (``kwargs``: :class:`OverlapMuon`'s, e.g.
    ``lr``, ``weight_decay``, ``adamw_kwargs``, ``device_mesh``)."""

    def __call__(self, model: Any, **kwargs: Any) -> OverlapMuon:
        return OverlapMuon(model, **kwargs)


def _overlap_muon(optimizer: Any) -> OverlapMuon | None:
    """``optimizer`` itself, or the one Accelerate's ``AcceleratedOptimizer`` wraps, when it is an OverlapMuon."""
    for opt in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(opt, OverlapMuon):
            return opt
    return None


class OverlapMuonCallback(TrainerCallback):
    """A ``TrainerCallback`` that attaches the trainer's :class:`OverlapMuon` to the DDP module ``train()`` builds.

    Args:
        trainer: the ``transformers.Trainer``, before ``train()``, built on either route (the optimizer may not
            exist yet: the factory builds it inside ``train()``). Held weakly. Without it the callback cannot reach
            Accelerate before the DDP wrap: under DDP it then warns once, with the fix, and the waves re-run.

    Raises:
        TypeError: the trainer already holds an optimizer that is not an ``OverlapMuon`` (at construction), or
            holds one when training begins (``on_train_begin``).
    """

    def __init__(self, trainer: Any = None) -> None:
        self._trainer = weakref.ref(trainer) if trainer is not None else None
        if trainer is None:
            return
        if trainer.optimizer is not None and _overlap_muon(trainer.optimizer) is None:
            raise TypeError(_not_ours(trainer.optimizer))
        accelerator = trainer.accelerator
        if accelerator.ddp_handler is None:
            accelerator.ddp_handler = DistributedDataParallelKwargs()
        accelerator.ddp_handler.gradient_as_bucket_view = True  # attach_ddp reads the averaged bucket in place

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        opt = _overlap_muon(optimizer)
        if opt is None:
            raise TypeError(_not_ours(optimizer))
        trainer = self._trainer() if self._trainer is not None else None
        wrapped = getattr(trainer, "model_wrapped", None)
        if isinstance(wrapped, DistributedDataParallel):
            opt.attach_ddp(wrapped)  # (without the trainer, the optimizer finds the DDP at its first forward)


def _not_ours(optimizer: Any) -> str:
    return (f"OverlapMuonCallback: the Trainer's optimizer is {type(optimizer).__name__}, not an OverlapMuon; build "
            "the Trainer with optimizers=(OverlapMuon(model, ...), None) or "
            "optimizer_cls_and_kwargs=(OverlapMuonFactory, {...})")
