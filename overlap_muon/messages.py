"""Warnings a user can act on, attributed to the user's own line.

A warning raised inside ``step()`` would otherwise point at torch's optimizer wrapper
(``torch/optim/optimizer.py``) or at ``torch/utils/_contextlib.py``; :func:`warn_user` walks up to the first frame
outside torch and this project. No imports of the project: every module may use it.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch

__all__ = ["warn_user"]


def _internal_dirs() -> tuple[str, ...]:
    """The folders whose frames a warning skips: torch's and this project's packages (``hooks`` and ``scheduler``
    live beside ``overlap_muon`` in a source checkout)."""
    here = os.path.dirname(os.path.abspath(__file__))
    mods = [sys.modules.get(n) for n in ("overlap_muon.hooks", "overlap_muon.scheduler")]
    dirs = [os.path.dirname(os.path.abspath(torch.__file__)), here]
    dirs += [os.path.dirname(os.path.abspath(m.__file__)) for m in mods
             if m is not None and getattr(m, "__file__", None)]
    return tuple(d + os.sep for d in dirs)


def warn_user(message: str, category: type[Warning] = UserWarning) -> None:
    """``warnings.warn`` attributed to the first frame outside torch and overlap-muon: the user's line that built
    the optimizer or called ``step()``, not a line of torch's optimizer wrapper or of this package."""
    skip = _internal_dirs()
    frame, level = sys._getframe(1), 2
    while frame is not None and os.path.abspath(frame.f_code.co_filename).startswith(skip):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
