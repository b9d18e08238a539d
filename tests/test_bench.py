"""The benchmark suite runs from a clean checkout and reports what it promises; no speed is asserted.

One quick run of a subset of cases (``step``, ``ns``, ``comm``, ``balance``, ``surplus``, ``memory``) is shared by the tests
below; the ``comm`` figures are exact byte counts, so they are compared exactly.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from overlap_muon.apps import bench
from overlap_muon.apps.bench import cli, common, peers

_SUBSET = ("step", "ns", "comm", "balance", "surplus", "memory")


@pytest.fixture(scope="module")
def quick_report(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("bench") / "quick.json"
    # Hang guards, not speed: about 5 s on an idle AMX Xeon, minutes on a CPU without native bf16 or under load.
    rc = bench.main(["--quick", "--small", "--repeats", "2", "--cases", ",".join(_SUBSET), "--json", str(path),
                     "--timeout", "300"])
    assert rc == 0
    with open(path) as f:
        return json.load(f)


@pytest.mark.timeout(900)  # includes the module fixture's quick bench
def test_quick_json_has_every_ratio_and_the_machine(quick_report):
    m = quick_report["machine"]
    for key in ("cpu_model", "logical_cpus", "usable_cpus", "torch"):
        assert m[key], key
    assert quick_report["quick"] is True
    for case in _SUBSET:
        ratios = quick_report["cases"][case]["ratios"]
        for key in bench.expected_ratio_keys(case):
            assert ratios.get(key) is not None, f"{case}.{key}"
            assert quick_report["ratios"][f"{case}.{key}"] == ratios[key]
        assert quick_report["cases"][case]["elapsed_s"] >= 0


@pytest.mark.timeout(900)  # the module fixture may run first
def test_comm_fused_bytes_equal_the_ideal_formula_exactly(quick_report):
    """Fused layer-sharded routing is pure data movement: each non-home shard goes to its home once and each block
    comes back once, so the bytes leaving a rank average exactly ``2 * (1 - 1/S) * shard_bytes``."""
    det = quick_report["cases"]["comm"]["details"]
    S = det["R"] * det["T"]
    shard = det["shard_bytes_per_rank"]
    fused = det["fused"]
    # Integer form of mean(sent) == 2 * (S - 1) / S * mean(shard_bytes).
    assert sum(fused["sent_bytes_per_rank_per_step"]) * S == 2 * (S - 1) * sum(shard)
    assert fused["mean_sent_bytes"] == det["ideal_bytes_per_rank_per_step"]
    assert quick_report["cases"]["comm"]["ratios"]["fused_bytes_over_ideal"] == 1.0
    assert fused["collectives_per_step"] == 2  # one all_to_all_single each way (one wave, overlap off)
    # The default (presence check on): a synchronous step agrees on gradient presence once, in step()'s agreement
    # (counted apart), before it launches its waves, so they add no check of their own.
    checked = det["fused_default"]
    assert checked["collectives_per_step"] == 2
    assert checked["sent_bytes_per_rank_per_step"] == fused["sent_bytes_per_rank_per_step"]
    # Two-stage relays rows through the home's remat row: (2 - 1/R - 1/T) / (1 - 1/(R*T)) of the ideal (4/3 on
    # 2x2); duplicated sends S - 1 copies of every shard and nothing back: S / 2 of the ideal.
    R, T = det["R"], det["T"]
    two = sum(det["two_stage"]["sent_bytes_per_rank_per_step"])
    assert two * (R * T - 1) == sum(fused["sent_bytes_per_rank_per_step"]) * (2 * R * T - R - T)
    dup = sum(det["duplicated"]["sent_bytes_per_rank_per_step"])
    assert dup * 2 == sum(fused["sent_bytes_per_rank_per_step"]) * S
    assert det["duplicated"]["collectives_per_step"] == det["matrices"]


@pytest.mark.timeout(900)  # the module fixture may run first
def test_balance_lpt_never_worse_than_round_robin(quick_report):
    ratios = quick_report["cases"]["balance"]["ratios"]
    keys = [k for k in ratios if k.endswith("_lpt_max_over_mean")]
    assert len(keys) == 9  # 3 model families x 3 domain sizes
    for k in keys:
        lpt, rr = ratios[k], ratios[k.replace("_lpt_", "_rr_")]
        assert 1.0 <= lpt <= rr, k


@pytest.mark.timeout(900)  # the module fixture may run first
def test_step_runs_ns_once_per_matrix_when_layer_sharded(quick_report):
    det = quick_report["cases"]["step"]["details"]
    n = det["matrices"]
    for world in (2, 4):
        per_rank = det[f"world{world}"]["ns_matrices_per_rank_per_step"]
        assert sum(per_rank["layer_sharded"]) == n and per_rank["duplicated"] == [n] * world
        errors = det[f"world{world}"]["errors_vs_float64"]  # Gram NS (fp32 Gram) is closer to float64 than bf16 NS
        assert errors["gram_once"] < errors["layer_sharded"] == errors["duplicated"], errors


def test_bad_arguments_name_the_problem(capsys):
    with pytest.raises(SystemExit):
        bench.main(["--cases", "step,nope"])
    assert "nope" in capsys.readouterr().err
    with pytest.raises(ValueError, match="nope"):
        bench.expected_ratio_keys("nope")


def test_py_spy_missing_says_so(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)
    opts = common._Options(quick=True, repeats=None, baseline=True, trace_dir=str(tmp_path), timeout_s=10.0)
    out = cli._py_spy(opts)
    assert out["ok"] is False
    assert "py-spy is not installed" in capsys.readouterr().out


@pytest.mark.timeout(120)
def test_module_entry_point_runs(tmp_path):
    """``python -m overlap_muon.apps.bench`` (what the console script wraps) runs a planning-only case and writes JSON."""
    path = tmp_path / "b.json"
    proc = subprocess.run(
        [sys.executable, "-m", "overlap_muon.apps.bench", "--quick", "--cases", "balance", "--json", str(path)],
        capture_output=True, text=True, timeout=110,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(path.read_text())
    assert set(bench.expected_ratio_keys("balance")) <= set(report["cases"]["balance"]["ratios"])
    assert report["machine"]["cpu_model"] in proc.stdout  # the table header names the machine


@pytest.mark.timeout(900)  # the module fixture may run first
def test_ns_and_surplus_report_exactness_with_their_speed(quick_report):
    """The symmetric-Gram and team NS paths are not claimed bitwise: each shape reports whether it was, with the
    size of the difference (a bitwise shape has difference 0)."""
    syrk = quick_report["cases"]["ns"]["details"]["syrk"]["shapes"]
    assert len(syrk) == 3
    for row in syrk:
        assert isinstance(row["bitwise"], bool)
        assert (row["max_abs_diff"] == 0.0) == row["bitwise"]
        assert row["syrk_flops_executed"] <= row["flops"]
    det = quick_report["cases"]["surplus"]["details"]
    assert det["world"] == 2 and (det["max_abs_diff"] == 0.0) == det["bitwise"]
    assert set(det["sim"]) == {f"{p}_dp{d}" for p in ("idle", "duplicate", "team", "auto") for d in (1, 4)}


@pytest.mark.timeout(900)  # the module fixture may run first
def test_memory_case_counts_the_optimizer_only(quick_report):
    """The memory figures are byte counts of storages the step creates: the synchronous step holds at least one
    wave's bf16 NS input and output, and never a multiple of the whole model beyond it."""
    det = quick_report["cases"]["memory"]["details"]
    for world in (1, 2):
        r = det[f"world{world}"]
        for v in ("overlap", "sync", "duplicated"):
            assert r[v] > 0 and r["min"][v] > 0, (world, v, r)


