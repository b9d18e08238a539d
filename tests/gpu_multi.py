"""For the first machine with two or more GPUs: what one GPU cannot show, under ``torchrun``
(``tests/gpu_check_multi.sh`` runs it with NCCL's flight recorder on, and once more with
``CUDA_DEVICE_MAX_CONNECTIONS=1``).

* ``second_optimizer``: FSDP2 over every rank, the default step, and an AdamW stepping on the same params after
  ``OverlapMuon.step()`` (as the README's loop and torchtitan's optimizer container do): the params after 4 steps
  bitwise equal those of ``overlap=False`` (issue 46, finding 1: a post-optimizer event handed to FSDP2 would let
  the next all-gather read the shards before AdamW's writes).
* ``all_gather_race``: ``async_step`` with a slow apply (``torch.cuda._sleep`` on its lane): the forward after the
  step equals the synchronous one, and with FSDP2's all-gather streams left out of the wait it differs (the race
  that one GPU cannot show: FSDP2 over one rank never all-gathers).

Rank 0 writes ``gpu_multi.json`` in ``--out`` and exits 1 if a check failed. ``--device cpu`` runs the same code over
gloo on CPU (the suite's smoke run; the race half is skipped there: no streams).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from overlap_muon import OverlapMuon  # noqa: E402
from tests.seams import SeamedOverlapMuon, TestingSeam  # noqa: E402

HP = dict(lr=0.02, weight_decay=0.1, momentum=0.95, nesterov=True)


def _model(device: torch.device, world: int, d: int = 256) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(d, 4 * d, bias=False), nn.GELU(), nn.Linear(4 * d, d, bias=False))
                            for _ in range(2)]).to(device)
    mesh = init_device_mesh(device.type, (world,), mesh_dim_names=("remat",))
    for block in model:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, mesh


def _full(model: nn.Module) -> list[torch.Tensor]:
    return [p.full_tensor().detach().clone() for p in model.parameters()]


def second_optimizer(device: torch.device, world: int) -> dict:
    x = torch.randn(32, 256, device=device, generator=torch.Generator(device).manual_seed(1))
    finals = {}
    for overlap in (True, False):
        model, mesh = _model(device, world)
        opt = OverlapMuon(model, device_mesh=mesh, overlap=overlap, auto_overlap=False, **HP)
        adamw = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for _ in range(4):
            model(x).pow(2).mean().backward()
            opt.step()
            adamw.step()  # queued after step(): the next forward's all-gather must see it
            opt.zero_grad()
        opt.synchronize()
        finals[overlap] = _full(model)
        opt.close()
    same = all(torch.equal(a, b) for a, b in zip(finals[True], finals[False]))
    return {"ok": same, "bitwise_vs_overlap_off": same}


def all_gather_race(device: torch.device, world: int) -> dict:
    if device.type != "cuda":
        return {"skipped": "no CUDA streams on CPU"}
    import overlap_muon._forward_waits as waits

    real = waits.fsdp_param_streams
    x = torch.randn(32, 256, device=device, generator=torch.Generator(device).manual_seed(0))
    out = {}
    for label, streams in (("fixed", real), ("without_the_fix", lambda module: [])):
        waits.fsdp_param_streams = streams
        outs = []
        for overlap in (True, False):
            model, mesh = _model(device, world)
            seam = TestingSeam(before_apply=lambda st: torch.cuda._sleep(200_000_000))  # ~0.1 s on the lane
            opt = SeamedOverlapMuon(model, device_mesh=mesh, overlap=overlap, async_step=True, _testing=seam, **HP)
            for _ in range(2):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            outs.append(model(x).detach().clone())  # reads the update through FSDP2's all-gather
            opt.synchronize()
            opt.close()
        out[label] = bool(torch.equal(outs[0], outs[1]))
    waits.fsdp_param_streams = real
    return {"ok": out["fixed"] and not out["without_the_fix"], **out}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default="traces/gpu_check")
    a = ap.parse_args(argv)
    cuda = a.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", rank))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    report = {"world": world, "device": torch.cuda.get_device_name(device) if cuda else "cpu",
              "env": {k: os.environ.get(k) for k in ("CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_NCCL_TRACE_BUFFER_SIZE")}}
    for name, check in (("second_optimizer", second_optimizer), ("all_gather_race", all_gather_race)):
        try:
            report[name] = check(device, world)
        except Exception as e:  # noqa: BLE001 - reported, the next check runs
            report[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if rank == 0:
            print(f"{name}: {report[name]}", flush=True)
    failed = [n for n in ("second_optimizer", "all_gather_race") if report[n].get("ok") is False]
    if rank == 0:
        os.makedirs(a.out, exist_ok=True)
        name = "gpu_multi" + ("_one_connection" if os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1" else "")
        with open(os.path.join(a.out, f"{name}.json"), "w") as f:
            json.dump({**report, "failed": failed}, f, indent=2, default=str)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
