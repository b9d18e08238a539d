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
[Note: MoE dispatch] in :mod:`overlap_muon.apps.moe`). ``overlap_muon`` orthogonalizes each expert's matrices on
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
``summary:`` line; :func:`main` returns the same figures as a dict. The flags are in ``train_args.py``, the
checkpoints in ``train_state.py``, ``--verify`` and the figures it prints in ``train_verify.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import math
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from overlap_muon.apps.data import ByteData
from overlap_muon.apps.model import GPT, parallelize
from overlap_muon.apps.train_args import (
    _EXPERTS,
    _PROG,
    _ConfigError,
    _adamw_kwargs,
    _check_args,
    _device,
    _load_data,
    _muon_kwargs,
    _world,
    build_parser,
)
from overlap_muon.apps.train_state import (
    _cfg_dict,
    _fingerprint,
    _load_checkpoint,
    _resume_state,
    _save_checkpoint,
    _sync,
)
from overlap_muon.apps.train_verify import _TorchMuonPair, _Verifier, _checksum, _evaluate

__all__ = ["main", "cli", "build_parser"]


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
                from overlap_muon._clip import clip_grads_by_total_norm_

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
