"""Warnings a user can act on, attributed to the user's own line.

A warning raised inside ``step()`` would otherwise point at torch's optimizer wrapper
(``torch/optim/optimizer.py``) or at ``torch/utils/_contextlib.py``; :func:`warn_user` walks up to the first frame
outside torch and this project's library. The project's own jobs (``overlap_muon/apps``) use the library as a user
does, so their lines count as the user's. No imports of the project: every module may use it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user", "RERUN_CAUSES", "rerun_warnings"]


def _internal_dirs() -> tuple[str, ...]:
    """The folders whose frames a warning skips: torch's and this project's packages (``hooks`` and ``scheduler``
    live beside ``overlap_muon`` in a source checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))
    mods = [sys.modules.get(n) for n in ("overlap_muon._hooks", "overlap_muon._scheduler")]
    dirs = [os.path.dirname(os.path.abspath(torch.__file__)), here]
    dirs += [os.path.dirname(os.path.abspath(m.__file__)) for m in mods
             if m is not None and getattr(m, "__file__", None)]
    return tuple(d + os.sep for d in dirs)


_APPS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "apps") + os.sep


def _internal(filename: str, skip: tuple[str, ...]) -> bool:
    """A frame of torch, of the library (not of its jobs under ``apps/``), or of the import machinery (``<frozen
    runpy>`` under ``python -m`` and ``torchrun -m``)."""
    path = os.path.abspath(filename)
    return filename.startswith("<frozen ") or (path.startswith(skip) and not path.startswith(_APPS))


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside torch and overlap-muon: the user's line that built
    the optimizer or called ``step()``, not a line of torch's optimizer wrapper or of this package. When every frame
    is internal, the outermost one gets it."""
    skip = _internal_dirs()
    frame, level = sys._getframe(1), 2
    while frame.f_back is not None and _internal(frame.f_code.co_filename, skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)


_ON_EDIT = ("make the edit inside backward (a post-accumulate-grad hook) or inside step() (clipping: "
            "OverlapMuon(max_grad_norm=...); DDP's averaging: OverlapMuon(ddp_model) or attach_ddp)")

#: Why a wave re-ran (the key ``stats["reruns.<key>"]`` counts): what happened, and the one fix that applies.
RERUN_CAUSES: dict[str, tuple[str, str]] = {
    "grad_edited": ("a gradient was edited in place after backward (an op the optimizer cannot name: e.g. "
                    "grad.mul_, GradScaler.unscale_ on plain tensors, DDP's averaging without attach_ddp)", _ON_EDIT),
    "grad_edited:clip_grad_norm_": ("clip_grad_norm_ scaled the gradients after backward (the clip bit)",
                                    "clip inside step() with OverlapMuon(max_grad_norm=...) instead"),
    "grad_edited:_amp_foreach_non_finite_check_and_unscale_": (
        "GradScaler.unscale_ rescaled the gradients after backward",
        "bf16 autocast needs no GradScaler; with one, the re-run is the price of unscaling after backward"),
    "grad_edited:collective": ("a collective ({op}) wrote a gradient after backward",
                               "issue it inside backward (a post-accumulate-grad hook) or, for DDP's averaging, build "
                               "OverlapMuon on the DDP model (or call attach_ddp)"),
    "grad_edited:collective:reduce_scatter": (
        "a collective ({op}) wrote a gradient after backward (under FSDP2 gradient accumulation: its in-place add of "
        "a micro-batch's reduced gradients)",
        "issue it inside backward; under FSDP2 gradient accumulation, call model.set_requires_gradient_sync(False) "
        "before every micro-batch but the last (FSDP2 then reduces once, in the last backward)"),
    "grad_replaced": ("a gradient was replaced by another tensor after backward (param.grad = ...)", _ON_EDIT),
    "grads_changed": ("a gradient appeared or was set to None after backward (zero_grad(), or a later backward that "
                      "reached other params)", "zero the gradients before backward, not between backward and step()"),
    "hyper": ("a momentum or NS setting (momentum, nesterov, ns_coefficients, ns_steps, eps) changed after backward",
              "change it before backward (lr and weight_decay are read in step() and re-run nothing)"),
    "state": ("the optimizer state was replaced or edited after backward", "load or edit it before backward"),
    "content": ("a gradient or momentum buffer changed after backward by a write no record sees (a .data edit, "
                "a numpy or DLPack view, set_(), a collective called from C++ such as DDP's reducer or a "
                "ProcessGroup method; caught by its bytes)", "make the write inside backward or before it, or, "
                "for DDP, build OverlapMuon on the DDP model (or call attach_ddp)"),
    "discarded": ("the waves backward launched were dropped before step() (load_state_dict(), a re-bound param)",
                  "do that before backward"),
    "extra_backward": ("a backward ran after the one the optimizer expected to be the step's last (the accumulation "
                       "count changed)", "keep one accumulation count, or wrap the earlier micro-batches in "
                       "opt.no_sync()"),
    "other_rank": ("another rank's inputs changed (its warning says how)", "see that rank's warning"),
    "failed": ("a lane task of the wave failed", "see the error it raised"),
}


def rerun_warnings(stats: dict[str, int], seen: dict[str, int], warned: set[str], waves: int) -> None:
    """Warn once per re-run cause whose count in ``stats`` (``reruns.<cause>``) grew since ``seen`` (both updated):
    what happened, how many waves of ``waves`` it cost, and the fix. An extra backward in the first step is the
    accumulation being learned, not a cause."""
    for key, count in list(stats.items()):
        cause = key[len("reruns."):] if key.startswith("reruns.") else None
        if cause is None or count <= seen.get(cause, 0):
            continue
        new, seen[cause] = count - seen.get(cause, 0), count
        if cause in warned or (cause == "extra_backward" and not stats["steps"]):
            continue
        warned.add(cause)
        op = cause.split(":", 1)[1] if ":" in cause else ""
        if op.startswith("collective:"):
            op = op.split(":", 1)[1]
            cause = "grad_edited:collective" + (":reduce_scatter" if op.startswith("reduce_scatter") else "")
        what, fix = RERUN_CAUSES.get(cause, RERUN_CAUSES["grad_edited"])
        # A later backward re-launches the waves during backward, possibly several times a step: say so, in
        # launches, never as more re-runs than the plan has waves.
        done = (f"{new} wave launches (the plan has {waves} waves a step) were superseded before step()"
                if cause == "extra_backward" else f"{min(new, waves)} of {waves} waves re-ran in step()")
        warn_user(f"OverlapMuon: {done} because {what.format(op=op)}; exact, but those waves lost their overlap: "
                  f"{fix}.")
