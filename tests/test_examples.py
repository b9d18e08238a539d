"""The files under ``examples/`` run as a user runs them, and the README's code is copied from them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _run(cmd: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.timeout(150)
def test_one_process_example_prints_bitwise_equal():
    out = _run([sys.executable, "examples/one_process.py"], timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("bitwise equal"), out.stdout + out.stderr


@pytest.mark.timeout(300)
def test_fsdp_tp_example_under_torchrun():
    out = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                "examples/fsdp_tp.py"], timeout=240)
    assert out.returncode == 0 and "overlap on and off are bitwise equal" in out.stdout, out.stdout + out.stderr[-3000:]


def test_readme_code_is_copied_from_the_examples():
    """Every python block of the README appears, line for line, in one of the example files."""
    readme = (ROOT / "README.md").read_text()
    examples = "\n".join(p.read_text() for p in sorted((ROOT / "examples").glob("*.py")))
    blocks = re.findall(r"^```python\n(.*?)^```", readme, flags=re.M | re.S)
    assert blocks
    for block in blocks:
        assert block.strip() in examples, block
