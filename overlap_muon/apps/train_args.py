"""The training job's flags and their checks (``overlap_muon.apps.train``): the parser, the model config the flags
ask for, the data, the device and the optimizers' keyword arguments."""

from __future__ import annotations

import argparse
import os
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap_muon.apps.data import ByteData, DataError, load_file, load_stdlib
from overlap_muon.apps.model import ModelConfig

_PROG = "overlap-muon-train"
_OPTIMIZERS = ("overlap_muon", "adamw", "torch_muon")
_MOE_EXPERTS = 4  # --moe without --moe-experts
_EXPERTS = "*.experts.*"  # the grouped expert weights' names (``model.expert_params``), for OverlapMuon
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
        description="Train a small tensor-parallel GPT on byte-level text (the Python standard library's sources by "
                    "default): torchrun --standalone --nproc-per-node N -m overlap_muon.apps.train",
        epilog="--optimizer overlap_muon reads its toggles from OVERLAP_MUON_* environment variables: the README's "
               "table, and docs/toggles.md in full.",
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
        # over EP, which overlap_muon._clip (DTensors reduced, plain tensors taken as replicas) does not do yet.
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
