"""The training job's checkpoints (``torch.distributed.checkpoint``): save, find the latest, resume."""

from __future__ import annotations

import argparse
import contextlib
import os
import warnings
from dataclasses import asdict

import torch
import torch.distributed as dist

from overlap_muon.apps.model import GPT, ModelConfig, expert_params
from overlap_muon.apps.train_args import _ConfigError

_CKPT_DONE = "COMPLETE"


def _sync(opt) -> None:
    """Wait for every pending optimizer update (``OverlapMuon`` applies Muon updates asynchronously)."""
    fn = getattr(opt, "synchronize", None)
    if fn is not None:
        fn()


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