@pytest.mark.slow  # a measurement against DistMuon (about 20 s); the skip path below stays in the default tier
@pytest.mark.timeout(240)
def test_peers_case_runs_quick_or_skips_cleanly(tmp_path):
    """``--cases peers --quick`` either measures OverlapMuon against torchtitan's DistMuon, with every result
    ``torch.equal`` (the case fails otherwise), or, without torchtitan, is skipped with the install line and
    exits 0."""
    path = tmp_path / "peers.json"
    rc = bench.main(["--quick", "--repeats", "2", "--cases", "peers", "--json", str(path), "--timeout", "200"])
    assert rc == 0
    case = json.loads(path.read_text())["cases"]["peers"]
    assert set(case["ratios"]) == set(bench.expected_ratio_keys("peers"))
    flex, why = peers.import_dist_muon()
    if flex is None:
        assert peers.INSTALL_HINT in case["details"]["skipped"]
        assert all(v is None for v in case["ratios"].values())
        return
    det = case["details"]
    for layout in ("tp", "fsdp"):
        assert all(not v for v in det[f"step_{layout}"]["unequal_to_torch_muon"].values()), layout
    for world in (1, 2):
        assert det[f"iteration_world{world}"]["unequal"] == []
    assert all(v is not None and v > 0 for v in case["ratios"].values())


