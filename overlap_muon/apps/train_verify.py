"""What the training job measures and checks: ``--verify``'s full-matrix reference, the single-process
``torch.optim.Muon`` pair, the parameter checksum and the validation loss."""

from __future__ import annotations

import argparse
import hashlib
import struct
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap_muon.apps.data import ByteData
from overlap_muon.apps.model import GPT, expert_params, full_experts, muon_params
from overlap_muon.apps.train_args import _adamw_kwargs, _muon_kwargs


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Verifier:
    """``--verify``: every param as a full matrix, stepped by ``torch.optim.Muon`` (the Muon params of the run) and
    ``torch.optim.AdamW`` (the rest) on this run's own gradients, gathered each step, with the run's learning
    rates; after each step the run's params must equal it bit for bit. It checks the optimizer alone, on this
    machine's kernels, whatever the layout: at TP > 1 the forward itself differs in the last bits from one process
    (``RowwiseParallel`` splits a reduction), so a whole-run comparison would not be bitwise there. Collective (every
    rank gathers)."""

    def __init__(self, model: GPT, opt: Any, args: argparse.Namespace) -> None:
        muon_names = set(opt.muon_param_names)
        self.named = list(model.named_parameters())
        self.full = [torch.nn.Parameter(_full(p.detach()).clone()) for _, p in self.named]
        is_muon = [n in muon_names for n, _ in self.named]
        self.muon = torch.optim.Muon([f for f, m in zip(self.full, is_muon) if m], **_muon_kwargs(args))
        self.adamw = torch.optim.AdamW([f for f, m in zip(self.full, is_muon) if not m], **_adamw_kwargs(args))
        self.steps, self.first_bad = 0, None

    def before_step(self, opt: Any) -> None:
        """Feed the shadow this step's gradients and learning rates, and step it."""
        lrs = {g.get("algorithm"): g["lr"] for g in opt.param_groups}
        for (_, p), f in zip(self.named, self.full):
            f.grad = _full(p.grad).clone() if p.grad is not None else None
        for o, algo in ((self.muon, "muon"), (self.adamw, "adamw")):
            for g in o.param_groups:
                g["lr"] = lrs.get(algo, g["lr"])
            o.step()
            o.zero_grad()

    def after_step(self) -> None:
        """Compare the run's params with the shadow's (the step has landed: ``step()`` returns with its updates)."""
        bad = [n for (n, p), f in zip(self.named, self.full) if not torch.equal(_full(p.detach()), f.detach())]
        if bad and self.first_bad is None:
            self.first_bad = (self.steps, bad)
        self.steps += 1

    def report(self) -> str:
        if self.first_bad is None:
            return (f"verify: bitwise equal to torch.optim.Muon + AdamW fed this run's gradients, at every one of "
                    f"{self.steps} steps ({len(self.full)} params)")
        step, bad = self.first_bad
        return f"verify: DIFFERENT from torch.optim.Muon + AdamW from step {step}: {bad[:6]}"


class _TorchMuonPair:
    """``torch.optim.Muon`` on the Muon matrices + ``torch.optim.AdamW`` on the rest, behind one optimizer-like
    face (``step``, ``zero_grad``, ``param_groups`` tagged with ``"algorithm"``, state dicts).

    MoE: ``torch.optim.Muon`` takes 2-D params only, so each expert matrix ``p[e]`` of a grouped ``(E, P, Q)``
    weight gets a 2-D copy of its own (a leaf param of the Muon group, after the dense matrices): ``step`` copies
    ``p[e]`` and its gradient in, steps, and writes the result back. That is ``torch.optim.Muon`` on every expert
    matrix as its own param, the reference for ``OverlapMuon(..., experts=...)``.
    """

    def __init__(self, model: GPT, args: argparse.Namespace) -> None:
        mats = muon_params(model)
        self.experts = list(expert_params(model).values())
        self.shadows = [(p, e, torch.nn.Parameter(p.detach()[e].clone())) for p in self.experts
                        for e in range(p.shape[0])]
        ids = {id(p) for p in mats + self.experts}
        rest = [p for p in model.parameters() if id(p) not in ids]
        self.muon = torch.optim.Muon(mats + [s for _, _, s in self.shadows], **_muon_kwargs(args))
        self.adamw = torch.optim.AdamW(rest, **_adamw_kwargs(args))
        for g in self.muon.param_groups:
            g["algorithm"] = "muon"
        for g in self.adamw.param_groups:
            g["algorithm"] = "adamw"

    @property
    def param_groups(self) -> list[dict]:
        return self.muon.param_groups + self.adamw.param_groups

    def step(self) -> None:
        with torch.no_grad():
            for p, e, s in self.shadows:
                s.copy_(p[e])
                s.grad = None if p.grad is None else p.grad[e]
        self.muon.step()
        self.adamw.step()
        with torch.no_grad():
            for p, e, s in self.shadows:
                p[e].copy_(s)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.muon.zero_grad(set_to_none)
        self.adamw.zero_grad(set_to_none)
        for p in self.experts:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    def state_dict(self) -> dict:
        return {"muon": self.muon.state_dict(), "adamw": self.adamw.state_dict()}

    def load_state_dict(self, sd: dict) -> None:
        self.muon.load_state_dict(sd["muon"])
        self.adamw.load_state_dict(sd["adamw"])




def _checksum(model: GPT) -> tuple[float, str]:
    """(sum of every parameter's full tensor in float64, sha256 of the names and full float32 bytes, 16 hex).

    Collective when parameters are DTensors (``full_tensor``) or MoE experts (all ``E`` gathered): every rank must
    call it.
    """
    from torch.distributed.tensor import DTensor

    total = 0.0
    h = hashlib.sha256()
    experts = {id(p) for p in expert_params(model).values()}
    with torch.no_grad():
        for name, p in model.named_parameters():
            full = p.full_tensor() if isinstance(p, DTensor) else full_experts(model, p) if id(p) in experts else p
            full = full.detach().cpu().contiguous()
            total += float(full.double().sum())
            h.update(name.encode())
            h.update(struct.pack("<q", full.numel()))
            h.update(full.view(torch.uint8).numpy().tobytes() if full.numel() else b"")
    return total, h.hexdigest()[:16]


@torch.no_grad()
def _evaluate(model: GPT, data: ByteData, args: argparse.Namespace, g: int, remat_group, device) -> float:
    """Mean validation loss over the fixed windows, nats per byte.

    The window count is rounded up to a multiple of ``remat * micro_batch`` so every remat rank runs the same
    number of forwards (FSDP's all-gathers are collective); rank ``g`` takes the ``g``-th contiguous share, in
    batches of the training micro-batch size (so equivalent layouts run the very same forward shapes).
    """
    mb = args.batch // (args.remat * args.grad_accum)
    per = args.remat * mb
    n = -(-args.val_windows // per) * per
    share = n // args.remat
    batches = data.val_batches(n, mb, args.seq_len)[g * share // mb : (g + 1) * share // mb]
    was_training = model.training
    model.eval()
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        logits = model(x.to(device))
        total[0] += F.cross_entropy(logits.flatten(0, 1), y.to(device).flatten(), reduction="sum").double()
        total[1] += y.numel()
    if remat_group is not None:
        dist.all_reduce(total, group=remat_group)
    model.train(was_training)
    return float(total[0] / total[1])
