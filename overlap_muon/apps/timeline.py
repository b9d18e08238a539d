"""Draw a ``torch.profiler`` Chrome trace of training steps as lanes, and measure the exposed optimizer time.

Usage::

    python -m overlap_muon.apps.timeline traces/trace.json [--out traces/timeline.png]

One row per lane, top to bottom:

- ``main``: the main thread's ``## forward ##`` / ``## backward ##`` / ``## optimizer ##`` ranges (and
  ``Optimizer.step#...``, the name torch gives ``optimizer.step()``), the ``OverlapMuon::wait*`` ranges the
  runtime emits around its blocking waits, over a grey band per ``ProfilerStep#N``;
- one row per thread (CPU) or device stream (CUDA) on which ``OverlapMuon::wave{k}::{phase}`` ranges run,
  labelled by the phases it holds: ``comm`` (``pack``, ``a2a_to_home``, ``a2a_from_home``, ``apply``; split
  into ``comm: to_home`` / ``comm: from_home`` when a lane holds only one direction) and ``compute``
  (``ns``). Phase ranges that run on the main thread itself (inline lanes) get a ``main (inline)`` row.

Each phase has one colour; each wave range is annotated with its wave number where it is wide enough.

[Note: what "exposed optimizer time" measures] Per step (a ``ProfilerStep#N`` range; the whole main-thread
span when the trace has none), the union of the main thread's ``OverlapMuon::wait*`` ranges and its optimizer
step ranges (``## optimizer ##``, ``Optimizer.step#...``), clipped to the step: the wall time in which the
main thread does optimizer work or waits for it instead of running the model. The union counts a wait nested
in the step range once. In overlap mode ``step()`` returns before the Muon updates land, so most of the
exposed time shows up as waits in the next forward's pre-hooks, i.e. inside the *next* ``ProfilerStep``.

[Note: capturing worker threads] ``torch.profiler`` records ``record_function`` ranges only on threads where
profiling is enabled, which by default is the thread that started it. The CPU runtime runs its lanes on worker
threads, so a trace must be captured with
``experimental_config=torch._C._profiler._ExperimentalConfig(profile_all_threads=True)`` (torch >= 2.7;
checked on torch 2.13 CPU) for the ``comm`` / ``compute`` rows to appear. Without it only ``main`` is drawn
and a warning is printed. On CUDA the lanes come from the ``gpu_user_annotation`` ranges torch projects onto
each stream, so the kernels' real timing is drawn, not their launch; the exposed time is still read from the
main *thread*, so a wait that is only a stream dependency (``wait_event``) and never blocks the host is not
in it (the CUDA path is checked on hand-built traces only, not on a GPU capture).

Only the standard library and matplotlib (Agg backend) are used; the trace may be ``.json`` or ``.json.gz``.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import re
import sys
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from .._lanes import PHASES

__all__ = ["draw_timeline", "TimelineSummary", "main"]

#: The phases of one wave, in pipeline order (the names ``overlap_muon._lanes`` emits).
_PHASES = PHASES
_PHASE_RE = re.compile(r"^OverlapMuon::wave(\d+)::(pack|a2a_to_home|ns|a2a_from_home|apply)$")
_COMM_TO = {"pack", "a2a_to_home"}
_COMM_FROM = {"a2a_from_home", "apply"}
_COMPUTE = {"ns"}

_STEP_RE = re.compile(r"^ProfilerStep#\d+$")
_FORWARD = "## forward ##"
_BACKWARD = "## backward ##"
_OPTIMIZER = "## optimizer ##"
_WAIT_PREFIX = "OverlapMuon::wait"
_TORCH_OPT_PREFIX = "Optimizer.step#"

_PHASE_COLORS = {
    "pack": "#8dd3c7",
    "a2a_to_home": "#1f77b4",
    "ns": "#2ca02c",
    "a2a_from_home": "#9467bd",
    "apply": "#ff7f0e",
}
_MAIN_COLORS = {
    "forward": "#aec7e8",
    "backward": "#ffbb78",
    "optimizer": "#d62728",
    "wait": "#444444",
}
_STEP_COLOR = "#eeeeee"
#: A wave-number label is drawn on a bar at least this fraction of the plotted span wide.
_LABEL_MIN_FRACTION = 0.004
#: At most this many wave-number labels (readability, and matplotlib's text is slow).
_MAX_LABELS = 600


@dataclass(frozen=True, slots=True)
class TimelineSummary:
    """What :func:`draw_timeline` found in a trace and measured."""

    trace_path: str
    """The trace that was read."""
    out_png: str
    """The PNG that was written."""
    lanes: tuple[str, ...]
    """Row labels, top to bottom; ``"main"`` first, then the wave lanes (e.g. ``"comm: to_home"``, ``"compute"``)."""
    num_steps: int
    """Number of steps measured (``ProfilerStep#N`` ranges on the main thread, or 1 for the whole span)."""
    num_waves: int
    """Distinct wave indices among the ``OverlapMuon::wave{k}::*`` ranges (waves per step)."""
    phase_counts: dict[str, int] = field(default_factory=dict)
    """Number of ranges per phase name over the whole trace."""
    step_ms: tuple[float, ...] = ()
    """Duration of each step, milliseconds."""
    exposed_ms: tuple[float, ...] = ()
    """Exposed optimizer time of each step, milliseconds; see [Note: what "exposed optimizer time" measures]."""
    exposed_fraction: tuple[float, ...] = ()
    """``exposed_ms / step_ms`` per step, in [0, 1]."""
    main_ms: dict[str, float] = field(default_factory=dict)
    """Total main-thread time per category (``forward``, ``backward``, ``optimizer``, ``wait``), milliseconds,
    each category's ranges merged so nested ranges count once."""
    warnings: tuple[str, ...] = ()
    """Things the reader should know (no worker-thread ranges, no step ranges, ...)."""

    @property
    def mean_exposed_ms(self) -> float:
        """Mean exposed optimizer time per step, milliseconds (0.0 with no step)."""
        return sum(self.exposed_ms) / len(self.exposed_ms) if self.exposed_ms else 0.0

    @property
    def mean_exposed_fraction(self) -> float:
        """Total exposed time over total step time (0.0 with no step)."""
        total = sum(self.step_ms)
        return sum(self.exposed_ms) / total if total > 0 else 0.0


@dataclass(frozen=True, slots=True)
class _Range:
    name: str
    cat: str
    pid: Any
    tid: Any
    start: float  # microseconds (Chrome trace unit)
    end: float


def _load_events(trace_path: str) -> list[_Range]:
    """Complete (``ph == "X"``) events of a Chrome trace, ``.json`` or gzip-compressed."""
    with open(trace_path, "rb") as f:
        raw = f.read()
    if raw[:2] == b"\x1f\x8b":  # gzip magic, whatever the file is called
        raw = gzip.decompress(raw)
    try:
        doc = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"trace {trace_path!r} is not a JSON Chrome trace: {e}") from e
    events = doc.get("traceEvents") if isinstance(doc, dict) else doc
    if not isinstance(events, list):
        raise ValueError(f"trace {trace_path!r} has no 'traceEvents' list")
    out = []
    for e in events:
        if not isinstance(e, dict) or e.get("ph") != "X" or "ts" not in e:
            continue
        try:
            ts = float(e["ts"])
            dur = float(e.get("dur", 0.0))
        except (TypeError, ValueError):
            continue
        out.append(_Range(str(e.get("name", "")), str(e.get("cat", "")), e.get("pid"), e.get("tid"), ts, ts + dur))
    return out


