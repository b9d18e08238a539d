"""The runtime's options: one frozen config, read from the environment once (the README's toggle table).

Precedence: a constructor argument (not ``None``) overrides the environment variable, which overrides the
default. Each field names its variable and, for a string, its choices in its ``metadata``; the environment is
parsed from the field's type (bool, int, float, str with choices), and every value, whatever its source, goes
through the same check (:func:`_check`), so there is one rule per field. Booleans accept
``1/0/true/false/yes/no/on/off`` (any case) and nothing else; a bad value is a ``ValueError`` naming the
variable. Values are never read by truthiness (``OVERLAP_MUON_OVERLAP=0`` is off).
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ._messages import warn_user

__all__ = ["OverlapMuonConfig", "ENV_VARS", "resolve_config"]

logger = logging.getLogger("overlap_muon")

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _opt(default: Any, env: str, *, choices: tuple[str, ...] | None = None, kind: type = str) -> Any:
    """A config field: its default, its environment variable, its value kind and (strings) its choices."""
    return field(default=default, metadata={"env": env, "choices": choices, "kind": kind})


@dataclass(frozen=True, kw_only=True, slots=True)
class OverlapMuonConfig:
    """Effective runtime configuration of one :class:`~overlap_muon.OverlapMuon`.

    Raises:
        ValueError / TypeError: a field out of range or of the wrong type (names the field).
    """

    mode: str = _opt("layer_sharded", "OVERLAP_MUON_MODE", choices=("layer_sharded", "duplicated", "gram", "auto"))
    """``layer_sharded`` (NS once on a home rank), ``duplicated`` (per-param all-gather, NS on every rank),
    ``gram`` (no gather: NS in Gram space over the shards, where a matrix is split along its long side only; the
    others layer-sharded. NOT bitwise: [Note: sharded Gram NS] in ``_gram_mode.py`` states its error) or ``auto``
    (per weight, the cheapest of the three by ``cost_model``'s figures; Gram only with ``allow_inexact``, so bitwise
    without it: [Note: NS strategy per weight] in ``scheduler/strategy.py``)."""
    allow_inexact: bool = _opt(False, "OVERLAP_MUON_ALLOW_INEXACT", kind=bool)
    """``mode="auto"`` may pick Gram NS (not bitwise) where its cost model says it is the cheapest."""
    gram_restart_every: int = _opt(5, "OVERLAP_MUON_GRAM_RESTART_EVERY", kind=int)
    """``mode="gram"``: re-form the Gram from the shards every this many NS steps (``>= ns_steps``: once, the
    source's gram_once; 1: every step; 4: Refresh-4). ``ceil(ns_steps / k)`` all-reduces per matrix."""
    overlap: bool = _opt(True, "OVERLAP_MUON_OVERLAP", kind=bool)
    """Launch waves from backward hooks, during backward (``False``: everything inside ``step()``)."""
    async_step: bool = _opt(False, "OVERLAP_MUON_ASYNC_STEP", kind=bool)
    """Overlap mode: ``step()`` returns before its Muon updates land, and each module's next forward waits for its
    own (the update hides behind the next forward too). Off by default: ``step()`` then orders its updates before
    anything after it (CPU: the host waits; CUDA: the current stream waits). The loops this mode does not support
    are listed in the README ("Asynchronous step")."""
    fused_a2a: bool = _opt(True, "OVERLAP_MUON_FUSED_A2A", kind=bool)
    """One ``all_to_all`` over the flat ``R x T`` domain per direction (``False``: two stages, remat then TP)."""
    batch_ns: bool = _opt(False, "OVERLAP_MUON_BATCH_NS", kind=bool)
    """Run NS on same-shape matrices of a home as one batched call. Off by default: a batched bf16 matmul is not
    bitwise the per-matrix one on every platform (on an Intel AMX CPU, torch 2.13, some (shape, batch size) pairs
    differ in the last bit for about 1 in 6 random inputs), and torch.optim.Muon runs one matrix at a time."""
    balance: str = _opt("lpt", "OVERLAP_MUON_BALANCE", choices=("lpt", "round_robin"))
    """Home assignment: ``lpt`` (by NS FLOPs) or ``round_robin``."""
    wave_plan: str = _opt("count", "OVERLAP_MUON_WAVE_PLAN", choices=("count", "cost"))
    """Overlap mode without ``wave_slots``: ``count`` (one matrix per home per wave, tapered) or ``cost``
    (``scheduler.plan_waves_by_cost``: same-shape matrices grouped where batching outweighs the later launch)."""
    wave_slots: int | None = _opt(None, "OVERLAP_MUON_WAVE_SLOTS", kind=int)
    """Max Muon matrices per wave; ``None`` means the domain size (overlap) or all matrices (synchronous)."""
    side_streams: bool = _opt(True, "OVERLAP_MUON_SIDE_STREAMS", kind=bool)
    """Run lanes on side CUDA streams / CPU worker threads (``False``: inline on the launching thread)."""
    nvtx: bool = _opt(False, "OVERLAP_MUON_NVTX", kind=bool)
    """Emit NVTX ranges beside ``torch.profiler.record_function`` (default: on when CUDA is available)."""
    pg_timeout_s: float = _opt(600.0, "OVERLAP_MUON_PG_TIMEOUT_S", kind=float)
    """Timeout of every process group the runtime creates, seconds."""
    warm_up: bool = _opt(True, "OVERLAP_MUON_WARM_UP", kind=bool)
    """At construction, run one small collective of each kind the runtime will run on each of its groups
    ([Note: warm-up] in ``_comm.py``): NCCL connects a group at its first collective, which would otherwise be the
    first exchange, launched from a backward hook at peak activation memory. An error names the group."""
    node_size: int | None = _opt(None, "OVERLAP_MUON_NODE_SIZE", kind=int)
    """Global ranks per node (``None``: ``LOCAL_WORLD_SIZE``, which torchrun sets; without it, one node)."""
    node_exchange: str = _opt("auto", "OVERLAP_MUON_NODE_EXCHANGE", choices=("auto", "on", "off"))
    """Fused exchanges of a dense domain that spans nodes evenly run in two hops, within the node then across
    ([Note: node-aware exchange] in ``_domain.py``): at most ``(ranks per node - 1) + (nodes - 1)`` peers per rank
    instead of every rank of the domain; the same bits. ``auto`` and ``on``: wherever the domain spans nodes
    (``on`` warns where it does not); ``off``: one flat ``all_to_all``. Its homes then spread over nodes
    ([Note: homes that know nodes] in ``scheduler/homes.py``)."""
    readiness_order: str = _opt("reverse", "OVERLAP_MUON_READINESS_ORDER", choices=("reverse", "observed"))
    """Wave order: ``reverse`` registration order, or ``observed`` (rank 0's first-step order, broadcast)."""
    learn_accumulation: bool = _opt(True, "OVERLAP_MUON_LEARN_ACCUMULATION", kind=bool)
    """Overlap mode: count the backward passes between steps and launch the waves only from the one expected to be
    the last before ``step()`` ([Note: learned accumulation] in ``scheduler/dispatch.py``): NS once per matrix
    per step under gradient accumulation without ``no_sync()``. ``False``: every backward launches them."""
    learn_clipping: bool = _opt(True, "OVERLAP_MUON_LEARN_CLIPPING", kind=bool)
    """Overlap mode: after a step whose gradients were edited between backward and ``step()`` (a clip that bit,
    GradScaler's unscale), the next step launches its waves in ``step()``, after the edit, instead of launching
    them in backward and re-running them all; speculation resumes after a step without an edit ([Note: learned
    clipping] in ``scheduler/dispatch.py``). ``False``: every step speculates."""
    auto_overlap: bool = _opt(True, "OVERLAP_MUON_AUTO_OVERLAP", kind=bool)
    """Time a few iterations with the overlap on and off early in training, agree across ranks, and keep the faster
    ([Note: overlap where it pays] in ``_overlap_choice.py``); the same bits either way. On by default where nothing
    else decides the mode: a ``overlap``, ``async_step`` or ``wave_slots`` the user sets wins (silently; with
    ``auto_overlap`` set too, one warning says which wins)."""
    skip_nonfinite: bool = _opt(False, "OVERLAP_MUON_SKIP_NONFINITE", kind=bool)
    """Skip the whole step on every rank when any Muon gradient on any rank is non-finite."""
    syrk: bool = _opt(False, "OVERLAP_MUON_SYRK", kind=bool)
    """NS computes ``X Xᵀ`` and ``A @ A`` as symmetric block products (fewer FLOPs; not bitwise on this CPU, see
    ``overlap_muon._ns`` [Note: symmetric Gram]), off by default."""
    gram_ns: bool = _opt(False, "OVERLAP_MUON_GRAM_NS", kind=bool)
    """Matrices whose long side is at least 4 times the short one run Gram Newton-Schulz (``overlap_muon._ns``
    [Note: Gram Newton-Schulz]: fewer FLOPs, not bitwise, a little less accurate); the others plain NS. Team NS
    keeps the plain iteration. Off by default."""
    surplus: str = _opt("idle", "OVERLAP_MUON_SURPLUS", choices=("idle", "duplicate", "team", "auto"))
    """What the homes a wave leaves without a matrix do (``scheduler.surplus``): ``idle``; ``duplicate``: a wave
    whose surplus plan gives every matrix every rank of the domain is gathered to all of them, each runs the NS
    and keeps its own block, and nothing is scattered back (bitwise the single-home result); ``team``: such a
    dense-domain wave is re-laid into column blocks of each matrix's long dim and the domain splits each NS by
    columns (``overlap_muon._team_ns``: ``1/S`` of the two large products each, one Gram all-reduce per NS step;
    NOT bitwise, see there); ``auto``: per wave, the one of the two the cost model prefers (so not bitwise where it
    picks a team); a wave holding a transposed (``Conv1D``) or split matrix is duplicated instead of teamed; not
    combined with ``dp_slots`` (a warning says so, the waves run as ``idle``). With
    fused exchanges ``duplicate`` (and ``auto``) also run plans that give a matrix ``k`` of the
    ranks (its homes each get it and run its NS; only the other ranks get a scatter). Teams of part of the domain
    are simulated only ([Note: runtime wiring] in ``scheduler/surplus.py``)."""
    cost_model: str = _opt("auto", "OVERLAP_MUON_COST_MODEL",
                           choices=("auto", "cuda", "cpu_gloo", "h100", "h200", "gb200", "gb300"))
    """The machine figures the surplus plan (``surplus="auto"``, and how many homes ``duplicate`` gives a matrix)
    and ``mode="auto"`` weigh: a profile of ``scheduler.surplus_cost.PROFILES`` (``cpu_gloo``: gloo over CPU
    ranks; ``h100``, ``h200``, ``gb200``, ``gb300``: GPU nodes), ``cuda`` (``h200``), or ``auto``: ``h200`` where
    the lanes run on CUDA streams and ``cpu_gloo`` elsewhere. The plan decides which waves exchange how, never the
    result of a bitwise kind."""
    dp_slots: bool = _opt(False, "OVERLAP_MUON_DP_SLOTS", kind=bool)
    """With replicate dims on the mesh (HSDP), the replicas of the dense domain share its NS work instead of each
    running all of it; results are swapped over the DP groups ([Note: DP replicas as NS slots] in
    ``overlap_muon/_comm.py``). Bitwise the same. Layer-sharded mode only."""
    content_check: bool = _opt(True, "OVERLAP_MUON_CONTENT_CHECK", kind=bool)
    """``step()`` compares the bytes of every gradient and momentum buffer a wave read during backward with their
    bytes now, and re-runs the wave on any difference, whoever wrote them ([Note: content fingerprints] in
    ``_wave_state.py``). ``False``: the records alone decide (identities, version counters, wrapped collectives),
    which miss the writers listed in docs/usage.md ("Writes the records miss")."""
    check_grad_presence: bool = _opt(True, "OVERLAP_MUON_CHECK_GRAD_PRESENCE", kind=bool)
    """Each wave agrees, over the runtime's gloo group, on which params have a gradient (host flags only)."""
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)
    """Where each value came from: ``default``, ``env`` or ``argument``."""

    def __post_init__(self) -> None:
        for f in _fields():
            err = _check(f, getattr(self, f.name))
            if err is not None:
                raise (TypeError if err[0] == "type" else ValueError)(f"{f.name} {err[1]}")

    def describe(self) -> str:
        """One line: every option, its value and its source."""
        parts = [f"{f.name}={getattr(self, f.name)!r}({self.sources.get(f.name, 'default')})" for f in _fields()]
        return "OverlapMuon config: " + " ".join(parts)


