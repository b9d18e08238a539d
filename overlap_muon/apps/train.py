"""Train a small tensor-parallel byte-level GPT on real text: ``python -m overlap_muon.apps.train`` / ``overlap-muon-train``.

Launch with ``torchrun --standalone --nproc-per-node N -m overlap_muon.apps.train [flags]`` or as one plain process.
The world is a ``("remat", "tp")`` DeviceMesh of ``--remat x --tp`` ranks (gloo on CPU, NCCL on CUDA): the linears
are tensor-parallel over ``tp`` and FSDP2-sharded over ``remat``, which is also the data-parallel dim (see
:mod:`overlap_muon.apps.model`). Data is byte-level text (:mod:`overlap_muon.apps.data`): the Python standard library's
sources by default, or ``--data FILE``.

Optimizers (``--optimizer``):

- ``overlap_muon`` (default): :class:`overlap_muon.OverlapMuon` (Muon on the ``nn.Linear`` weights, AdamW on
  the rest), toggled through its ``OVERLAP_MUON_*`` environment variables;
- ``adamw``: ``torch.optim.AdamW`` on every parameter, lr ``--adamw-lr``;
- ``torch_muon``: the single-process reference, ``torch.optim.Muon`` on the same matrices and
  ``torch.optim.AdamW`` on the rest with exactly the hyper-parameters ``overlap_muon`` gets.

MoE (``--moe``, or ``--moe-experts E``): every ``--moe-every``-th block's MLP is a top-``--moe-top-k`` mixture
of ``E`` experts, sharded over all ranks (expert parallelism over the world, expert TP 1; see
[Note: MoE dispatch] in :mod:`overlap_muon.apps.model`). ``overlap_muon`` orthogonalizes each expert's matrices on
the rank holding it (``OverlapMuon(..., experts="*.experts.*")``); ``torch_muon`` gives ``torch.optim.Muon``
every expert matrix as a param of its own (a 2-D copy it steps and writes back); ``adamw`` steps the grouped
weights like any param. The load-balancing loss (``--moe-aux-loss`` times it) is added to the training
objective; the reported losses are the cross-entropy alone.

Every step ``s`` uses the global batch of :meth:`ByteData.train_batch` (``--batch`` rows of ``--seq-len``
bytes); remat rank ``g`` takes rows ``[g*B/R, (g+1)*B/R)`` and splits them into ``--grad-accum`` micro-batches,
each of whose mean losses is scaled by ``1/grad_accum`` before backward; FSDP averages over the ``R`` ranks.
A single process with ``--grad-accum 2`` therefore computes the same gradient as 2 FSDP ranks, bit for bit:
``g0/2 + g1/2 == (g0 + g1)/2`` exactly, as halving is exact and two addends commute (tests/test_train.py).
With more addends the summation order differs, and so do the last bits.

The learning rate of every parameter group is ``base * warmup(s) * cooldown(s)``: linear warmup over
``--warmup`` steps, flat, then linear decay to zero over the last ``--cooldown`` fraction of ``--steps``.

Prints a tqdm bar on rank 0 (loss, tokens/s), validation loss every ``--eval-every`` steps, and a final
``summary:`` line; :func:`main` returns the same figures as a dict.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import math
import os
import struct
import sys
import time
import warnings
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap_muon.apps.data import ByteData, DataError, load_file, load_stdlib
from overlap_muon.apps.model import (
    GPT,
    ModelConfig,
    expert_params,
    full_experts,
    muon_params,
    parallelize,
)

__all__ = ["main", "cli", "build_parser"]

_PROG = "overlap-muon-train"
_OPTIMIZERS = ("overlap_muon", "adamw", "torch_muon")
_CKPT_DONE = "COMPLETE"
_MOE_EXPERTS = 4  # --moe without --moe-experts
_EXPERTS = "*.experts.*"  # the grouped expert weights' names (overlap_muon.apps.model.expert_params), for OverlapMuon
# Default AdamW learning rates, each the best of {8e-4, 1.5e-3, 3e-3, 6e-3} for the default 2-rank run: for the
# embeddings, norms and head beside Muon (3e-3 and 6e-3 tie), and for every parameter with --optimizer adamw.
_ADAMW_LR_WITH_MUON = 3e-3
_ADAMW_LR_ALONE = 1.5e-3


class _ConfigError(ValueError):
    """A flag or input the run cannot use; the message says what to change."""


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags (defaults tuned so a 2-rank CPU run ends in about 2-3 minutes)."""
    p = argparse.ArgumentParser(
        prog=_PROG,
        description=__doc__.split("\n\n")[0],
        epilog="overlap_muon toggles (environment): OVERLAP_MUON_MODE=layer_sharded|duplicated, OVERLAP_MUON_OVERLAP, "
        "OVERLAP_MUON_FUSED_A2A, OVERLAP_MUON_BATCH_NS, OVERLAP_MUON_SIDE_STREAMS, OVERLAP_MUON_NVTX (1|0), "
        "OVERLAP_MUON_BALANCE=lpt|round_robin, OVERLAP_MUON_WAVE_PLAN=count|cost, OVERLAP_MUON_WAVE_SLOTS=N, OVERLAP_MUON_PG_TIMEOUT_S=seconds, "
        "OVERLAP_MUON_READINESS_ORDER=reverse|observed, OVERLAP_MUON_SKIP_NONFINITE, OVERLAP_MUON_CHECK_GRAD_PRESENCE, "
        "OVERLAP_MUON_SYRK (1|0), OVERLAP_MUON_SURPLUS=idle|duplicate|team|auto, OVERLAP_MUON_COST_MODEL=auto|cuda|cpu_gloo, "
        "OVERLAP_MUON_DP_SLOTS (1|0) (see the README).",
    )
    a = p.add_argument
    a("--optimizer", choices=_OPTIMIZERS, default="overlap_muon", help="default: %(default)s")
    a("--data", default=None, help="UTF-8 text file (default: the Python standard library's sources)")
    a("--tp", type=int, default=None, help="tensor-parallel size (default: 2 on an even world, else 1)")
    a("--remat", type=int, default=None, help="FSDP / data-parallel size (default: world size / tp)")
    a("--steps", type=int, default=400, help="optimizer steps of the schedule (default: %(default)s)")
    a("--stop-at", type=int, default=None, help="end this run after this step, as if interrupted")
    a("--batch", type=int, default=16, help="global batch, sequences per step (default: %(default)s)")
    a("--grad-accum", type=int, default=1, help="micro-batches per rank and step (default: %(default)s)")
    a("--seq-len", type=int, default=128, help="bytes per sequence (default: %(default)s)")
    a("--d-model", type=int, default=128, help="width (default: %(default)s)")
    a("--n-layers", type=int, default=4, help="blocks (default: %(default)s)")
    a("--n-heads", type=int, default=4, help="attention heads (default: %(default)s)")
    a("--mlp-ratio", type=int, default=4, help="MLP width / d_model (default: %(default)s)")
    a("--qkv", choices=("fused", "separate"), default="fused", help="attention input projections")
    a("--qk-clip", type=float, default=None, metavar="TAU",
      help="QK-clip (MuonClip) threshold: after each step, scale down the query/key rows of the heads whose max "
           "attention logit exceeded TAU (overlap_muon only; overlap_muon.QKClip)")
    a("--verify", action="store_true",
      help="check the optimizer against torch.optim.Muon + AdamW on this machine: a full-matrix copy of every param, "
           "fed this run's own (gathered) gradients each step, must stay bitwise equal (overlap_muon only)")
    a("--split-qkv", action="store_true",
      help="orthogonalize the fused qkv weight as its Q, K and V parts (overlap_muon.QKVSplit), as with --qkv separate")
    a("--moe", action="store_true",
      help=f"top-k MoE MLPs: --moe-experts {_MOE_EXPERTS} unless given, top --moe-top-k, every --moe-every-th block; "
           "experts sharded over all ranks (EP = world, ETP 1); --optimizer overlap_muon runs each expert's NS where "
           "it lives, torch_muon steps each expert matrix as its own torch.optim.Muon param, adamw the grouped "
           "weights")
    a("--moe-experts", type=int, default=None, metavar="E",
      help="experts per MoE MLP, a multiple of the world size (0: no MoE; default: 0, or 4 with --moe)")
    a("--moe-top-k", type=int, default=2, metavar="K", help="experts per token (default: %(default)s)")
    a("--moe-every", type=int, default=2, metavar="N",
      help="MoE MLP in every N-th block: blocks N-1, 2N-1, ... (default: %(default)s)")
    a("--moe-hidden", type=int, default=0, metavar="F",
      help="each expert's width (default 0: mlp-ratio x d-model / top-k, the dense MLP's FLOPs per token)")
    a("--moe-aux-loss", type=float, default=0.01, metavar="C",
      help="weight of the load-balancing loss added to the objective (default: %(default)s; 0: none)")
    a("--lr", type=float, default=0.02, help="Muon learning rate (default: %(default)s)")
    a(
        "--adamw-lr",
        type=float,
        default=None,
        help=f"AdamW learning rate (default: {_ADAMW_LR_WITH_MUON:g} beside Muon, "
        f"{_ADAMW_LR_ALONE:g} with --optimizer adamw)",
    )
    a("--weight-decay", type=float, default=0.0, help="decoupled weight decay, both (default: %(default)s)")
    a("--momentum", type=float, default=0.95, help="Muon momentum (default: %(default)s)")
    a("--max-grad-norm", type=float, default=None,
      help="clip all gradients by their global norm before each step (OverlapMuon: its max_grad_norm; the other "
           "optimizers: the same arithmetic as clip_grad_norm_); default: no clipping; with --moe one process only")
    a("--adjust-lr-fn", choices=("original", "match_rms_adamw"), default=None, help="Muon lr scaling by shape")
    a("--warmup", type=int, default=10, help="linear warmup steps (default: %(default)s)")
    a("--cooldown", type=float, default=0.3, help="fraction of steps of linear decay to 0 (default: %(default)s)")
    a("--seed", type=int, default=0, help="init and data seed (default: %(default)s)")
    a("--eval-every", type=int, default=100, help="validation every N steps, 0: only at the end")
    a("--val-windows", type=int, default=64, help="validation windows of --seq-len bytes (default: %(default)s)")
    a("--checkpoint-dir", default=None, help="save model + optimizer + position here (torch.distributed.checkpoint)")
    a("--checkpoint-every", type=int, default=0, help="save every N steps (0: only at the end / --stop-at)")
    a("--resume", action="store_true", help="continue from the latest complete checkpoint in --checkpoint-dir")
    a("--profile", action="store_true", help="torch.profiler trace per rank into --profile-dir")
    a("--profile-dir", default="traces", help="default: %(default)s")
    a("--profile-steps", type=int, nargs=2, default=(3, 3), metavar=("SKIP", "ACTIVE"), help="default: 3 3")
    a("--device", choices=("auto", "cpu", "cuda"), default="auto", help="default: cuda when available")
    a("--quiet", action="store_true", help="no progress bar or periodic logs (the summary line still prints)")
    return p