def test_peers_case_skips_with_the_install_line_when_torchtitan_is_missing(monkeypatch, tmp_path):
    monkeypatch.setattr(peers, "import_dist_muon", lambda: (None, "no torchtitan here"))
    opts = common._Options(quick=True, repeats=1, baseline=True, trace_dir=str(tmp_path), timeout_s=10.0)
    res = peers.run(opts)
    assert res.ratios == {k: None for k in bench.expected_ratio_keys("peers")}
    assert "skipped" in res.lines[0] and "no torchtitan here" in res.lines[0]


def test_dist_muon_cpu_patches_are_scoped():
    """The CPU patches exist only inside the context, and not at all for a CUDA device."""
    flex, _ = peers.import_dist_muon()
    if flex is None:
        pytest.skip("torchtitan is not installed")
    from torchtitan.distributed.flex_shard.dist_muon import DistMuon

    orig_stream, orig_check = torch.cpu.Stream, DistMuon.__dict__["_validate_parameter_storage"]
    with peers.dist_muon_cpu_patches(torch.device("cuda")):
        assert torch.cpu.Stream is orig_stream
    with peers.dist_muon_cpu_patches(torch.device("cpu")):
        torch.cpu.Stream(device=torch.device("cpu"), priority=0)  # what _optimizer_reshard_runtime.py:267 calls
        assert DistMuon.__dict__["_validate_parameter_storage"] is not orig_check
    assert torch.cpu.Stream is orig_stream
    assert DistMuon.__dict__["_validate_parameter_storage"] is orig_check


def test_case_modules_import_common_and_the_library_only():
    """One module per case, each with ``RATIO_KEYS`` and ``run``; a case module imports ``common`` and the library,
    never another case module, ``cli`` or the package itself (no import cycle), checked on the source."""
    import ast
    from pathlib import Path

    folder = Path(bench.__file__).parent
    assert set(bench.CASE_MODULES) == set(bench.CASES)
    for name, module in bench.CASE_MODULES.items():
        assert module.__name__ == f"{bench.__name__}.{name}"
        assert callable(module.run) and module.RATIO_KEYS == bench.expected_ratio_keys(name)
        tree = ast.parse((folder / f"{name}.py").read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level:
                assert node.level == 1 and node.module == "common", (name, node.lineno, ast.unparse(node))
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                mods = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module]
                for m in mods:
                    assert not (m == bench.__name__ or m.startswith(bench.__name__ + ".")) or m == common.__name__, (
                        name, node.lineno, m)
    common_tree = ast.parse((folder / "common.py").read_text())
    for node in ast.walk(common_tree):
        if isinstance(node, ast.ImportFrom):
            assert not node.level and not (node.module or "").startswith(bench.__name__), ast.unparse(node)


