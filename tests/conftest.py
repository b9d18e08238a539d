import os
import sys

import pytest
import torch

# The repository root on sys.path (and PYTHONPATH), so the test modules import in spawned ranks too.
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
os.environ.setdefault("PYTHONPATH", ROOT)

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

# Tests marked ``bf16_heavy`` spend most of their time in bf16 NS on large matrices. On a CPU without native bf16
# matmul (bf16 slower than fp32: no avx512_bf16 / AMX) that is 10 to 100 times slower, so there they join the long
# tier (``-m slow``; ``-m ""`` runs every tier) and the default command keeps its time. The summary says so, and
# gives the suite's time model (tests/time_model.py) for this machine and for the slowest CPU we know.
_RATES = pytest.StashKey[dict]()
_HEAVY = pytest.StashKey[set]()
_BF16_MOVED = pytest.StashKey[int]()
_durations: dict[str, float] = {}


def pytest_addoption(parser):
    parser.addoption("--time-log", default=None, metavar="PATH",
                     help="write this run's test durations and matmul rates as JSON (tests/time_model.py fits them)")


# The frameworks the ranks of these test files import: the fork server imports them once, so a rank starts with
# them instead of paying seconds each (overlap_muon/apps/spawn.py, [Note: why forkserver]).
_RANK_IMPORTS = {
    "test_hf_trainer.py": ("transformers", "transformers.trainer", "transformers.models.llama.modeling_llama"),
    "test_experts.py": ("transformers", "transformers.models.qwen3_moe.modeling_qwen3_moe", "torchtitan.models"),
    "test_lightning.py": ("lightning.pytorch",),
    "test_peft.py": ("peft", "transformers.models.llama.modeling_llama"),
    "test_torchtitan.py": ("torchtitan.models.llama3", "torchtitan.components.optimizer",
                           "torchtitan.components.checkpointer.dcp"),
}


@pytest.hookimpl(tryfirst=True)  # before the ``-m`` selection reads the markers
def pytest_collection_modifyitems(config, items):
    from overlap_muon.apps import spawn
    from overlap_muon.apps.bench.common import matmul_gflops, slow_bf16

    files = {os.path.basename(str(item.fspath)) for item in items}
    spawn.preload(*[m for f in sorted(files) for m in _RANK_IMPORTS.get(f, ())])

    rates = config.stash[_RATES] = matmul_gflops()
    heavy = [item for item in items if item.get_closest_marker("bf16_heavy")]
    config.stash[_HEAVY] = {item.nodeid for item in heavy}
    if heavy and slow_bf16(rates):
        for item in heavy:
            item.add_marker(pytest.mark.slow)
        config.stash[_BF16_MOVED] = len(heavy)


def pytest_runtest_logreport(report):
    """Every test's setup + call + teardown seconds, for the time model."""
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    from tests import time_model

    rates = config.stash.get(_RATES, None)
    if rates is None:
        return
    moved = config.stash.get(_BF16_MOVED, 0)
    if moved:
        terminalreporter.write_line(
            f"bf16 matmul runs at {rates['bf16']:.1f} GFLOP/s here against {rates['fp32']:.0f} for fp32 (no native "
            f"bf16): {moved} NS-heavy tests join the long tier (-m slow; -m \"\" runs every tier)")
    durations = _durations
    from overlap_muon.apps.time_model import spawn_seconds

    rates = dict(rates, spawn=spawn_seconds(5 if len(_durations) > 100 else 1))  # now that no test loads the machine
    log = config.getoption("--time-log")
    if log:
        import json

        with open(log, "w") as f:
            json.dump({"rates": rates, "durations": durations}, f, indent=0, sort_keys=True)
    if not durations:
        return
    model = time_model.load()
    here, unknown = time_model.predict(model, durations, rates, rates)
    default = {k: v for k, v in durations.items() if k not in config.stash[_HEAVY]}
    slowest, _ = time_model.predict(model, default, rates, time_model.SLOWEST)
    s = time_model.SLOWEST
    terminalreporter.write_line(
        f"time model (tests/time_model.py): these tests took {sum(durations.values()):.0f} s here (matmul bf16 "
        f"{rates['bf16']:.1f}, fp32 {rates['fp32']:.1f} GFLOP/s, interpreter start {rates['spawn']:.2f} s), the "
        f"model says {here:.0f} s; on the slowest CPU we know (bf16 {s['bf16']}, fp32 {s['fp32']:.0f}, start "
        f"{s['spawn']:.1f} s) it says {slowest:.0f} s (default tier's budget {time_model.BUDGET_S:.0f} s)"
        f"{f'; {unknown} tests unknown to it' if unknown else ''}")