# ----------------------------------------------------------------------------------------------------------
# set-up


def _world() -> tuple[int, int, int]:
    """(rank, world size, local rank) from an initialised default group, else from torchrun's environment."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    env = os.environ
    return int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), int(env.get("LOCAL_RANK", 0))


def _check_args(args: argparse.Namespace, world: int) -> ModelConfig:
    """Validate every flag against the world size before any collective; fill ``args.tp`` / ``args.remat``.

    Raises:
        _ConfigError: with a message naming the flag and what to change.
    """
    for name in ("steps", "batch", "grad_accum", "seq_len", "val_windows"):
        if getattr(args, name) <= 0:
            raise _ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("eval_every", "checkpoint_every", "warmup"):
        if getattr(args, name) < 0:
            raise _ConfigError(f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}")
    if not 0.0 <= args.cooldown <= 1.0:
        raise _ConfigError(f"--cooldown is a fraction of --steps in [0, 1], got {args.cooldown}")
    if args.stop_at is not None and not 0 < args.stop_at <= args.steps:
        raise _ConfigError(f"--stop-at must be in [1, --steps={args.steps}], got {args.stop_at}")
    if args.resume and not args.checkpoint_dir:
        raise _ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoint is)")
    if args.moe_experts is None:
        args.moe_experts = _MOE_EXPERTS if args.moe else 0
    if args.moe_experts < 0 or (args.moe and args.moe_experts == 0):
        raise _ConfigError(f"--moe-experts must be positive with --moe (>= 0 without), got {args.moe_experts}")
    if args.moe_experts and args.moe_aux_loss < 0:
        raise _ConfigError(f"--moe-aux-loss must be >= 0, got {args.moe_aux_loss}")
    if args.moe_experts and args.max_grad_norm is not None and world > 1:
        # Expert gradients are plain tensors that differ by rank; the global norm would need their squares summed
        # over EP, which overlap_muon.clip (DTensors reduced, plain tensors taken as replicas) does not do yet.
        raise _ConfigError("--max-grad-norm with --moe needs one process for now (the experts' gradients live on "
                           "different ranks); drop --max-grad-norm or run without torchrun")
    if args.split_qkv and (args.qkv != "fused" or args.optimizer != "overlap_muon"):
        raise _ConfigError("--split-qkv splits the fused qkv weight for --optimizer overlap_muon; it needs --qkv fused")
    if args.verify and (args.optimizer != "overlap_muon" or args.moe or args.split_qkv or args.max_grad_norm is not None
                        or args.qk_clip is not None or args.resume):
        raise _ConfigError("--verify checks --optimizer overlap_muon on the plain model from step 0: drop --moe, "
                           "--split-qkv, --max-grad-norm, --qk-clip and --resume (their own tests cover them)")
    if args.qk_clip is not None and (args.optimizer != "overlap_muon" or not args.qk_clip > 0):
        raise _ConfigError(f"--qk-clip needs a positive TAU and --optimizer overlap_muon, got {args.qk_clip} with "
                           f"{args.optimizer}")
    if args.adamw_lr is None:
        args.adamw_lr = _ADAMW_LR_ALONE if args.optimizer == "adamw" else _ADAMW_LR_WITH_MUON
    if args.max_grad_norm is not None and not args.max_grad_norm > 0:
        raise _ConfigError(f"--max-grad-norm must be positive, got {args.max_grad_norm}")
    for name in ("lr", "adamw_lr"):
        if not getattr(args, name) > 0:
            raise _ConfigError(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.tp is None:
        args.tp = world // args.remat if args.remat and world % args.remat == 0 else (2 if world % 2 == 0 else 1)
    if args.tp <= 0 or world % args.tp:
        raise _ConfigError(
            f"--tp {args.tp} does not divide the world size {world}; pass a --tp that divides the number of "
            f"processes (one of {[d for d in range(1, world + 1) if world % d == 0]})"
        )
    if args.remat is None:
        args.remat = world // args.tp
    if args.remat * args.tp != world:
        raise _ConfigError(
            f"--remat {args.remat} x --tp {args.tp} = {args.remat * args.tp} != world size {world}; "
            f"pass --remat {world // args.tp} (or omit it)"
        )
    micro = args.remat * args.grad_accum
    if args.batch % micro:
        raise _ConfigError(
            f"--batch {args.batch} is not divisible by --remat x --grad-accum = {micro}; "
            f"pass a --batch that is a multiple of {micro}"
        )
    if args.optimizer == "torch_muon" and world != 1:
        raise _ConfigError(
            f"--optimizer torch_muon is the single-process reference but the world size is {world}; run it "
            "without torchrun (use --grad-accum to match a data-parallel run) or pick --optimizer overlap_muon"
        )
    try:
        cfg = ModelConfig(
            d_model=args.d_model,
            n_layers=args.n_layers,
            n_heads=args.n_heads,
            mlp_ratio=args.mlp_ratio,
            seq_len=args.seq_len,
            fused_qkv=args.qkv == "fused",
            **({"moe_experts": args.moe_experts, "moe_top_k": args.moe_top_k, "moe_every": args.moe_every,
                "moe_hidden": args.moe_hidden} if args.moe_experts else {}),
        )
        cfg.check_tp(args.tp)
        cfg.check_ep(world)
    except ValueError as e:
        raise _ConfigError(str(e)) from e
    return cfg


def _load_data(args: argparse.Namespace) -> ByteData:
    try:
        data = load_file(args.data) if args.data is not None else load_stdlib()
        data.check_window(args.seq_len)
    except DataError as e:
        raise _ConfigError(str(e)) from e
    return data


def _device(args: argparse.Namespace, local_rank: int) -> torch.device:
    if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
        if not torch.cuda.is_available():
            raise _ConfigError("--device cuda but no CUDA device is visible; pass --device cpu")
        torch.cuda.set_device(local_rank % torch.cuda.device_count())
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _adamw_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """The AdamW hyper-parameters, identical for every optimizer choice (so the reference matches)."""
    return {"lr": args.adamw_lr, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": args.weight_decay}


def _muon_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    return {
        "lr": args.lr,
        "weight_decay": args.weight_decay,
        "momentum": args.momentum,
        "nesterov": True,
        "adjust_lr_fn": args.adjust_lr_fn,
    }


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


def hardware_notes(ranks_here: int, cores: int, cuda: bool, overlap: bool, rates: dict[str, float]) -> list[str]:
    """Warnings the job prints at start (rank 0): more ranks than cores with overlap on (the NS lanes then find
    no idle core and the overlap costs time), and bf16 matmul slower than fp32 (no native bf16: every NS, in bf16,
    is slow). ``rates``: 1-thread GFLOP/s by dtype (``apps.bench.common.matmul_gflops``)."""
    from .bench.common import slow_bf16

    notes = []
    if not cuda and overlap and ranks_here >= cores:
        notes.append(f"{ranks_here} ranks on {cores} CPU cores with overlap on: the optimizer's lanes find no idle core "
                     "here, so overlap costs time; OVERLAP_MUON_OVERLAP=0 is faster on this machine")
    if not cuda and slow_bf16(rates):
        notes.append(f"bf16 matmul runs at {rates['bf16']:.0f} GFLOP/s here against {rates['fp32']:.0f} for fp32 (no "
                     "native bf16: avx512_bf16 / AMX): NS is bf16, so expect the job to take several times longer")
    return notes


def _build_optimizer(args: argparse.Namespace, model: GPT, mesh):
    if args.optimizer == "adamw":
        opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(args))
        for g in opt.param_groups:
            g["algorithm"] = "adamw"
        return opt
    if args.optimizer == "torch_muon":
        return _TorchMuonPair(model, args)
    from overlap_muon import OverlapMuon

    split = None
    if args.split_qkv:
        from overlap_muon import QKVSplit

        # model.py stores the fused rows head by head, [q_0 k_0 v_0 | q_1 k_1 v_1 | ...]: the grouped layout, g = h
        h = model.cfg.n_heads
        split = {"blocks.*.attn.qkv.weight": QKVSplit(h, h, model.cfg.d_model // h, layout="grouped")}
    # MoE: each rank's experts are its own (EP over the world, ETP 1), so no expert mesh or group: their NS runs
    # where they live.
    moe = {"experts": _EXPERTS} if model.cfg.moe_experts else {}
    qk = None
    if args.qk_clip is not None:
        from overlap_muon import QKClip

        h = model.cfg.n_heads
        rows = (dict(qkv="blocks.*.attn.qkv.weight", layout="grouped") if model.cfg.fused_qkv
                else dict(query="blocks.*.attn.q.weight", key="blocks.*.attn.k.weight"))
        qk = QKClip(args.qk_clip, h, model.cfg.head_dim, **rows)
        for block in model.blocks:
            block.attn.record_logits = True
    try:
        return OverlapMuon(model, **_muon_kwargs(args), adamw_kwargs=_adamw_kwargs(args), device_mesh=mesh,
                           max_grad_norm=args.max_grad_norm, split=split, qk_clip=qk, **moe)
    except (ValueError, TypeError) as e:  # raised on every rank before any exchange: one line per rank
        raise _ConfigError(str(e)) from e


def _sync(opt) -> None:
    """Wait for every pending optimizer update (``OverlapMuon`` applies Muon updates asynchronously)."""
    fn = getattr(opt, "synchronize", None)
    if fn is not None:
        fn()


def _accumulating(opt, on: bool):
    """``opt.no_sync()`` for a micro-batch that is not the step's last (nothing is dispatched on partial
    gradients), else a no-op context."""
    fn = getattr(opt, "no_sync", None)
    return fn() if on and fn is not None else contextlib.nullcontext()


def _close(opt) -> None:
    """Wait for pending updates and release the optimizer's hooks and worker threads, if it has any."""
    fn = getattr(opt, "close", None)
    if fn is not None:
        fn()


