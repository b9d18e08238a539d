"""Pipeline parallelism with ``torch.distributed.pipelining``: every rank builds an ``OverlapMuon`` on its own stage.

[Note: pipeline stages] (``overlap_muon/_discovery.py``) makes the construction checks and ``step()``'s agreement
per stage; [Note: pipeline readiness] (``hooks/pipeline_stage.py``) launches the waves once per schedule step, when
the stage's gradients are final. Before, building an optimizer per stage was refused ("Every rank must build the same
model"), and with one model on every rank NS ran 5 times per matrix per step under 1F1B with 4 micro-batches.

Each step, the test reads the stage's final gradients (``full_tensor()`` under TP) and feeds them to a full copy of
the stage's params driven by ``torch.optim.Muon`` + ``torch.optim.AdamW``: the reference is torch's optimizer on the
same gradients, whatever order a sharded backward summed them in. Compared with ``torch.equal`` every step; NS runs
are counted (``stats["ns_matrices"]``, summed over the stage's ranks).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn

from overlap_muon import OverlapMuon
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP

D, MICRO, STEPS = 16, 4, 3


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(D, 2 * D, bias=False)
        self.down = nn.Linear(2 * D, D, bias=False)
        self.norm = nn.LayerNorm(D)

    def forward(self, x):
        return x + self.down(torch.tanh(self.up(self.norm(x))))


def _stage_modules(n_stages: int) -> list[nn.Sequential]:
    torch.manual_seed(0)
    return [nn.Sequential(Block(), Block()) for _ in range(n_stages)]


def _reference(stage_mod: nn.Module):
    """A full copy of the stage's params with torch's optimizers (Linear weights to Muon, the rest to AdamW)."""
    ref = copy.deepcopy(stage_mod)
    lin = {id(m.weight) for m in ref.modules() if isinstance(m, nn.Linear)}
    return ref, [torch.optim.Muon([p for p in ref.parameters() if id(p) in lin], **HP),
                 torch.optim.AdamW([p for p in ref.parameters() if id(p) not in lin], **ADAMW_KW)]


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _pp_body(rank, world, schedule_name, overlap, tp, dp=1):
    """``dp > 1``: that many data-parallel replicas of every stage (the same batches, so the same gradients) with
    DP slots on: the replicas of a stage share its NS work."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, schedules
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    pp = world // (tp * dp)
    mesh = init_device_mesh("cpu", (pp, dp, tp), mesh_dim_names=("pp", "dp_replicate", "tp"))
    pp_rank = mesh.get_local_rank("pp")
    per_rank = 2 if schedule_name == "Interleaved1F1B" else 1
    n_stages = pp * per_rank
    mods = _stage_modules(n_stages)
    mine = [pp_rank + k * pp for k in range(per_rank)]  # interleaved: stages r and r + pp
    stages, opts, refs = [], [], []
    for s in mine:
        mod = mods[s]
        refs.append(_reference(mod))
        if tp > 1:
            for blk in mod:
                parallelize_module(blk, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
        stage = PipelineStage(mod, s, n_stages, torch.device("cpu"), group=mesh["pp"].get_group())
        opt = OverlapMuon(mod, device_mesh=mesh, remat_dim=None, tp_dim="tp", adamw_kwargs=ADAMW_KW, **HP,
                          overlap=overlap, dp_slots=dp > 1)
        opt.attach_pipeline_stage(stage)
        stages.append(stage)
        opts.append(opt)
    cls = getattr(schedules, f"Schedule{schedule_name}")
    loss_fn = lambda out, y: (out - y).pow(2).mean()  # noqa: E731
    sched = cls(stages if per_rank > 1 else stages[0], n_microbatches=MICRO, loss_fn=loss_fn)
    gen = torch.Generator().manual_seed(5)
    bad, ns, launched_in_schedule, reruns = [], 0, 0, 0
    for step in range(STEPS):
        x, y = torch.randn(8, D, generator=gen), torch.randn(8, D, generator=gen)
        before = sum(o.stats["waves_launched"] for o in opts)
        if pp_rank == 0:
            sched.step(x, target=y) if pp_rank == pp - 1 else sched.step(x)
        elif pp_rank == pp - 1:
            sched.step(target=y)
        else:
            sched.step()
        launched_in_schedule += sum(o.stats["waves_launched"] for o in opts) - before
        for (ref, ref_opts), stage in zip(refs, stages):
            for p, q in zip(stage.submod.parameters(), ref.parameters()):
                q.grad = _full(p.grad).clone() if p.grad is not None else None
            for o in ref_opts:
                o.step()
                o.zero_grad()
        for o in opts:
            o.step()
            o.zero_grad()
        for (ref, _), stage in zip(refs, stages):
            bad += [f"step {step} stage {stage.stage_index} {n}" for (n, p), q in
                    zip(stage.submod.named_parameters(), ref.parameters()) if not torch.equal(_full(p.detach()), q)]
    for o in opts:
        o.synchronize()
        ns += o.stats["ns_matrices"]
        reruns += o.stats["reruns"]
    matrices = sum(len(o.muon_param_names) for o in opts)
    for o in opts:
        o.close()
    return bad, ns, matrices, launched_in_schedule, reruns


def _check(out, tp, overlap, dp=1):
    per_stage: dict[int, list] = {}
    for rank, (bad, ns, matrices, launched, reruns) in enumerate(out):
        assert bad == [], bad[:4]
        assert reruns == 0
        assert (launched > 0) == overlap, launched  # overlap: launched inside schedule.step(), not in step()
        per_stage.setdefault(rank // (tp * dp), []).append((ns, matrices))
    for rows in per_stage.values():  # NS once per matrix per step: summed over the stage's TP ranks and replicas
        assert sum(n for n, _ in rows) == STEPS * rows[0][1], rows
        assert all(n > 0 for n, _ in rows), rows  # with DP slots every replica takes a share


@pytest.mark.timeout(300)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
@pytest.mark.parametrize("schedule_name", ["GPipe", "1F1B", "Interleaved1F1B"])
def test_two_stages_each_its_own_optimizer(schedule_name, overlap):
    _check(run_ranks(_pp_body, 2, schedule_name, overlap, 1, timeout=250), 1, overlap)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_two_stages_times_tp2(overlap):
    _check(run_ranks(_pp_body, 4, "1F1B", overlap, 2, timeout=350), 2, overlap)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "sync"])
def test_two_stages_times_dp2_share_the_ns(overlap):
    """2 stages x 2 data-parallel replicas with DP slots: each stage's replicas split its NS work between them
    (the replicas of one stage only), bitwise per stage."""
    _check(run_ranks(_pp_body, 4, "1F1B", overlap, 1, 2, timeout=350), 1, overlap, dp=2)


def _refused_without_pp_body(rank, world):
    mods = _stage_modules(2)
    try:
        OverlapMuon(mods[rank][:1] if rank else mods[rank], **HP)  # different models, nothing names the stages
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.timeout(120)
def test_different_models_without_stages_say_how_to_name_them():
    for msg in run_ranks(_refused_without_pp_body, 2, timeout=100):
        assert msg is not None and "pp_group=" in msg, msg


def _explicit_pp_group_body(rank, world):
    mods = _stage_modules(2)
    opt = OverlapMuon(mods[rank][:1] if rank else mods[rank], pp_group=dist.group.WORLD, **HP)
    names = opt.muon_param_names
    opt.close()
    return names


@pytest.mark.timeout(120)
def test_explicit_pp_group_checks_each_stage_alone():
    a, b = run_ranks(_explicit_pp_group_body, 2, timeout=100)
    assert len(a) == 4 and len(b) == 2, (a, b)
