"""Errors and warnings a newcomer can act on: each is one short paragraph that names the fix, raised where the
user's own line is (not inside torch or this package)."""

from __future__ import annotations

import contextlib
import io
import os
import warnings

import pytest
import torch
from torch import nn

from overlap_muon import OverlapMuon
from overlap_muon.config import resolve_config
from tests.dist_utils import run_ranks
from tests.models import HP, TinyNet


def _one_paragraph(msg: str, limit: int = 400) -> None:
    assert "\n" not in msg and len(msg) <= limit, (len(msg), msg)


def _caught(fn) -> list[warnings.WarningMessage]:
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fn()
    return [x for x in w if "OverlapMuon" in str(x.message)]


def test_no_muon_param_warns_at_the_users_line():
    """A model with no nn.Linear silently became plain AdamW."""
    got = _caught(lambda: OverlapMuon(nn.Sequential(nn.LayerNorm(4)), **HP).close())
    assert len(got) == 1 and got[0].filename == __file__, [(str(x.message), x.filename) for x in got]
    msg = str(got[0].message)
    _one_paragraph(msg)
    assert "no param went to Muon" in msg and "muon_filter=" in msg


def test_parameters_instead_of_the_model():
    with pytest.raises(TypeError) as e:
        OverlapMuon(TinyNet().parameters(), **HP)
    _one_paragraph(str(e.value))
    assert "pass the model, not its parameters" in str(e.value) and "OverlapMuon(model" in str(e.value)


def test_misspelt_variable_warns_with_the_closest_name():
    got = _caught(lambda: resolve_config({"OVERLAP_MUON_OVRELAP": "0"}))
    assert len(got) == 1 and got[0].filename == __file__
    msg = str(got[0].message)
    _one_paragraph(msg)
    assert "OVERLAP_MUON_OVRELAP" in msg and "did you mean OVERLAP_MUON_OVERLAP?" in msg


def test_warnings_skip_the_import_machinery_and_stop_at_the_jobs():
    """Under ``torchrun -m overlap_muon.apps.train`` the misspelt-variable warning named ``<frozen runpy>``: frames of
    the import machinery are skipped, and the project's own jobs count as the user's code."""
    import overlap_muon.apps.train as train
    from overlap_muon import _messages as messages
    runner = compile("resolve_config({'OVERLAP_MUON_OVRELAP': '0'})", "<frozen runpy>", "exec")
    got = _caught(lambda: exec(runner, {"resolve_config": resolve_config}))
    assert len(got) == 1 and got[0].filename == __file__, [x.filename for x in got]
    skip = messages._internal_dirs()
    assert not messages._internal(train.__file__, skip) and messages._internal(messages.__file__, skip)


def test_a_warning_in_step_points_at_the_users_line():
    """A re-run warning is raised inside step(), under torch's optimizer wrapper: it names this file, not
    torch/optim/optimizer.py or torch/utils/_contextlib.py."""
    model = TinyNet()
    opt = OverlapMuon(model, **HP)
    model(torch.randn(2, 12)).pow(2).mean().backward()
    with torch.no_grad():
        for p in model.parameters():
            p.grad.mul_(0.5)  # an in-place edit after backward: the waves re-run, with a warning
    got = _caught(opt.step)
    opt.close()
    assert got and got[0].filename == __file__, [(str(x.message)[:60], x.filename) for x in got]