def _lr_factor(step: int, args: argparse.Namespace) -> float:
    """``warmup(step) * cooldown(step)`` for the 0-based ``step`` (see the module docstring)."""
    f = 1.0
    if args.warmup:
        f *= min(1.0, (step + 1) / args.warmup)
    n_cool = args.cooldown * args.steps
    if n_cool > 0:
        f *= min(1.0, (args.steps - step) / n_cool)
    return f


def _set_lr(opt, step: int, args: argparse.Namespace) -> float:
    f = _lr_factor(step, args)
    for g in opt.param_groups:
        g["lr"] = (args.lr if g.get("algorithm") == "muon" else args.adamw_lr) * f
    return f


# ----------------------------------------------------------------------------------------------------------
# figures


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


# ----------------------------------------------------------------------------------------------------------
# checkpoints


def _latest_checkpoint(root: str) -> tuple[int, str] | None:
    best = None
    if os.path.isdir(root):
        for name in os.listdir(root):
            path = os.path.join(root, name)
            if name.startswith("step_") and name[5:].isdigit() and os.path.isfile(os.path.join(path, _CKPT_DONE)):
                step = int(name[5:])
                if best is None or step > best[0]:
                    best = (step, path)
    return best


def _fingerprint(args: argparse.Namespace, cfg: ModelConfig) -> dict:
    """What must match between a checkpoint and the run resuming it for its state to load: the model and the
    layout of every shard. (The resume continues bit-identically when the other flags match too.)"""
    keys = ("optimizer", "tp", "remat")
    return {"model": _cfg_dict(cfg), **{k: getattr(args, k) for k in keys}}