def _is_gpu(r: _Range) -> bool:
    return r.cat.startswith("gpu_")


def _main_category(name: str) -> str | None:
    if name == _FORWARD:
        return "forward"
    if name == _BACKWARD:
        return "backward"
    if name == _OPTIMIZER or name.startswith(_TORCH_OPT_PREFIX):
        return "optimizer"
    if name.startswith(_WAIT_PREFIX):
        return "wait"
    return None


def _union_length(intervals: list[tuple[float, float]], lo: float, hi: float) -> float:
    """Length of the union of ``intervals`` clipped to ``[lo, hi]``."""
    clipped = sorted((max(a, lo), min(b, hi)) for a, b in intervals if min(b, hi) > max(a, lo))
    total = 0.0
    cur_a = cur_b = None
    for a, b in clipped:
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def _lane_label(phases: set[str]) -> str:
    if phases <= _COMPUTE:
        return "compute"
    if phases <= _COMM_TO:
        return "comm: to_home"
    if phases <= _COMM_FROM:
        return "comm: from_home"
    if phases <= _COMM_TO | _COMM_FROM:
        return "comm"
    return "comm+compute"


def draw_timeline(trace_path: str, out_png: str) -> TimelineSummary:
    """Read a ``torch.profiler`` Chrome trace, draw its lanes to ``out_png`` and measure exposed optimizer time.

    Args:
        trace_path: a Chrome trace written by ``torch.profiler.profile.export_chrome_trace`` (``.json``, or
            gzip-compressed ``.json.gz``); timestamps in microseconds.
        out_png: the PNG to write; parent directories are created.

    Returns:
        A :class:`TimelineSummary` (lanes found, waves counted, per-step exposed optimizer time in ms and as a
        fraction of the step).

    Raises:
        FileNotFoundError: ``trace_path`` does not exist.
        ValueError: the file is not a JSON Chrome trace, or it holds no complete (``"X"``) event.
    """
    events = _load_events(trace_path)
    if not events:
        raise ValueError(f"trace {trace_path!r} holds no complete ('X') events")
    warnings: list[str] = []

    # --- the main thread: the CPU thread holding the most step / forward / backward / optimizer ranges.
    marker_count: dict[tuple[Any, Any], int] = defaultdict(int)
    for r in events:
        marker = _STEP_RE.match(r.name) or _main_category(r.name) in ("forward", "backward", "optimizer")
        if marker and not _is_gpu(r):
            marker_count[(r.pid, r.tid)] += 1
    phase_events = [(r, _PHASE_RE.match(r.name)) for r in events]
    phase_events = [(r, m) for r, m in phase_events if m]
    if marker_count:
        main_key = max(marker_count, key=lambda k: (marker_count[k], str(k)))
    else:
        warnings.append("no ProfilerStep / '## forward ##' / '## backward ##' / optimizer ranges: main thread guessed")
        counts: dict[tuple[Any, Any], int] = defaultdict(int)
        for r in events:
            if not _is_gpu(r) and not _PHASE_RE.match(r.name):
                counts[(r.pid, r.tid)] += 1
        main_key = max(counts, key=lambda k: (counts[k], str(k))) if counts else (None, None)
    main_events = [r for r in events if (r.pid, r.tid) == main_key and not _is_gpu(r)]

    # --- wave lanes: CUDA streams if the trace has GPU-projected wave ranges, else CPU threads.
    gpu_phase = [(r, m) for r, m in phase_events if _is_gpu(r)]
    on_gpu = bool(gpu_phase)
    lane_phase = gpu_phase if on_gpu else [(r, m) for r, m in phase_events if not _is_gpu(r)]
    by_lane: dict[tuple[Any, Any], list[tuple[_Range, int, str]]] = defaultdict(list)
    for r, m in lane_phase:
        by_lane[(r.pid, r.tid)].append((r, int(m.group(1)), m.group(2)))

    def _lane_order(key: tuple[Any, Any]) -> tuple[int, float]:
        phases = {p for _, _, p in by_lane[key]}
        first = min(_PHASES.index(p) for p in phases)
        return (first, min(r.start for r, _, _ in by_lane[key]))

    lane_keys = sorted(by_lane, key=_lane_order)
    labels: list[str] = []
    seen_labels: dict[str, int] = defaultdict(int)
    for key in lane_keys:
        base = "main (inline)" if (not on_gpu and key == main_key) else _lane_label({p for _, _, p in by_lane[key]})
        suffix = f" (stream {key[1]})" if on_gpu else ""
        seen_labels[base] += 1
        n = seen_labels[base]
        labels.append(base + (f" #{n}" if n > 1 else "") + suffix)
    if not phase_events:
        warnings.append("no OverlapMuon::wave{k}::{phase} ranges in the trace")
    elif not on_gpu and all(k == main_key for k in lane_keys):
        warnings.append(
            "wave ranges only on the main thread: lanes ran inline, or worker threads were not profiled "
            "(capture with _ExperimentalConfig(profile_all_threads=True))"
        )

    # --- steps and the exposed optimizer time of each.
    step_ranges = sorted(((r.start, r.end) for r in main_events if _STEP_RE.match(r.name)))
    if not step_ranges:
        spans = [r for r in main_events if _main_category(r.name) is not None] or main_events or events
        step_ranges = [(min(r.start for r in spans), max(r.end for r in spans))]
        warnings.append("no ProfilerStep#N ranges: the whole main-thread span is measured as one step")
    exposed_iv = [(r.start, r.end) for r in main_events if _main_category(r.name) in ("optimizer", "wait")]
    step_ms, exposed_ms, frac = [], [], []
    for a, b in step_ranges:
        dur = b - a
        ex = _union_length(exposed_iv, a, b)
        step_ms.append(dur / 1e3)
        exposed_ms.append(ex / 1e3)
        frac.append(ex / dur if dur > 0 else 0.0)

    main_ms: dict[str, float] = {}
    for cat in _MAIN_COLORS:
        iv = [(r.start, r.end) for r in main_events if _main_category(r.name) == cat]
        main_ms[cat] = _union_length(iv, float("-inf"), float("inf")) / 1e3

    phase_counts = {p: 0 for p in _PHASES}
    waves = set()
    for _, m in lane_phase:
        phase_counts[m.group(2)] += 1
        waves.add(int(m.group(1)))

    lanes = ("main",) + tuple(labels)
    _draw(out_png, trace_path, main_events, step_ranges, by_lane, lane_keys, lanes)
    for w in warnings:
        print(f"timeline: warning: {w}", file=sys.stderr)
    return TimelineSummary(
        trace_path=str(trace_path),
        out_png=str(out_png),
        lanes=lanes,
        num_steps=len(step_ranges),
        num_waves=len(waves),
        phase_counts=phase_counts,
        step_ms=tuple(step_ms),
        exposed_ms=tuple(exposed_ms),
        exposed_fraction=tuple(frac),
        main_ms=main_ms,
        warnings=tuple(warnings),
    )