def _fields() -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(OverlapMuonConfig) if "env" in f.metadata]


#: field name -> environment variable
ENV_VARS: dict[str, str] = {f.name: f.metadata["env"] for f in _fields()}


def _check(f: dataclasses.Field, v: Any) -> tuple[str, str] | None:
    """``None`` if ``v`` is a valid value of field ``f``, else ``(kind, message)`` with kind "type"/"value"."""
    kind, choices = f.metadata["kind"], f.metadata["choices"]
    if kind is bool:
        return None if isinstance(v, bool) else ("type", f"must be a bool, got {v!r}")
    if kind is int:
        if v is None and f.default is None:
            return None
        ok = isinstance(v, int) and not isinstance(v, bool) and v >= 1
        return None if ok else ("value", f"must be a positive int{' or None' if f.default is None else ''}, got {v!r}")
    if kind is float:
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and math.isfinite(v)
        return None if ok else ("value", f"must be a positive, finite number of seconds, got {v!r}")
    return None if v in choices else ("value", f"must be one of {choices}, got {v!r}")


def _parse_env(f: dataclasses.Field, raw: str) -> Any:
    """Convert the text of ``f``'s variable by the field's kind, then check it; errors name the variable."""
    var, kind = f.metadata["env"], f.metadata["kind"]
    text = raw.strip()
    if kind is bool:
        if text.lower() not in _TRUE | _FALSE:
            raise ValueError(f"{var}={raw!r} is not a boolean; use one of 1/0/true/false/yes/no/on/off")
        return text.lower() in _TRUE
    try:
        value = kind(text.lower() if kind is str else text)
    except ValueError:
        value = raw
    err = _check(f, value)
    if err is not None:
        raise ValueError(f"{var}={raw!r}: {f.name} {err[1]}")
    return value