def test_small_option_halves_the_ns_heavy_sides():
    """``--small`` (on by itself with ``--quick`` where bf16 matmul is slower than fp32) halves matrix sides."""
    small = common._Options(quick=True, repeats=1, baseline=True, trace_dir=".", timeout_s=10.0, small=True)
    full = common._Options(quick=True, repeats=1, baseline=True, trace_dir=".", timeout_s=10.0)
    assert (small.side(512), full.side(512), small.side(1)) == (256, 512, 1)


@pytest.mark.slow  # a measurement (about 25 s on 2 cores): the features it times are tested in test_overlap.py
@pytest.mark.timeout(600)
def test_choice_case_reports_both_choices(tmp_path):
    """``--cases choice``: auto_overlap against the better of on/off, learned accumulation against every backward."""
    path = tmp_path / "choice.json"
    assert bench.main(["--quick", "--repeats", "2", "--cases", "choice", "--json", str(path), "--timeout", "300"]) == 0
    case = json.loads(path.read_text())["cases"]["choice"]
    assert all(v is not None and v > 0 for v in case["ratios"].values()), case["ratios"]
    for world in (1, 2):
        ns = case["details"][f"world{world}"]["ns_matrices_per_step_rank0"]
        assert ns["acc4_each"] == 4 * ns["acc4_learned"] > 0, ns


def test_time_model_recovers_known_parts_and_predicts():
    """``time_model.fit`` recovers each part's interpreter starts, bf16 and fp32 work from runs at three sets of
    rates; ``predict`` sums them at other rates, and scales a part it does not know by the interpreter start."""
    from overlap_muon.apps.time_model import fit, predict

    truth = {"a": [2.0, 0.0, 0.0], "b": [0.5, 30.0, 0.0], "c": [1.0, 2.0, 200.0]}
    rates = [{"bf16": 300.0, "fp32": 90.0, "spawn": 1.5}, {"bf16": 3.0, "fp32": 80.0, "spawn": 1.6},
             {"bf16": 2.5, "fp32": 25.0, "spawn": 1.5}]

    def run(r):
        return {k: s * r["spawn"] + b / r["bf16"] + f / r["fp32"] for k, (s, b, f) in truth.items()}

    model = fit([{"rates": r, "durations": run(r)} for r in rates])
    for k, want in truth.items():
        assert model[k] == pytest.approx(want, rel=1e-3, abs=1e-3), k
    there = {"bf16": 1.5, "fp32": 21.0, "spawn": 2.7}
    total, unknown = predict(model, dict(run(rates[0]), d=3.0), rates[0], there)
    assert unknown == 1 and total == pytest.approx(sum(run(there).values()) + 3.0 * 2.7 / 1.5, rel=1e-3)


def test_quick_time_model_is_within_budget_on_the_slowest_cpu():
    """The ``--quick`` model's total on the slowest CPU we know is within the quick run's budget; a run without
    ``--small`` is not compared with it (the model is of ``--small`` runs)."""
    from overlap_muon.apps.bench.budget import QUICK_BUDGET_S, QUICK_MODEL, quick_summary

    elapsed = {k: 1.0 for k in QUICK_MODEL}
    rates = {"bf16": 400.0, "fp32": 90.0, "spawn": 1.3}
    line, fig = quick_summary(elapsed, rates, small=True)
    assert fig["model_slowest_s"] <= QUICK_BUDGET_S and f"budget {QUICK_BUDGET_S:.0f} s" in line
    assert set(QUICK_MODEL) == set(cli.CASES) - set(cli.NOT_QUICK)
    _, fig = quick_summary(elapsed, rates, small=False)
    assert fig["model_here_s"] is None
