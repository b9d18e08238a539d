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
# tier (``-m slow``; ``-m ""`` runs every tier) and the default command keeps its time. The summary says so.
_BF16_MOVED = pytest.StashKey[tuple]()


@pytest.hookimpl(tryfirst=True)  # before the ``-m`` selection reads the markers
def pytest_collection_modifyitems(config, items):
    heavy = [item for item in items if item.get_closest_marker("bf16_heavy")]
    if not heavy:
        return
    from overlap_muon.apps.bench.common import matmul_gflops, slow_bf16

    rates = matmul_gflops()
    if slow_bf16(rates):
        for item in heavy:
            item.add_marker(pytest.mark.slow)
        config.stash[_BF16_MOVED] = (len(heavy), rates)


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    moved = config.stash.get(_BF16_MOVED, None)
    if moved is not None:
        n, rates = moved
        terminalreporter.write_line(
            f"bf16 matmul runs at {rates['bf16']:.1f} GFLOP/s here against {rates['fp32']:.0f} for fp32 (no native "
            f"bf16): {n} NS-heavy tests join the long tier (-m slow; -m \"\" runs every tier)")