def _cfg_dict(cfg: ModelConfig) -> dict:
    """``asdict(cfg)`` without the MoE fields when MoE is off (a dense run's log line and checkpoint fingerprint
    stay what they were before MoE existed)."""
    return {k: v for k, v in asdict(cfg).items() if cfg.moe_experts or not k.startswith("moe_")}


@contextlib.contextmanager
def _quiet_single_process_dcp():
    """Silence DCP's warning that it runs in a single process: that is what a one-process run means."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _save_checkpoint(root, step, model, opt, extra, rank, world, fingerprint) -> None:
    """Model via DCP (``get_model_state_dict``), optimizer state and position via per-rank ``torch.save``.

    The optimizer's own ``state_dict()`` is saved per rank rather than resharded through DCP: a resume into the
    same layout is then bit-identical by construction, whatever the optimizer keeps (the fingerprint refuses
    any other layout). So are the MoE experts (plain tensors that differ by rank, which DCP would take for
    replicas and save once). A ``COMPLETE`` marker, written last by rank 0 after a barrier, makes a half-written
    checkpoint invisible to ``--resume``.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    path = os.path.join(root, f"step_{step:07d}")
    os.makedirs(path, exist_ok=True)
    _sync(opt)
    msd = get_model_state_dict(model)
    experts = {k: msd.pop(k) for k in expert_params(model)}
    with _quiet_single_process_dcp():
        dcp.save({"model": msd}, checkpoint_id=os.path.join(path, "model"), no_dist=world == 1)
    if experts:
        torch.save(experts, os.path.join(path, f"experts.rank{rank}.pt"))
    state = {"step": step, "fingerprint": fingerprint, "rng_cpu": torch.get_rng_state(), **extra}
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    torch.save(opt.state_dict(), os.path.join(path, f"optim.rank{rank}.pt"))
    torch.save(state, os.path.join(path, f"state.rank{rank}.pt"))
    if world > 1:
        dist.barrier()
    if rank == 0:
        with open(os.path.join(path, _CKPT_DONE), "w") as f:
            f.write(f"{step}\n")
    if world > 1:
        dist.barrier()


