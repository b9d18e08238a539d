"""torchtitan 0.3.0: ``OverlapMuon`` chosen in torchtitan's config, as torchtitan's users choose an optimizer.

torchtitan builds its optimizer from ``config.optimizer`` (an ``OptimizersContainer.Config``) with
``config.optimizer.build(model_parts=...)``, after parallelizing the model. :class:`OverlapMuonContainer` is an
``OptimizersContainer`` whose ``Config`` takes Muon's and AdamW's hyper-parameters and builds one ``OverlapMuon`` per
model part (a pipeline stage each), on the DTensor mesh of its params (``OverlapMuon`` takes it); torchtitan's ``Trainer``, its LR schedulers
(which drive every param group, Muon's and AdamW's) and its checkpointer (the FQN-keyed flat state dict, which needs
each group's ``param_names``) take it as they take the built-in container. In a config function::

    config.optimizer = OverlapMuonContainer.Config(lr=0.02, adamw=dict(lr=3e-4, weight_decay=0.1))

Needs ``torchtitan`` (imported with this module).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn
from torchtitan.components.optimizer import OptimizersContainer

from .optimizer import OverlapMuon

__all__ = ["OverlapMuonContainer"]


class OverlapMuonContainer(OptimizersContainer):
    """One :class:`OverlapMuon` per model part, as torchtitan's ``OptimizersContainer``.

    Args:
        config: the :class:`Config`.
        model_parts: the model parts torchtitan trains (one per pipeline stage; one without pipelining).

    Raises:
        ValueError / TypeError: as :class:`OverlapMuon` (a hyper-parameter out of range, a param that cannot be
            placed), on every rank before any collective.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(OptimizersContainer.Config):
        lr: float = 0.02
        """Muon's learning rate (``torch.optim.Muon``'s ``lr``)."""
        weight_decay: float = 0.1
        momentum: float = 0.95
        nesterov: bool = True
        ns_steps: int = 5
        adjust_lr_fn: str | None = None
        """``torch.optim.Muon``'s: ``None`` (its default), ``"original"``, ``"match_rms_adamw"`` or
        ``"spectral_unclamped"`` (torch 2.14's; accepted on every torch)."""
        adamw: dict[str, Any] = field(default_factory=lambda: dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8,
                                                                   weight_decay=0.1))
        """The AdamW part's keyword arguments (``torch.optim.AdamW``'s)."""
        remat_dim: str | None = "fsdp"
        """The mesh dim FSDP shards the params over (torchtitan names it ``fsdp``)."""
        tp_dim: str | None = "tp"
        """The tensor-parallel mesh dim."""
        options: dict[str, Any] = field(default_factory=dict)
        """Any other ``OverlapMuon`` keyword argument (``experts``, ``split``, ``expert_mesh``, ``overlap``, ...)."""

    def __init__(self, config: Config, *, model_parts: list[nn.Module]) -> None:
        self.model_parts = model_parts
        self.optimizers = [OverlapMuon(part, **_kwargs(config, part)) for part in model_parts]
        self._post_init([p for part in model_parts for p in part.parameters() if p.requires_grad])

    def step(self, closure: Any = None) -> Any:
        loss = None if closure is None else closure()
        for opt in self.optimizers:
            opt.step()
        return loss


def _kwargs(config: OverlapMuonContainer.Config, part: nn.Module) -> dict[str, Any]:
    """``OverlapMuon``'s arguments for one model part (its mesh is the one its params live on)."""
    return dict(lr=config.lr, weight_decay=config.weight_decay, momentum=config.momentum, nesterov=config.nesterov,
                ns_steps=config.ns_steps, adjust_lr_fn=config.adjust_lr_fn, adamw_kwargs=dict(config.adamw),
                remat_dim=config.remat_dim, tp_dim=config.tp_dim, **config.options)

