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