def _draw(
    out_png: str,
    trace_path: str,
    main_events: list[_Range],
    step_ranges: list[tuple[float, float]],
    by_lane: dict[tuple[Any, Any], list[tuple[_Range, int, str]]],
    lane_keys: list[tuple[Any, Any]],
    lanes: tuple[str, ...],
) -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display; only PNG output
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    main_cat = [(r, _main_category(r.name)) for r in main_events]
    main_cat = [(r, c) for r, c in main_cat if c is not None]
    all_starts = [a for a, _ in step_ranges] + [r.start for r, _ in main_cat]
    all_ends = [b for _, b in step_ranges] + [r.end for r, _ in main_cat]
    for key in lane_keys:
        all_starts += [r.start for r, _, _ in by_lane[key]]
        all_ends += [r.end for r, _, _ in by_lane[key]]
    t0 = min(all_starts)
    span_ms = max((max(all_ends) - t0) / 1e3, 1e-6)

    n_rows = len(lanes)
    fig, ax = plt.subplots(figsize=(16, 1.6 + 0.9 * n_rows))
    y_of = {i: n_rows - 1 - i for i in range(n_rows)}  # row 0 ("main") on top

    def bars(row: int, items: list[tuple[float, float]], color: str, height: float = 0.8, **kw: Any) -> None:
        if items:
            y = y_of[row]
            ax.broken_barh(
                [((a - t0) / 1e3, (b - a) / 1e3) for a, b in items], (y - height / 2, height), facecolors=color, **kw
            )

    bars(0, step_ranges, _STEP_COLOR, height=0.95)
    for cat in ("forward", "backward", "optimizer", "wait"):
        items = [(r.start, r.end) for r, c in main_cat if c == cat]
        bars(0, items, _MAIN_COLORS[cat], height=0.8 if cat != "wait" else 0.5)

    labels_left = _MAX_LABELS
    for row, key in enumerate(lane_keys, start=1):
        items = by_lane[key]
        for phase in _PHASES:
            spans = [(r.start, r.end) for r, _, p in items if p == phase]
            bars(row, spans, _PHASE_COLORS[phase], edgecolor="white", linewidth=0.3)
        for r, k, _ in items:
            width_ms = (r.end - r.start) / 1e3
            if labels_left > 0 and width_ms >= _LABEL_MIN_FRACTION * span_ms:
                ax.text((r.start - t0) / 1e3 + width_ms / 2, y_of[row], str(k), ha="center", va="center", fontsize=7)
                labels_left -= 1

    ax.set_yticks([y_of[i] for i in range(n_rows)])
    ax.set_yticklabels(lanes)
    ax.set_ylim(-0.6, n_rows - 0.4)
    ax.set_xlim(0, span_ms * 1.01)
    ax.set_xlabel("time since first range (ms)")
    ax.set_title(f"overlap-muon timeline: {os.path.basename(trace_path)}")
    handles = [Patch(facecolor=_STEP_COLOR, label="ProfilerStep")]
    handles += [Patch(facecolor=c, label=n) for n, c in _MAIN_COLORS.items()]
    handles += [Patch(facecolor=c, label=n) for n, c in _PHASE_COLORS.items()]
    ax.legend(
        handles=handles,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.18 if n_rows > 2 else -0.3),
        ncol=len(handles),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    parent = os.path.dirname(os.path.abspath(out_png))
    os.makedirs(parent, exist_ok=True)
    fig.savefig(out_png, dpi=120)
    plt.close(fig)


