"""The runtime's ablation toggles: one frozen config, read from the environment once (DESIGN.md section 5).

Precedence: a constructor argument (not ``None``) overrides the environment variable, which overrides the
default. Booleans accept ``1/0/true/false/yes/no/on/off`` (any case) and nothing else; a bad value is a
``ValueError`` naming the variable. Values are never read by truthiness (``OVERLAP_MUON_OVERLAP=0`` is off).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["OverlapMuonConfig", "ENV_VARS", "resolve_config"]

logger = logging.getLogger("overlap_muon")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
MODES = ("layer_sharded", "duplicated")
BALANCES = ("lpt", "round_robin")
SURPLUS = ("idle", "duplicate", "team", "auto")
_BOOLS = ("overlap", "fused_a2a", "batch_ns", "side_streams", "nvtx", "syrk")

#: field name -> environment variable
ENV_VARS: dict[str, str] = {
    "mode": "OVERLAP_MUON_MODE",
    "overlap": "OVERLAP_MUON_OVERLAP",
    "fused_a2a": "OVERLAP_MUON_FUSED_A2A",
    "batch_ns": "OVERLAP_MUON_BATCH_NS",
    "balance": "OVERLAP_MUON_BALANCE",
    "wave_slots": "OVERLAP_MUON_WAVE_SLOTS",
    "side_streams": "OVERLAP_MUON_SIDE_STREAMS",
    "nvtx": "OVERLAP_MUON_NVTX",
    "pg_timeout_s": "OVERLAP_MUON_PG_TIMEOUT_S",
    "syrk": "OVERLAP_MUON_SYRK",
    "surplus": "OVERLAP_MUON_SURPLUS",
}


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapMuonConfig:
    """Effective runtime configuration of one :class:`~overlap_muon.OverlapMuon`."""

    mode: str = "layer_sharded"
    """``layer_sharded`` (NS once on a home rank) or ``duplicated`` (per-param all-gather, NS on every rank)."""
    overlap: bool = True
    """Launch waves from backward hooks and wait in the next forward (``False``: everything inside ``step()``)."""
    fused_a2a: bool = True
    """One ``all_to_all`` over the flat ``R x T`` domain per direction (``False``: two stages, remat then TP)."""
    batch_ns: bool = True
    """Run NS on same-shape matrices of a home as one batched call."""
    balance: str = "lpt"
    """Home assignment: ``lpt`` (by NS FLOPs) or ``round_robin``."""
    wave_slots: int | None = None
    """Max Muon matrices per wave; ``None`` means the domain size (one matrix per home per wave)."""
    side_streams: bool = True
    """Run lanes on side CUDA streams / CPU worker threads (``False``: inline on the launching thread)."""
    nvtx: bool = False
    """Emit NVTX ranges beside ``torch.profiler.record_function`` (default: on when CUDA is available)."""
    pg_timeout_s: float = 600.0
    """Timeout of every process group the runtime creates, seconds."""
    syrk: bool = False
    """NS computes ``X Xᵀ`` and ``A @ A`` as symmetric block products (fewer FLOPs; not bitwise on every platform,
    see ``overlap_muon.ns`` [Note: symmetric Gram])."""
    surplus: str = "idle"
    """What homes without a matrix in a wave do: ``idle``, ``duplicate`` (extra homes of a matrix), ``team`` (split
    one matrix's NS) or ``auto`` (by ``scheduler.surplus``'s cost model)."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each value came from: ``default``, ``env`` or ``argument``."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.balance not in BALANCES:
            raise ValueError(f"balance must be one of {BALANCES}, got {self.balance!r}")
        if self.surplus not in SURPLUS:
            raise ValueError(f"surplus must be one of {SURPLUS}, got {self.surplus!r}")
        if self.wave_slots is not None and (
            isinstance(self.wave_slots, bool) or not isinstance(self.wave_slots, int) or self.wave_slots < 1
        ):
            raise ValueError(f"wave_slots must be a positive int or None, got {self.wave_slots!r}")
        for name in _BOOLS:
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"{name} must be a bool, got {getattr(self, name)!r}")
        if not (isinstance(self.pg_timeout_s, (int, float)) and self.pg_timeout_s > 0 and math.isfinite(self.pg_timeout_s)):
            raise ValueError(f"pg_timeout_s must be a positive, finite number of seconds, got {self.pg_timeout_s!r}")

    def describe(self) -> str:
        """One line: every toggle, its value and its source."""
        parts = []
        for f in dataclasses.fields(self):
            if f.name == "sources":
                continue
            parts.append(f"{f.name}={getattr(self, f.name)!r}({self.sources.get(f.name, 'default')})")
        return "OverlapMuon config: " + " ".join(parts)


def _parse_bool(var: str, raw: str) -> bool:
    v = raw.strip().lower()
    if v in _TRUE:
        return True
    if v in _FALSE:
        return False
    raise ValueError(f"{var}={raw!r} is not a boolean; use one of 1/0/true/false/yes/no/on/off")


def _parse_env(name: str, var: str, raw: str) -> Any:
    if name in _BOOLS:
        return _parse_bool(var, raw)
    if name == "mode":
        v = raw.strip().lower()
        if v not in MODES:
            raise ValueError(f"{var}={raw!r}: expected one of {', '.join(MODES)}")
        return v
    if name == "balance":
        v = raw.strip().lower()
        if v not in BALANCES:
            raise ValueError(f"{var}={raw!r}: expected one of {', '.join(BALANCES)}")
        return v
    if name == "surplus":
        v = raw.strip().lower()
        if v not in SURPLUS:
            raise ValueError(f"{var}={raw!r}: expected one of {', '.join(SURPLUS)}")
        return v
    if name == "wave_slots":
        try:
            n = int(raw.strip())
        except ValueError:
            raise ValueError(f"{var}={raw!r}: expected a positive integer") from None
        if n < 1:
            raise ValueError(f"{var}={raw!r}: expected a positive integer")
        return n
    if name == "pg_timeout_s":
        try:
            x = float(raw.strip())
        except ValueError:
            raise ValueError(f"{var}={raw!r}: expected a positive number of seconds") from None
        if not (x > 0 and math.isfinite(x)):
            raise ValueError(f"{var}={raw!r}: expected a positive, finite number of seconds")
        return x
    raise AssertionError(name)


def resolve_config(environ: Mapping[str, str] | None = None, **overrides: Any) -> OverlapMuonConfig:
    """Build the effective config: ``overrides`` (non-``None``) > environment > defaults.

    Raises:
        ValueError: an environment variable holds a value its toggle does not accept (the message names it),
            or an override is out of range.
        TypeError: an override has the wrong type, or names no toggle.
    """
    env = os.environ if environ is None else environ
    unknown = set(overrides) - set(ENV_VARS)
    if unknown:
        raise TypeError(f"unknown OverlapMuon toggles {sorted(unknown)}; known: {sorted(ENV_VARS)}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, var in ENV_VARS.items():
        if overrides.get(name) is not None:
            values[name] = overrides[name]
            sources[name] = "argument"
        elif var in env and env[var].strip() != "":
            values[name] = _parse_env(name, var, env[var])
            sources[name] = "env"
        else:
            sources[name] = "default"
    if "nvtx" not in values:
        values["nvtx"] = torch.cuda.is_available()
    return OverlapMuonConfig(**values, sources=sources)
