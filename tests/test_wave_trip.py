"""One wave's trip, file by file, measured: which library files an overlapped step enters, from backward's
gradient-ready hooks to the applied updates.

A profile hook on every thread (``sys.setprofile``, ``threading.setprofile``, set before the lane threads start)
records the file of every Python function called during the third step's ``backward()`` and ``step()`` of two ranks
(TP 2, plain shards, the default options: fused exchanges, CPU lanes, plain NS). :data:`TRIP` is the files the wave's
own records (``Wave``, ``WaveState``, ``Leg``) travel through, in the order of docs/design.md's walk ("One wave's
trip"); :data:`LEAVES` the functions on tensors, shapes and groups it calls; :data:`STEP` the files ``step()`` enters
for other work. A change that sends a wave through another file fails here until the walk or the leaves say so.
Leaves by rule: a leaf imports no trip file and takes no wave record (:func:`leaf_violations`).
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
    "hooks/grad_ready.py", "overlap_muon/_runtime.py", "scheduler/dispatch.py",
    "overlap_muon/_pipeline.py", "overlap_muon/_wave_state.py", "overlap_muon/_lanes.py", "overlap_muon/_agreement.py",
    "overlap_muon/_exchanges.py", "overlap_muon/optimizer.py",
]
#: The leaves the trip calls: functions on tensors, shapes and groups that hold no wave.
LEAVES = [
    "overlap_muon/_placement.py", "overlap_muon/_version_fix.py", "overlap_muon/_muon_math.py",
    "overlap_muon/layer_sharded_a2a/_domain_exchange.py", "overlap_muon/layer_sharded_a2a/_route.py",
    "overlap_muon/_ns.py",
]
#: What else ``step()`` enters: following replaced params, and AdamW's lazy state.
STEP = ["overlap_muon/_binding.py", "overlap_muon/_state.py"]


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


#: The wave's own records: a leaf takes none of them.
RECORDS = ("Wave", "WaveState", "WavePlan", "Leg", "Reads", "WaveExchanges")


def _module_file(root: Path, module: str) -> str | None:
    """The repository file of an absolute module name (``overlap_muon._hooks`` / ``.scheduler`` are ``hooks/`` and
    ``scheduler/``), or ``None`` outside the project."""
    for package, folder in (("overlap_muon._hooks", "hooks"), ("overlap_muon._scheduler", "scheduler"),
                            ("overlap_muon", "overlap_muon")):
        if module == package or module.startswith(package + "."):
            rel = folder + module[len(package):].replace(".", "/")
            for cand in (rel + ".py", rel + "/__init__.py"):
                if (root / cand).exists():
                    return cand
    return None


def leaf_violations(root: Path, leaves: list[str], trip: list[str]) -> list[str]:
    """Leaves by rule: a leaf imports no trip file (directly) and no parameter of its functions is annotated with a
    wave record (:data:`RECORDS`). One line per violation."""
    import ast

    bad = []
    for leaf in leaves:
        tree = ast.parse((root / leaf).read_text())
        package = leaf[:-3].replace("/", ".").replace("hooks.", "overlap_muon._hooks.", 1) \
            .replace("scheduler.", "overlap_muon._scheduler.", 1).rsplit(".", 1)[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
                module = ".".join(base + ([node.module] if node.module else []))
                names = [module] + [f"{module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                names = []
            for name in names:
                if (f := _module_file(root, name)) in trip:
                    bad.append(f"{leaf}:{node.lineno}: a leaf imports the trip file {f}")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for a in node.args.args + node.args.kwonlyargs + node.args.posonlyargs:
                    ann = ast.unparse(a.annotation) if a.annotation is not None else ""
                    if any(re.search(rf"\b{r}\b", ann) for r in RECORDS):
                        bad.append(f"{leaf}:{node.lineno}: {node.name} takes a wave record ({a.arg}: {ann})")
    return bad


def test_leaves_by_rule():
    """The leaves import no trip file and take no wave record, and the rule catches a planted violation of each."""
    assert not leaf_violations(ROOT, LEAVES, TRIP), leaf_violations(ROOT, LEAVES, TRIP)


def test_planted_leaf_violations_are_caught(tmp_path):
    import shutil

    for folder in ("overlap_muon", "hooks", "scheduler"):
        shutil.copytree(ROOT / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__", "apps"))
    with open(tmp_path / "overlap_muon/_ns.py", "a") as f:
        f.write("\nfrom ._lanes import Lanes\n")
    with open(tmp_path / "overlap_muon/_muon_math.py", "a") as f:
        f.write("\n\ndef _planted(st: 'WaveState') -> None:\n    pass\n")
    with open(tmp_path / "overlap_muon/_placement.py", "a") as f:
        f.write("\nfrom overlap_muon._scheduler.dispatch import WaveDispatcher\n")
    found = "\n".join(leaf_violations(tmp_path, LEAVES, TRIP))
    for what in ("_ns.py", "trip file overlap_muon/_lanes.py", "_planted takes a wave record",
                 "_placement.py", "trip file scheduler/dispatch.py"):
        assert what in found, (what, found)