def _warn_unknown_vars(env: Mapping[str, str]) -> None:
    """An ``OVERLAP_MUON_*`` variable that names no option is a typo more often than not: warn, with the closest
    name (it is ignored)."""
    known = sorted(f.metadata["env"] for f in _fields())
    for var in sorted(k for k in env if k.startswith("OVERLAP_MUON_") and k not in known):
        close = difflib.get_close_matches(var, known, n=1, cutoff=0.6)
        hint = f"did you mean {close[0]}?" if close else f"the variables are {', '.join(known)}"
        warn_user(f"OverlapMuon: {var} is not an overlap-muon variable and is ignored; {hint}")


def resolve_config(environ: Mapping[str, str] | None = None, **overrides: Any) -> OverlapMuonConfig:
    """Build the effective config: ``overrides`` (non-``None``) > environment > defaults.

    Raises:
        ValueError: an environment variable holds a value its option does not accept (the message names it),
            or an override is out of range.
        TypeError: an override has the wrong type, or names no option.
    """
    env = os.environ if environ is None else environ
    _warn_unknown_vars(env)
    unknown = set(overrides) - set(ENV_VARS)
    if unknown:
        adamw = sorted(unknown & {"betas", "amsgrad", "maximize", "capturable", "differentiable", "fused", "foreach"})
        hint = (f"; {adamw} are AdamW settings: pass them as adamw_kwargs={{...}} (they apply to the non-Muon params)"
                if adamw else "")
        raise TypeError(f"unknown OverlapMuon options {sorted(unknown)}; known: {sorted(ENV_VARS)}{hint}")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for f in _fields():
        var = f.metadata["env"]
        if overrides.get(f.name) is not None:
            v = overrides[f.name]  # a string option's choice in any case, as in the environment
            values[f.name] = v.lower() if f.metadata["kind"] is str and isinstance(v, str) else v
            sources[f.name] = "argument"
        elif env.get(var, "").strip() != "":
            values[f.name] = _parse_env(f, env[var])
            sources[f.name] = "env"
        else:
            sources[f.name] = "default"
    if "nvtx" not in values:
        values["nvtx"] = torch.cuda.is_available()
    return OverlapMuonConfig(**values, sources=sources)
