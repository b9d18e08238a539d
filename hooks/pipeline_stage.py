"""Gradient readiness from a ``torch.distributed.pipelining`` stage: once per schedule step, when the stage's
gradients are final.

[Note: pipeline readiness] A pipelining schedule runs one backward per micro-batch, and each accumulates into the
stage's ``.grad``; after the last one it reduces them (FSDP's reduce-scatter, in ``perform_reduce_grad``) and
divides them by the number of micro-batches (``scale_grads``, in place). Per-param gradient-ready hooks would
launch the waves on every micro-batch's partial sums, each superseded by the next, and the division would then make
every launched wave stale. The stage's own methods mark the moment the gradients are final instead:
``perform_reduce_grad`` (single-stage schedules: GPipe, 1F1B) and ``scale_grads`` (multi-stage schedules call it
directly). :func:`watch_stage` wraps both on the stage instance (the schedule looks them up on the instance) and
calls back once after the first of them returns following a backward. The launch then overlaps with the rest of
the schedule step: the other stages' cooldown backwards (the pipeline bubble) and the optimizer steps of the model
chunks before it.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

__all__ = ["watch_stage"]

_BACKWARDS = ("backward_one_chunk", "backward_weight_one_chunk")
_FINAL = ("perform_reduce_grad", "scale_grads")


class _StageWatch:
    """The wrappers of one stage; :meth:`remove` puts its methods back."""

    def __init__(self, stage: Any, on_final: Callable[[], None]) -> None:
        self.stage, self.on_final, self.pending = stage, on_final, False
        self.names = [n for n in _BACKWARDS + _FINAL if hasattr(stage, n)]
        for name in self.names:
            setattr(stage, name, self._wrap(name, getattr(stage, name)))

    def _wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name in _BACKWARDS:
                self.pending = True
                return fn(*args, **kwargs)
            out = fn(*args, **kwargs)
            if self.pending:  # the first final call after a backward (perform_reduce_grad may call scale_grads)
                self.pending = False
                self.on_final()
            return out

        return wrapper

    def remove(self) -> None:
        for name in self.names:
            self.stage.__dict__.pop(name, None)


def watch_stage(stage: Any, on_final: Callable[[], None]) -> _StageWatch:
    """Call ``on_final()`` each schedule step once ``stage``'s gradients are final ([Note: pipeline readiness]).

    Args:
        stage: a ``torch.distributed.pipelining`` stage (``PipelineStage``).
        on_final: called on the schedule's thread, after the stage's reduction and scaling.

    Returns:
        A handle whose ``remove()`` restores the stage's methods.
    """
    return _StageWatch(stage, on_final)