def _missing_mesh_body(rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    models = [TinyNet() for _ in range(3)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("fsdp",))
    for m in models[:2]:
        fully_shard(m, mesh=mesh)
    fully_shard(models[2].up, mesh=mesh)  # the dense weights on two meshes: no single one to take
    fully_shard(models[2], mesh=init_device_mesh("cpu", (world,), mesh_dim_names=("other",)))
    inferred, given = OverlapMuon(models[0], **HP), OverlapMuon(models[1], device_mesh=mesh, **HP)
    x = torch.randn(4, 12, generator=torch.Generator().manual_seed(rank))
    for m, o in ((models[0], inferred), (models[1], given)):
        m(x).square().sum().backward()
        o.step()
        o.close()
    same = all(torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(models[0].parameters(),
                                                                               models[1].parameters()))
    try:
        OverlapMuon(models[2], **HP)
    except ValueError as e:
        return same, str(e)
    return same, None


@pytest.mark.timeout(120)
def test_missing_mesh_is_one_error_with_the_fix():
    """DTensor params without ``device_mesh``: the one mesh they live on is taken (bitwise the mesh given); on
    several meshes, one error for all of them (it was one per param), naming the fix."""
    for same, msg in run_ranks(_missing_mesh_body, 2, timeout=100):
        assert same
        assert msg is not None and msg.count("no device_mesh was given") == 1, msg
        _one_paragraph(msg, 500)
        assert "device_mesh=model.get_parameter(" in msg and "remat_dim=" in msg and "several meshes" in msg


def _bad_setting_body(rank, world):
    from overlap_muon.apps import train

    os.environ["OVERLAP_MUON_MODE"] = "bogus"
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            train.main(["--d-model", "32", "--n-layers", "2", "--n-heads", "4", "--seq-len", "32", "--batch", "8",
                        "--steps", "2", "--quiet"])
        except SystemExit as e:
            return e.code, err.getvalue()
    return 0, err.getvalue()


@pytest.mark.timeout(150)
def test_bad_setting_under_torchrun_is_one_line_per_rank():
    """A bad OVERLAP_MUON_* value in the training job: one ``error:`` line per rank (it was a traceback of about
    100 lines per rank), exit status 2."""
    for rank, (code, err) in enumerate(run_ranks(_bad_setting_body, 2, timeout=120)):
        lines = [ln for ln in err.splitlines() if "error:" in ln]
        assert code == 2 and len(lines) == 1, err
        assert lines[0].startswith(f"[rank {rank}] overlap-muon-train: error: OVERLAP_MUON_MODE='bogus'"), lines[0]
        _one_paragraph(lines[0])


def test_main_job_hardware_warnings():
    """The main job warns at start when ranks >= cores with overlap on, and when bf16 matmul is slower than fp32;
    each note is one paragraph naming what to do or expect."""
    from overlap_muon.apps.train import hardware_notes

    fast, slow = {"bf16": 900.0, "fp32": 150.0}, {"bf16": 1.4, "fp32": 22.0}
    assert hardware_notes(2, 16, False, True, fast) == []
    assert hardware_notes(2, 2, True, True, slow) == []  # CUDA: neither applies
    crowded = hardware_notes(2, 2, False, True, fast)
    assert len(crowded) == 1 and "OVERLAP_MUON_OVERLAP=0" in crowded[0]
    assert hardware_notes(2, 2, False, False, fast) == []
    (bf16,) = hardware_notes(1, 8, False, True, slow)
    assert "no native bf16" in bf16 and "1 GFLOP/s" in bf16
    for note in crowded + [bf16]:
        _one_paragraph(note)


def test_split_summary_shown_once_without_logging_setup(caplog):
    """Logging not set up (the logger not enabled for INFO): one line, once per process, with the split summary and
    how to see the table; with INFO on, the table itself."""
    import logging

    from overlap_muon import _builder as builder
    builder._SPLIT_SHOWN.clear()
    caplog.set_level(logging.WARNING, logger="overlap_muon")
    for _ in range(2):
        OverlapMuon(TinyNet(), **HP).close()
    lines = [r.getMessage() for r in caplog.records if "Muon matrices" in r.getMessage()]
    assert len(lines) == 1 and "setLevel(logging.INFO)" in lines[0], lines
    _one_paragraph(lines[0])
    caplog.clear()
    caplog.set_level(logging.INFO, logger="overlap_muon")
    OverlapMuon(TinyNet(), **HP).close()
    assert any("up.weight" in r.getMessage() for r in caplog.records)  # the table names the params


def test_a_rerun_by_fsdp2_accumulation_names_its_fix():
    """FSDP2's in-place accumulation re-runs the waves through its reduce-scatter: the warning names FSDP2's own
    switch (set_requires_gradient_sync), not the generic advice for collectives; other collectives keep theirs."""
    from collections import defaultdict

    from overlap_muon._messages import rerun_warnings

    for op, must in (("reduce_scatter_single", "set_requires_gradient_sync(False)"), ("all_reduce", "attach_ddp")):
        stats = defaultdict(int, {f"reruns.grad_edited:collective:{op}": 3, "steps": 1})
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rerun_warnings(stats, {}, set(), 3)
        (w,) = [str(c.message) for c in caught]
        assert "3 of 3 waves re-ran" in w and op in w and must in w, w