def _resume_state(args: argparse.Namespace, rank: int, fingerprint: dict) -> dict:
    """This rank's saved position (step, losses, RNG) of the latest complete checkpoint, checked against this
    run before any collective.

    Raises:
        _ConfigError: no complete checkpoint, one written by another model or layout, or nothing left to run.
    """
    root = args.checkpoint_dir
    found = _latest_checkpoint(root)
    if found is None:
        raise _ConfigError(f"--resume: no complete checkpoint under {root!r}; run without --resume first")
    step, path = found
    state_file = os.path.join(path, f"state.rank{rank}.pt")
    if not os.path.isfile(state_file):
        raise _ConfigError(
            f"--resume: {path} has no state for rank {rank}; resume with the world size it was saved with"
        )
    state = torch.load(state_file, weights_only=False)
    if state["fingerprint"] != fingerprint:
        diff = {k: (v, fingerprint.get(k)) for k, v in state["fingerprint"].items() if fingerprint.get(k) != v}
        raise _ConfigError(
            f"--resume: {path} was saved with other settings, (saved, now): {diff}; pass the flags it was saved with"
        )
    stop = args.stop_at if args.stop_at is not None else args.steps
    if step >= stop:
        raise _ConfigError(f"--resume: {path} is at step {step}, nothing left to run; raise --steps above {step}")
    state["path"] = path
    return state


