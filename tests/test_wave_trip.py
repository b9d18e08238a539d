"""One wave's trip, file by file, measured: which library files an overlapped step enters, from backward's
gradient-ready hooks to the applied updates.

A profile hook on every thread (``sys.setprofile``, ``threading.setprofile``, set before the lane threads start)
records the file of every Python function called during the third step's ``backward()`` and ``step()`` of two ranks
(TP 2, plain shards, the default options: fused exchanges, CPU lanes, plain NS). :data:`TRIP` is the files the wave's
own records (``Wave``, ``WaveState``, ``Leg``) travel through, in the order of docs/design.md's walk ("One wave's
trip"); :data:`LEAVES` the functions on tensors, shapes and groups it calls; :data:`STEP` the files ``step()`` enters
for other work. A change that sends a wave through another file fails here until the walk or the leaves say so.
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

import pytest

from tests.dist_utils import run_ranks

ROOT = Path(__file__).resolve().parent.parent

#: The files the wave's own records travel through, in the order of its trip (docs/design.md, "One wave's trip").
TRIP = [
    "hooks/grad_ready.py", "overlap_muon/runtime.py", "scheduler/dispatch.py",
    "overlap_muon/pipeline.py", "overlap_muon/wave_state.py", "overlap_muon/lanes.py", "overlap_muon/agreement.py",
    "overlap_muon/exchanges.py", "overlap_muon/optimizer.py",
]
#: The leaves the trip calls: functions on tensors, shapes and groups that hold no wave.
LEAVES = [
    "overlap_muon/placement.py", "overlap_muon/version_fix.py", "overlap_muon/muon_math.py",
    "overlap_muon/layer_sharded_a2a/domain_exchange.py", "overlap_muon/layer_sharded_a2a/_route.py",
    "overlap_muon/ns.py",
]
#: What else ``step()`` enters: following replaced params, and AdamW's lazy state.
STEP = ["overlap_muon/binding.py", "overlap_muon/state.py"]


def _entered(rank, world):
    from tests.models import PlainShardNet, plain_opt

    roots = [str(ROOT / d) + "/" for d in ("overlap_muon", "hooks", "scheduler")]
    apps = str(ROOT / "overlap_muon" / "apps") + "/"
    seen: set[str] = set()
    on = [False]

    def profile(frame, event, arg):
        if on[0] and event == "call":
            f = frame.f_code.co_filename
            if any(f.startswith(r) for r in roots) and not f.startswith(apps):
                seen.add(str(Path(f).relative_to(ROOT)))

    threading.setprofile(profile)  # before the optimizer starts its lane threads
    sys.setprofile(profile)
    try:
        net = PlainShardNet(1, 2, 0, rank)
        opt = plain_opt(net, 1, 2, 0, rank, overlap=True)
        for s in range(3):
            cs, _ = net.local_grads(s)
            loss = net(cs)
            on[0] = s == 2  # steady state: the route plans are cached
            loss.backward()
            opt.step()
            on[0] = False
            opt.zero_grad()
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    opt.close()
    return sorted(seen)


@pytest.mark.timeout(120)
def test_a_step_enters_the_files_of_the_walk():
    entered = set().union(*map(set, run_ranks(_entered, 2, timeout=100)))
    known = set(TRIP) | set(LEAVES) | set(STEP)
    assert entered == known, (sorted(entered - known), sorted(known - entered))
    assert len(TRIP) <= 10 and len(TRIP) + len(LEAVES) <= 15


def test_the_design_walks_the_trip_in_order():
    text = (ROOT / "docs" / "design.md").read_text()
    walk = text[text.index("### One wave's trip"):]
    walk = walk[:walk.index("\n## ")] if "\n## " in walk else walk
    steps = [m.group(1) for m in re.finditer(r"^\d+\. `([\w/.]+\.py)`", walk, re.M)]
    assert steps == TRIP