def _format(summary: TimelineSummary) -> str:
    lines = [f"trace:  {summary.trace_path}", f"png:    {summary.out_png}", f"lanes:  {', '.join(summary.lanes)}"]
    counts = ", ".join(f"{p}={n}" for p, n in summary.phase_counts.items())
    lines.append(f"waves:  {summary.num_waves} per step ({counts})")
    lines.append("main:   " + ", ".join(f"{k} {v:.3f} ms" for k, v in summary.main_ms.items()))
    lines.append(f"{'step':>6} {'step ms':>12} {'exposed ms':>12} {'exposed %':>10}")
    for i, (s, e, f) in enumerate(zip(summary.step_ms, summary.exposed_ms, summary.exposed_fraction)):
        lines.append(f"{i:>6} {s:>12.3f} {e:>12.3f} {100 * f:>9.2f}%")
    lines.append(
        f"{'all':>6} {sum(summary.step_ms):>12.3f} {sum(summary.exposed_ms):>12.3f} "
        f"{100 * summary.mean_exposed_fraction:>9.2f}%   (mean exposed {summary.mean_exposed_ms:.3f} ms/step)"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """CLI: ``python -m overlap_muon.apps.timeline TRACE.json [--out PNG]``; prints the summary table."""
    ap = argparse.ArgumentParser(prog="python -m overlap_muon.apps.timeline", description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="torch.profiler Chrome trace (.json or .json.gz)")
    ap.add_argument("--out", default=os.path.join("traces", "timeline.png"), help="PNG to write (default: %(default)s)")
    args = ap.parse_args(argv)
    summary = draw_timeline(args.trace, args.out)
    print(_format(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