def _load_checkpoint(state: dict, model: GPT, opt) -> None:
    """Load the model (DCP), this rank's optimizer state and RNG from the checkpoint ``state`` came from."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    path = state["path"]
    msd = {"model": get_model_state_dict(model)}
    rank = dist.get_rank() if dist.is_initialized() else 0
    names = list(expert_params(model))
    for k in names:
        del msd["model"][k]
    single = not dist.is_initialized() or dist.get_world_size() == 1
    with _quiet_single_process_dcp():
        dcp.load(msd, checkpoint_id=os.path.join(path, "model"), no_dist=single)
    if names:
        msd["model"].update(torch.load(os.path.join(path, f"experts.rank{rank}.pt"), weights_only=True))
    set_model_state_dict(model, msd["model"])
    opt.load_state_dict(torch.load(os.path.join(path, f"optim.rank{rank}.pt"), weights_only=False))
    torch.set_rng_state(state["rng_cpu"])
    if "rng_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["rng_cuda"])


# ----------------------------------------------------------------------------------------------------------
# the run


def _run(args: argparse.Namespace, rank: int, world: int, local_rank: int) -> dict:
    cfg = _check_args(args, world)
    data = _load_data(args)
    device = _device(args, local_rank)
    fingerprint = _fingerprint(args, cfg)
    resume_state = _resume_state(args, rank, fingerprint) if args.resume else None

    own_group = False
    if world > 1 and not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, timeout=datetime.timedelta(minutes=10))
        own_group = True
    try:
        return _train(args, cfg, data, device, rank, world, fingerprint, resume_state)
    finally:
        if own_group:
            dist.destroy_process_group()


def _train(args, cfg, data, device, rank, world, fingerprint, resume_state) -> dict:
    mesh = None
    g = 0
    remat_group = None
    torch.manual_seed(args.seed)
    model = GPT(cfg).to(device)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (args.remat, args.tp), mesh_dim_names=("remat", "tp"))
        g = mesh.get_coordinate()[0]
        remat_group = mesh["remat"].get_group() if args.remat > 1 else None
        parallelize(model, mesh)
    opt = _build_optimizer(args, model, mesh)
    if rank == 0 and not args.quiet:
        from .bench.common import matmul_gflops

        try:
            cores = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cores = os.cpu_count() or 1
        overlap = bool(getattr(getattr(opt, "config", None), "overlap", False))
        ranks_here = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        for note in hardware_notes(ranks_here, cores, device.type == "cuda", overlap, matmul_gflops()):
            print(f"{_PROG}: warning: {note}", file=sys.stderr, flush=True)
    try:
        if resume_state is not None:
            _load_checkpoint(resume_state, model, opt)
        return _loop(args, cfg, data, device, rank, world, fingerprint, resume_state, model, opt, g, remat_group)
    finally:
        _close(opt)


def _loop(args, cfg, data, device, rank, world, fingerprint, resume_state, model, opt, g, remat_group) -> dict:
    from tqdm import tqdm

    log = rank == 0 and not args.quiet
    verifier = _Verifier(model, opt, args) if args.verify else None
    start, losses, val_hist = 0, [], []
    if resume_state is not None:
        start, losses, val_hist = resume_state["step"], list(resume_state["losses"]), list(resume_state["val_history"])
    stop = args.stop_at if args.stop_at is not None else args.steps

    unigram = data.unigram_entropy_bits()
    n_params = sum(p.numel() for p in model.parameters())
    if log:
        lrs = f"adamw-lr {args.adamw_lr:g}"
        if args.optimizer != "adamw":
            lrs = f"lr {args.lr:g}, {lrs}"
        print(
            f"{_PROG}: {data.source}: {data.train.numel()} train / {data.val.numel()} val bytes, unigram entropy "
            f"{unigram:.3f} bits/byte | model {n_params / 1e6:.2f} M params {_cfg_dict(cfg)} | world {world} = remat "
            f"{args.remat} x tp {args.tp} on {device.type} | {args.optimizer} {lrs}",
            flush=True,
        )
        if cfg.moe_experts:
            e, w = cfg.moe_experts, world
            print(
                f"{_PROG}: MoE in blocks {cfg.moe_layers()}: {e} experts of width {cfg.expert_hidden}, top "
                f"{cfg.moe_top_k}, {e // w} per rank (EP {w}, ETP 1), load-balancing loss x {args.moe_aux_loss:g}",
                flush=True,
            )
        describe = getattr(getattr(opt, "config", None), "describe", None)
        if describe is not None:
            print(f"{_PROG}: {describe()}", flush=True)

    mb = args.batch // (args.remat * args.grad_accum)
    tokens_per_step = args.batch * args.seq_len
    aux_coef = args.moe_aux_loss if cfg.moe_experts else 0.0
    prof = _profiler(args, rank, device) if args.profile else None
    bar = tqdm(total=stop, initial=start, disable=not log, dynamic_ncols=True, desc="train", file=sys.stderr)
    train_time, eval_time = 0.0, 0.0
    model.train()
    t_step = time.perf_counter()
    for step in range(start, stop):
        _set_lr(opt, step, args)
        x_all, y_all = data.train_batch(step, args.seed, args.batch, args.seq_len)
        loss_sum = torch.zeros(1, dtype=torch.float64, device=device)  # on device: NCCL reduces device tensors
        for k in range(args.grad_accum):
            rows = slice((g * args.grad_accum + k) * mb, (g * args.grad_accum + k + 1) * mb)
            x, y = x_all[rows].to(device), y_all[rows].to(device)
            last = k == args.grad_accum - 1
            if args.remat > 1 and args.grad_accum > 1:
                model.set_requires_gradient_sync(last)
            with torch.profiler.record_function("## forward ##"):
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                objective = loss + aux_coef * model.moe_aux_loss() if aux_coef else loss
            with torch.profiler.record_function("## backward ##"), _accumulating(opt, not last):
                (objective / args.grad_accum if args.grad_accum > 1 else objective).backward()
            loss_sum += loss.detach().double()
        with torch.profiler.record_function("## optimizer ##"):
            if args.max_grad_norm is not None and args.optimizer != "overlap_muon":
                from overlap_muon.clip import clip_grads_by_total_norm_

                clip_grads_by_total_norm_([p.grad for p in model.parameters() if p.grad is not None],
                                          args.max_grad_norm)
            if verifier is not None:
                verifier.before_step(opt)
            opt.step()
            if verifier is not None:
                verifier.after_step()
            opt.zero_grad()
        if remat_group is not None:
            dist.all_reduce(loss_sum, group=remat_group)
        loss_val = float(loss_sum) / (args.remat * args.grad_accum)
        losses.append(loss_val)
        if prof is not None:
            prof.step()
        # float(loss_sum) above waited for the default stream only: a device-wide synchronize here would
        # also wait for the optimizer's side streams and so remove the overlap being measured.
        now = time.perf_counter()
        train_time += now - t_step
        done = step + 1
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tokens_per_step * (done - start) / train_time:.0f}")
        if not math.isfinite(loss_val):
            raise FloatingPointError(f"training loss became {loss_val} at step {step}; lower --lr / --adamw-lr")
        if args.eval_every and done % args.eval_every == 0 and done != stop:
            t0 = time.perf_counter()
            v = _evaluate(model, data, args, g, remat_group, device)
            val_hist.append((done, v))
            if log:
                bar.write(f"step {done}: val loss {v:.4f} nats, {v / math.log(2):.4f} bits/byte")
            eval_time += time.perf_counter() - t0
        if args.checkpoint_dir and (
            done == stop or (args.checkpoint_every and done % args.checkpoint_every == 0)
        ):
            extra = {"losses": losses, "val_history": val_hist}
            _save_checkpoint(args.checkpoint_dir, done, model, opt, extra, rank, world, fingerprint)
        t_step = time.perf_counter()
    bar.close()
    if prof is not None:
        prof.stop()

    _sync(opt)
    val = _evaluate(model, data, args, g, remat_group, device)
    val_hist.append((stop, val))
    csum, chash = _checksum(model)
    steps_done = stop - start
    summary = {
        "step": stop,
        "val_loss": val,
        "val_bpb": val / math.log(2),
        "unigram_bpb": unigram,
        "below_unigram": 1.0 - (val / math.log(2)) / unigram,
        "steps_per_s": steps_done / train_time,
        "tokens_per_s": tokens_per_step * steps_done / train_time,
        "train_s": train_time,
        "eval_s": eval_time,
        "checksum_sum": csum,
        "checksum_hash": chash,
        "losses": losses,
        "val_history": val_hist,
        "optimizer": args.optimizer,
        "tp": args.tp,
        "remat": args.remat,
    }
    if verifier is not None:
        summary["verify_equal"] = verifier.first_bad is None
        if rank == 0:
            print(verifier.report(), flush=True)
    qk = getattr(opt, "qk_clipper", None)
    if qk is not None:
        summary["max_attn_logit"] = qk.peak_max_logit
        summary["qk_clipped_heads"] = opt.stats["qk_clipped_heads"]
    if rank == 0:
        if qk is not None:
            print(f"qk-clip: tau {args.qk_clip:g} | peak max attention logit {qk.peak_max_logit:.2f} | last "
                  f"{qk.last_max_logit:.2f} | head clips {opt.stats['qk_clipped_heads']}", flush=True)
        print(
            f"summary: step {stop} | val loss {val:.4f} nats = {summary['val_bpb']:.4f} bits/byte | unigram entropy "
            f"{unigram:.4f} bits/byte ({_below(summary['below_unigram'])}) | {summary['steps_per_s']:.2f} "
            f"steps/s, {summary['tokens_per_s']:.0f} tokens/s | checksum sum={csum:.10e} sha256={chash}",
            flush=True,
        )
    return summary


def _below(frac: float) -> str:
    return f"{100 * frac:.1f}% below" if frac >= 0 else f"{-100 * frac:.1f}% above"


def _profiler(args, rank, device):
    """A ``torch.profiler.profile`` over steps ``[skip, skip + active)`` that writes ``<dir>/rank<r>.json``."""
    from torch.profiler import ProfilerActivity, profile, schedule

    skip, active = args.profile_steps
    stop = args.stop_at if args.stop_at is not None else args.steps
    active = max(1, min(active, stop - skip))  # the trace holds only steps that run
    os.makedirs(args.profile_dir, exist_ok=True)
    out = os.path.join(args.profile_dir, f"rank{rank}.json")

    def on_ready(p) -> None:
        p.export_chrome_trace(out)
        if rank == 0 and not args.quiet:
            print(f"{_PROG}: profiler trace of steps [{skip}, {skip + active}) in {out} (one per rank)", flush=True)

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # The optimizer's ranges are emitted on its lane worker threads; the profiler records only the threads
    # that start it unless asked for all of them.
    try:
        extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(profile_all_threads=True)}
    except (AttributeError, TypeError):
        extra = {}
    prof = profile(
        activities=acts,
        schedule=schedule(wait=max(0, skip - 1), warmup=min(1, skip), active=max(1, active), repeat=1),
        on_trace_ready=on_ready,
        record_shapes=False,
        **extra,
    )
    prof.start()
    return prof


def main(argv: list[str] | None = None) -> dict:
    """Run training with command-line ``argv`` (default ``sys.argv[1:]``); return the summary figures.

    Returns:
        ``{"val_loss" (nats/byte), "val_bpb", "unigram_bpb", "below_unigram" (fraction), "steps_per_s",
        "tokens_per_s", "train_s", "eval_s" (seconds), "checksum_sum", "checksum_hash", "losses" (per step,
        global batch mean, nats), "val_history" ([(step, nats)]), "step", "optimizer", "tp", "remat"}`` on
        every rank.

    Raises:
        SystemExit(2): a flag or input is unusable; a one-line ``error:`` saying what to change was printed
            on every rank (before any collective).
    """
    args = build_parser().parse_args(argv)
    rank, world, local_rank = _world()
    try:
        return _run(args, rank, world, local_rank)
    except _ConfigError as e:
        prefix = f"[rank {rank}] " if world > 1 else ""
        print(f"{prefix}{_PROG}: error: {e}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


def cli() -> int:
    """Console-script entry: :func:`main` with ``sys.argv``, exit status 0 (the figures are printed)."""
    main()
    return 0


if __name__ == "__main__":
    cli()
