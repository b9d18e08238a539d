"""One helper for profiler labels: a ``torch.profiler.record_function`` range plus, when enabled, an NVTX range.

Names follow ``Component::phase`` (``OverlapMuon::wave3::a2a_to_home``), so a ``torch.profiler`` trace and an
Nsight Systems timeline (``nsys profile --trace=cuda,nvtx,osrt``) show the same ranges.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

__all__ = ["prof_range", "wave_range_name", "PHASES"]

#: The phases of one wave, in pipeline order.
PHASES = ("pack", "a2a_to_home", "ns", "a2a_from_home", "apply")

try:  # the nvtx package is a declared dependency, but keep the CPU path alive without it
    import nvtx as _nvtx
except Exception:  # pragma: no cover
    _nvtx = None


def wave_range_name(wave: int, phase: str) -> str:
    """``OverlapMuon::wave{wave}::{phase}``."""
    return f"OverlapMuon::wave{wave}::{phase}"


@contextlib.contextmanager
def prof_range(name: str, *, nvtx: bool = False) -> Iterator[None]:
    """Emit ``name`` as a ``record_function`` range, and as an NVTX range when ``nvtx`` is True."""
    nv = None
    if nvtx:
        if _nvtx is not None:
            nv = _nvtx.annotate(name, domain="OverlapMuon")
        elif torch.cuda.is_available():
            nv = torch.cuda.nvtx.range(name)
    with torch.profiler.record_function(name):
        if nv is None:
            yield
        else:
            with nv:
                yield
