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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks, route", [(1, []), pytest.param(2, [], marks=pytest.mark.slow),
                                          pytest.param(2, ["--factory"], marks=pytest.mark.slow)])
def test_hf_trainer_example(ranks, route):
    """One process, and Trainer's DDP on 2 ranks under torchrun, on both routes (``optimizers=`` and Trainer's factory
    protocol): bitwise torch.optim.Muon + AdamW under Trainer's default linear lr schedule, with no wave re-run."""
    pytest.importorskip("transformers")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if ranks == 2 else []
    out = _run([sys.executable, *launch, "examples/hf_trainer.py", *route], timeout=240)
    assert out.returncode == 0 and "0 waves re-run in step(): bitwise equal" in out.stdout, \
        out.stdout + out.stderr[-3000:]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("ranks", [pytest.param(1, marks=pytest.mark.slow), pytest.param(2, marks=pytest.mark.slow)])
def test_lightning_example(ranks):  # the long tier: Lightning's default-tier tests are in test_lightning.py
    """One process, and ``strategy="ddp"`` on 2 ranks under torchrun (Lightning sees torchrun's variables and launches
    nothing): no wave re-runs (``tests/test_lightning.py`` holds the bitwise comparison)."""
    pytest.importorskip("lightning")
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"] if ranks == 2 else []
    out = _run([sys.executable, *launch, "examples/lightning_fit.py"], timeout=240)
    assert out.returncode == 0 and "0 waves re-run in step()" in out.stdout, out.stdout + out.stderr[-3000:]


_TESTED = {"examples/one_process.py", "examples/fsdp_tp.py", "examples/hf_trainer.py",
           "examples/lightning_fit.py"}  # run by the tests above


@pytest.mark.timeout(400)
def test_readme_commands_are_the_tested_ones():
    """The README's shell lines: each example it runs is one the tests above run, and the main job's torchrun line
    runs as written, shortened to 3 steps with ``--verify`` (bitwise against torch.optim.Muon + AdamW)."""
    readme = (ROOT / "README.md").read_text()
    lines = [ln.split("#")[0].strip() for b in re.findall(r"^```bash\n(.*?)^```", readme, flags=re.M | re.S)
             for ln in b.splitlines()]
    examples = {w for ln in lines for w in ln.split() if w.startswith("examples/")}
    assert examples and examples <= _TESTED, examples - _TESTED
    jobs = sorted({ln[ln.index("torchrun "):] for ln in lines if "-m overlap_muon.apps.train" in ln})
    assert len(jobs) == 1, jobs  # the opening chain ends with the step-by-step block's command
    argv = [sys.executable, "-m", "torch.distributed.run", *jobs[0].split()[1:], "--steps", "3", "--verify"]
    out = _run(argv, timeout=360)
    assert out.returncode == 0 and "verify: bitwise equal" in out.stdout + out.stderr, out.stdout + out.stderr[-3000:]


@pytest.mark.parametrize("doc, heading", [("README.md", None), ("docs/integrations.md", None)])
def test_doc_code_is_copied_from_the_examples(doc, heading):
    """Every python block of the README and of the integrations guide appears line for line in one of the example
    files (which the tests above run)."""
    text = (ROOT / doc).read_text()
    if heading is not None:
        text = text[text.index(f"## {heading}\n"):]
        text = text[:text.index("\n## ")]
    examples = "\n".join(p.read_text() for p in sorted((ROOT / "examples").glob("*.py")))
    blocks = re.findall(r"^```python\n(.*?)^```", text, flags=re.M | re.S)
    assert blocks
    for block in blocks:
        assert block.strip() in examples, block
