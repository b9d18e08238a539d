"""The wave pipeline: one Muon wave's trip from its gradients to its applied update, and nothing else.

[Note: one matrix from hook to forward wait] Read this file top to bottom to follow a matrix ``W`` (full shape
``(P, Q)``, this rank's shard ``w``) through one step:

1. Backward accumulates ``w.grad``; the grad-ready hook (``hooks.GradReadyTracker``) tells the optimizer, whose
   :class:`scheduler.WaveDispatcher` calls :meth:`WavePipeline.launch` for ``W``'s wave ``k`` once every matrix of
   the wave is ready (strictly in wave order on every rank: docs/design.md, invariant 2).
2. ``launch`` builds a :class:`WaveState` (the gradients it reads, their version counters and the
   hyper-parameters it uses) and queues three lane tasks (``overlap_muon.lanes``):
   ``to_home`` (agree on gradient presence; new momentum out of place, Nesterov, bf16 cast; ``all_to_all`` to
   the NS homes), ``compute`` (batched NS on this rank's homes) and ``from_home`` (``all_to_all`` back: this
   rank's block of every ``O``). A replicated matrix (the whole ``W`` on every rank, [Note: replicated params] in
   ``domain.py``) skips both exchanges: every rank runs its NS in ``compute``. Nothing the user can see changes:
   the wave is *speculative*.
3. ``step()`` calls :meth:`WavePipeline.commit`: a wave whose gradients were edited in place since launch
   (clipping, unscaling, DDP averaging: the tensors' ``_version`` counters moved), whose set of gradients
   changed, or whose momentum/NS hyper-parameters changed is *stale*; the ranks agree on the stale set and on
   gradient presence (one small all_to_all of host flags on the runtime's gloo group) and re-launch those waves
   with the current values. Then one ``apply`` task per wave, on the ``from_home`` lane, after every wave's
   scatter (a step applies whole or not at all), commits the new momentum (recomputed in place, the same op) and
   applies weight decay and the update with the ``lr`` and ``weight_decay`` read at that ``step()`` call, each element
   rounded as ``torch.optim.Muon``'s ``add_`` rounds it in the full matrix ([Note: the apply follows torch's
   kernel path] in ``muon_math.py``).
4. The next forward's pre-hook for ``W``'s module calls :meth:`WavePipeline.wait` (``[k]``): CPU: the host waits
   for the apply task; CUDA: the current stream (and FSDP2's all-gather streams) wait on its event. Then the
   wave's state is released (:meth:`WavePipeline.reap`).

[Note: release on time] (docs/design.md, invariant 9) A :class:`WaveState` names every tensor the wave holds. On CPU
each task drops what the next one no longer needs (the full matrices after NS, the NS results and packed
momenta after the scatter, the gradients and update blocks after the apply), and the state leaves
the pipeline at the first wait or reap after its apply. On CUDA a tensor read on another stream than the one
that allocated it must live until that stream is done with it (invariant 5, no ``record_stream``), so the state
keeps all of them until its apply event has completed (``event.query()``, never a host sync) and is released
then. Nothing is held into the next step.

[Note: gradient presence without the device] A param without a gradient is skipped (as ``torch.optim.Muon``
does), so which params take part is decided per rank, and ranks that disagree would post mismatched exchanges.
Each wave's ``to_home`` task first exchanges one byte per matrix with every peer on the domain's *gloo* group
(``Domain.ctrl_group``), built from ``param.grad is None`` on the host: no device tensor is read or made, so on
CUDA the launch never waits for the GPU. It runs on the lane (a worker thread on CPU); on CUDA, where lane work
is enqueued from the launching thread, it waits for the peers' hosts only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .scheduler.kinds import WavePlan
from .scheduler.waves import Wave

from .config import OverlapMuonConfig
from .comm import DPSlots
from .domain import Domain, MuonParam, local_tensor
from .lanes import LaneHandle, Lanes
from .exchanges import DPShared, Exchange, ExchangeContext, Gathered, Leg, Local, Routed, Team
from .muon_math import apply_update, momentum_update, momentum_update_, ns_input
from .ns import zeropower
from .profiling import prof_range, wave_range_name
from .team_ns import team_norms, team_zeropower_blocks

__all__ = ["WavePipeline", "WaveState", "Hyper"]


@dataclass(frozen=True)
class Hyper:
    """The hyper-parameters a wave's NS input depends on; a wave launched with other values is stale at commit.

    ``lr`` and ``weight_decay`` are not here: they enter only the apply, which reads them at ``step()``.
    """

    momentum: float
    nesterov: bool
    ns_coefficients: Any
    ns_steps: int
    eps: float

    @staticmethod
    def of(group: dict[str, Any]) -> "Hyper":
        return Hyper(group["momentum"], group["nesterov"], group["ns_coefficients"], group["ns_steps"], group["eps"])


@dataclass(eq=False)
class WaveState:
    """Everything one launched wave holds, and the lane handles that say when it may be released.

    Tensor fields are written by the task named beside them and set to ``None`` when released ([Note: release
    on time]). Shapes: "shard" is this rank's block of a param (its local tensor), "(P, Q)" a full matrix.
    """

    wave: Wave
    items: list[int]
    """Param indices of the wave that have a gradient on this rank, in wave order."""
    hyper: Hyper
    grads: list[Tensor] | None
    """The gradients read, as ``param.grad`` holds them (DTensor or shard; set by ``launch``; read again by the
    apply, which recomputes the new momentum in place; released after it)."""
    versions: list[tuple[int, int]]
    """Version counters of each gradient and of its local shard at launch; ``commit`` compares them."""
    packed: list[Tensor | None] | None = None
    """Shards, bf16: the NS inputs (``pack``; released after ``from_home``)."""
    legs: list[Leg] | None = None
    """One per exchange the wave uses (``overlap_muon.exchanges``): the exchanged params, then the replicated ones;
    each holds its matrices, results and route (``pack``; released after ``from_home``)."""
    updates: list[Tensor] | None = None
    """Shards, bf16: this rank's block of each NS result (``from_home``; released after the apply)."""
    momenta: list[Tensor] | None = None
    """Shards: the new momentum of each item (``to_home``, only with ``async_step``, whose apply runs after
    ``step()`` returns and so must not read ``.grad``; released after the apply)."""
    empty: bool = False
    """No rank of the domain has a gradient for this wave (``to_home``): nothing to apply."""
    # Handles. On CUDA each carries an event recorded by its lane after its kernels. Who waits on it:
    # h_pack -- the gather (h_to), and async_step's step(), which returns once every gradient has been read;
    # h_to -- the compute lane (h_ns's dependency); h_ns -- the from_home lane; h_from -- the apply task;
    # h_apply -- forward pre-hooks (current stream, FSDP2's all-gather streams), synchronize(), reap().
    h_pack: LaneHandle | None = None
    h_to: LaneHandle | None = None
    h_ns: LaneHandle | None = None
    h_from: LaneHandle | None = None
    h_apply: LaneHandle | None = None
    committed: bool = False
    momentum_done: bool = False
    """A synchronous step's wave: its pack committed the new momentum in place (``launch(committed=True)``)."""

    def handles(self) -> list[LaneHandle]:
        return [h for h in (self.h_pack, self.h_to, self.h_ns, self.h_from, self.h_apply) if h is not None]

    def done(self) -> bool:
        """Every queued task has finished (CPU: host side; CUDA: its event has completed). Never blocks."""
        return all(h.done() for h in self.handles())

    def release(self) -> None:
        """Drop every tensor the wave holds."""
        self.grads = self.packed = self.legs = self.updates = self.momenta = None


class WavePipeline:
    """Owns the lanes, the runtime's domains and process groups, the route plans and one state per wave.

    Args:
        muon: the Muon params (index ``i`` is ``muon[i].index``).
        state: the optimizer's ``state`` dict (``state[param]["momentum_buffer"]``).
        dom_to, dom_from: this rank's domain with the group sets of the gather and the scatter lanes ([Note: one
            process-group set per communicating lane] in ``lanes.py``).
        config: the runtime options.
        device: where the Muon params live.
        stats: the optimizer's counters (``ns_matrices``, ``ns_calls``, ``waves_launched``, ``reruns``).
        ctrl_group: a gloo group over every rank of the job for ``commit``'s agreement (``None``: one process).
        dp_slots: the data-parallel replicas of the dense domain share its NS work ([Note: DP replicas as NS
            slots]); ``None``: each replica runs all of it.
        team_group: a group over this rank's dense domain for team NS (``surplus="team"``), used by the compute
            lane only.
        expert_doms: ``(dom_to, dom_from, ctrl_group)`` of this rank's expert domain, the routes of the waves with
            ``wave.domain == 1`` ([Note: two domains] in ``discovery.py``); ``ctrl_group`` is a gloo group over that
            domain for ``commit``'s agreement on expert gradients. ``None``: expert matrices (if any) are this
            rank's own, NS'd where they live.
    """

    def __init__(
        self,
        muon: Sequence[MuonParam],
        state: dict,
        dom_to: Domain,
        dom_from: Domain,
        config: OverlapMuonConfig,
        device: torch.device,
        stats: dict[str, int],
        ctrl_group: dist.ProcessGroup | None,
        expert_doms: tuple[Domain, Domain, dist.ProcessGroup | None] | None = None,
        dp_slots: DPSlots | None = None,
        team_group: dist.ProcessGroup | None = None,
    ) -> None:
        self.muon = list(muon)
        self.state = state
        self.dom_to, self.dom_from = dom_to, dom_from
        single = Domain.single()
        self._doms = [(dom_to, dom_from), expert_doms[:2] if expert_doms else (single, single)]
        self._expert_ctrl = expert_doms[2] if expert_doms else None
        self.dp = dp_slots
        self.team_group = team_group
        self.config = config
        self.stats = stats
        self.ctrl_group = ctrl_group
        # A synchronous step of one wave has nothing to pipeline: its lanes run inline (no thread hand-offs).
        one_wave = not config.overlap and config.wave_slots is None
        self.lanes = Lanes(device, side_streams=config.side_streams and not one_wave, )
        # On CPU (and inline) a task may drop what the next no longer needs; on CUDA only whole states are
        # released, after their last event ([Note: release on time]).
        self._eager_release = not self.lanes.cuda
        self._route_plans: dict[Any, dict] = {}
        self.exchanges: dict[int, tuple[Exchange, Exchange]] = {}
        """Per wave index: its exchange and the ``local`` one of its replicated params, built from the frozen wave
        plans (:meth:`set_plans`)."""
        self._ctx = ExchangeContext(config.fused_a2a, self._route_plans, self._run)
        self.keep_momentum = False
        """``async_step``: a wave keeps its new momentum from ``to_home`` to its apply, which then copies it instead
        of recomputing it from the gradient (the apply runs after ``step()`` returns)."""
        self.adamw_params: list[Tensor] = []
        """The AdamW params, whose gradient presence the step's agreement also carries ([Note: lazy state])."""
        self._adamw_elsewhere: set[int] = set()
        self._pending: dict[int, WaveState] = {}  # launched, not yet committed, by wave index
        self._agreed = False  # this (synchronous) step's gradient presence is agreed: waves skip their checks
        self._applied: dict[int, WaveState] = {}  # committed, apply not yet waited for
        self._orphans: list[WaveState] = []  # discarded while tasks were still queued (their exchanges run on)
        self._lock = threading.RLock()

    # --------------------------------------------------------------------------------------------------------
    # launch: three lane tasks, speculative
    # --------------------------------------------------------------------------------------------------------
    def launch(self, wave: Wave, hyper: Hyper, committed: bool = False) -> WaveState:
        """Queue wave ``wave``'s exchange to the homes, NS and exchange back, with the gradients present now.

        Called in wave order on every rank (from a grad-ready hook, the end-of-backward flush or ``step()``).
        Changes no param and no optimizer state, unless ``committed``: a synchronous step's wave, launched inside
        ``step()`` after the step's gradient-presence agreement, which nothing can make stale; its pack commits the
        new momentum in place, as ``torch.optim.Muon`` does, instead of computing it out of place for the NS input
        and again in the apply.
        """
        items = [i for i in wave.params if self.muon[i].param.grad is not None]
        grads = [self.muon[i].param.grad for i in items]
        st = WaveState(wave, items, hyper, grads, [_versions(g) for g in grads], momentum_done=committed)
        if committed:
            self._create_momentum(items)
        self.stats["waves_launched"] += 1
        check = (self.config.check_grad_presence and not self._agreed
                 and self._doms[wave.domain][0].ctrl_group is not None)
        if not items and not check:
            st.empty = True
        else:
            # The momentum buffers this wave reads must hold the previous step's committed values: wait for the
            # applies (on the from_home lane) of earlier waves that still write them.
            with self._lock:
                writers = [a.h_apply for a in self._applied.values()
                           if a.h_apply is not None and not a.h_apply.done() and set(a.items) & set(items)]
            st.h_pack = self.lanes.submit("to_home", lambda: self._pack_task(st, check), deps=writers)
            st.h_to = self.lanes.submit("to_home", lambda: self._to_home_task(st), deps=[st.h_pack])
            st.h_ns = self.lanes.submit("compute", lambda: self._ns_task(st), deps=[st.h_to])
            st.h_from = self.lanes.submit("from_home", lambda: self._from_home_task(st), deps=[st.h_ns])
        with self._lock:
            old = self._pending.pop(wave.index, None)
            if old is not None:
                self._orphan(old)
            self._pending[wave.index] = st
        return st

    def _pack_task(self, st: WaveState, check: bool) -> None:
        """The wave's only reads of ``.grad``: new momentum, Nesterov, bf16 cast; then its legs (one per exchange)."""
        k, dom = st.wave.index, self._doms[st.wave.domain][0]
        if check:
            self._run(k, st.items, "a2a_to_home", dom, lambda: self._agree_on_gradients(st), "all_to_all")
        if not st.items:
            st.empty = True
            return
        mps = [self.muon[i] for i in st.items]
        main, local = self.exchanges[k]
        with prof_range(wave_range_name(k, "pack"), nvtx=self.config.nvtx):
            st.packed = self._pack(st, mps, [not m.replicated and not main.needs_input(m) for m in mps])
        ex = [j for j, m in enumerate(mps) if not m.replicated]
        rep = [j for j, m in enumerate(mps) if m.replicated]  # [Note: replicated params] in domain.py
        st.legs = [Leg(e, pos, [mps[j] for j in pos], [st.packed[j] for j in pos])
                   for e, pos in ((main, ex), (local, rep)) if pos]

    def _pack(self, st: WaveState, mps: list[MuonParam], skip: list[bool]) -> list[Tensor | None]:
        """The NS input of each item (bf16 shards; ``None`` where ``skip``: another replica computes it)."""
        h = st.hyper
        grads = [m.local(g) for m, g in zip(mps, st.grads)]
        if st.momentum_done:  # a synchronous step: commit in place (torch's own op), no copy
            news = [m.local(self.state[m.param]["momentum_buffer"]) for m in mps]
            for b, g in zip(news, grads):
                momentum_update_(b, g, h.momentum)
        else:
            # The new momentum lives only as long as the NS input needs it; the apply recomputes it in place
            # (the same op on the same values: bitwise the same), so a speculative wave holds no momentum copy,
            # unless the apply runs after step() returns (async_step): then it keeps it.
            news = [momentum_update(self._momentum(m, g), g, h.momentum) for m, g in zip(mps, grads)]
            st.momenta = news if self.keep_momentum else None
        return [None if s else ns_input(g, n, h.momentum, h.nesterov) for s, n, g in zip(skip, news, grads)]

    def _to_home_task(self, st: WaveState) -> None:
        """To the ranks that orthogonalize each matrix (every leg: one exchange each)."""
        if st.empty:
            return
        with prof_range(wave_range_name(st.wave.index, "a2a_to_home"), nvtx=self.config.nvtx):
            for leg in st.legs:
                leg.exchange.to_compute(leg)

    def _momentum(self, m: MuonParam, grad: Tensor) -> Tensor:
        """``m``'s committed momentum (local shard), or zeros before its first step ([Note: lazy state] in
        ``state.py``; read without inserting a key: the state dict is the user's until ``step()``)."""
        st = self.state.get(m.param)
        buf = st.get("momentum_buffer") if st else None
        return m.local(buf) if buf is not None else torch.zeros_like(grad, memory_format=torch.preserve_format)

    def _ns_task(self, st: WaveState) -> None:
        """Newton-Schulz on what this rank orthogonalizes (each leg with its kind's NS)."""
        if st.empty:
            return
        h = st.hyper
        kw = dict(ns_coefficients=h.ns_coefficients, ns_steps=h.ns_steps, eps=h.eps, syrk=self.config.syrk)
        with prof_range(wave_range_name(st.wave.index, "ns"), nvtx=self.config.nvtx):
            for leg in st.legs:
                leg.outs = leg.exchange.orthogonalize(leg, getattr(self, _NS[leg.exchange.ns_kind]), kw)
                if self._eager_release:
                    leg.mats = None

    def _from_home_task(self, st: WaveState) -> None:
        """Back to storage: this rank's block of every result, in ``items`` order."""
        if st.empty:
            return
        by_position: dict[int, Tensor] = {}
        with prof_range(wave_range_name(st.wave.index, "a2a_from_home"), nvtx=self.config.nvtx):
            for leg in st.legs:
                by_position.update(zip(leg.positions, leg.exchange.back_to_storage(leg)))
        st.updates = [by_position[j] for j in range(len(st.items))]
        if self._eager_release:
            st.packed = st.legs = None

    def _apply_task(self, st: WaveState, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None) -> None:
        if not st.empty:
            with prof_range(wave_range_name(st.wave.index, "apply"), nvtx=self.config.nvtx):
                for j, i in enumerate(st.items):
                    m = self.muon[i]
                    buf = m.local(self.state[m.param]["momentum_buffer"])
                    if st.momenta is not None:
                        buf.copy_(st.momenta[j])
                    elif not st.momentum_done:
                        momentum_update_(buf, m.local(st.grads[j]), st.hyper.momentum)
                    p, u = m.local(m.param), st.updates[j]
                    if m.transposed:  # apply to the (out, in) matrix torch's nn.Linear reference updates
                        p, u = p.T, u.T
                    for a, b, shape, region in m.runs:  # one run unless the matrix is split (overlap_muon.split)
                        whole = a == 0 and b == p.size(0)
                        apply_update(p if whole else p[a:b], u if whole else u[a:b], lr, weight_decay,
                                     adjust_lr_fn, shape, region)
        if self._eager_release:
            st.release()

    def _team_ns(self, work: list[tuple[list[Tensor], list[MuonParam], list[bool]]], kw: dict[str, Any]
                 ) -> list[Tensor]:
        """[Note: team NS by columns] The wave's team blocks (``(P, Q)`` layout, ``team_block``) of its exchanged
        matrices: one norm all-reduce, then NS of all of them in lockstep, one Gram all-reduce per step. Collective
        over ``team_group``, in the same order on every rank. ``work`` is ``[(blocks, params, split_poly)]`` (one
        entry, so that a wrapper sees one call; ``split_poly`` per matrix, from the wave's plan)."""
        ((blocks, mps, split),) = work
        self.stats["ns_matrices"] += len(blocks)
        self.stats["ns_calls"] += len(blocks)
        tall = [m.full_shape[0] > m.full_shape[1] for m in mps]
        xs = [b.mT if t else b for b, t in zip(blocks, tall)]  # oriented: columns of X (rows of a tall update)
        outs = team_zeropower_blocks(xs, team_norms(xs, self.team_group), self.team_group, split_poly=split, **kw)
        return [o.mT.contiguous() if t else o for o, t in zip(outs, tall)]

    def _ns_many(self, mats: list[Tensor], kw: dict[str, Any]) -> list[Tensor]:
        """NS of each matrix; same-shape matrices batched (no flattening across matrices)."""
        self.stats["ns_matrices"] += len(mats)
        if not self.config.batch_ns:
            self.stats["ns_calls"] += len(mats)
            return [zeropower(m, **kw) for m in mats]
        by_shape: dict[tuple[int, ...], list[int]] = {}
        for j, m in enumerate(mats):
            by_shape.setdefault(tuple(m.shape), []).append(j)
        out: list[Tensor | None] = [None] * len(mats)
        for js in by_shape.values():
            self.stats["ns_calls"] += 1
            if len(js) == 1:
                out[js[0]] = zeropower(mats[js[0]], **kw)
            else:
                res = zeropower(torch.stack([mats[j] for j in js]), **kw)
                for r, j in enumerate(js):
                    out[j] = res[r]
        return out  # type: ignore[return-value]

    def _agree_on_gradients(self, st: WaveState) -> None:
        """Raise on every rank of the domain if its ranks disagree on which params of the wave have a gradient.

        Host-side only ([Note: gradient presence without the device]): CPU uint8 flags, one ``all_to_all`` on the
        domain's gloo group (every rank hears from every peer directly, so a dead peer shows at once).

        Raises:
            ValueError: some params have a gradient on some ranks of the domain and not on others.
        """
        dom, params = self._doms[st.wave.domain][0], st.wave.params
        n = dist.get_world_size(dom.ctrl_group)  # the domain, or (DP slots) every replica of it
        have = torch.tensor([1 if i in st.items else 0 for i in params], dtype=torch.uint8)
        everyone = torch.empty(n * have.numel(), dtype=torch.uint8)
        dist.all_to_all_single(everyone, have.repeat(n), group=dom.ctrl_group)
        table = everyone.view(n, -1)
        agree = (table == table[0]).all(dim=0).tolist()
        split = [self.muon[i].name for i, ok in zip(params, agree) if not ok]
        if split:
            raise ValueError(
                f"Muon params {split} have a gradient on some ranks of the {dom.remat_size}x{dom.tp_size} domain "
                f"and not on others (this rank: {[self.muon[i].name for i in st.items if self.muon[i].name in split]} "
                "have one); every rank of a domain must compute the same params' gradients"
            )

    def _run(self, wave: int, params: list[int], phase: str, dom: Domain, fn: Callable[[], Any], op: str) -> Any:
        """Run a collective; name the wave, the exchange, the group and the params in any error it raises."""
        try:
            return fn()
        except ValueError:
            raise  # bad input, already named (raised on every rank before the collective)
        except Exception as e:
            fused = self.config.fused_a2a
            if fused or op == "all_gather":
                g, what = dom.flat_group, "flat R x T group"
            else:
                g, what = dom.remat_group or dom.tp_group, "remat/TP groups"
            ranks = dist.get_process_group_ranks(g) if g is not None else [dist.get_rank()]
            raise RuntimeError(
                f"OverlapMuon wave {wave} {phase} failed on rank {dist.get_rank()} ({'fused' if fused else 'two-stage'} "
                f"{op} over the runtime's {what} {dom.remat_size}x{dom.tp_size}, global ranks {ranks}; params "
                f"{[self.muon[i].name for i in params]}): {e}"
            ) from e

    # --------------------------------------------------------------------------------------------------------
    # commit: only step() changes params and state
    # --------------------------------------------------------------------------------------------------------
    def stale(self, st: WaveState, hyper: Hyper) -> bool:
        """Would the wave compute something else if launched now? (host-side checks only)."""
        if st.hyper != hyper:
            return True
        items = [i for i in st.wave.params if self.muon[i].param.grad is not None]
        if items != st.items:
            return True
        for j, i in enumerate(items):
            g = self.muon[i].param.grad
            if g is not st.grads[j] or _versions(g) != st.versions[j]:
                return True
        return False

    def commit(self, waves: Sequence[Wave], group: dict[str, Any], *, validate: bool, skip: bool) -> int:
        """Validate the launched waves, re-run the stale ones, and queue every wave's apply with ``group``'s values.

        Args:
            waves: the plan (every wave has been launched this step).
            group: the Muon param group now (``lr``, ``weight_decay``, ``adjust_lr_fn`` read here).
            validate: check for stale waves (``False`` when the waves were launched inside this ``step()``).
            skip: drop the step (``skip_nonfinite``): nothing is applied, momentum stays as it was.

        Returns:
            The number of waves re-run.
        """
        with self._lock:
            pending = dict(self._pending)
        if skip:
            self._agreed = False
            self.discard()
            return 0
        reruns = 0
        hyper = Hyper.of(group)
        # A wave not pending was discarded after backward launched it (load_state_dict): launch it again.
        stale = [1 if w.index not in pending or validate and self.stale(pending[w.index], hyper) else 0 for w in waves]
        if self.ctrl_group is not None and not self._agreed:
            stale = self._agree_step(stale, pending)
        self._agreed = False
        self._create_momentum(range(len(self.muon)))
        for w, f in zip(waves, stale):
            if f:
                pending[w.index] = self.launch(w, hyper)
                reruns += 1
        self.stats["reruns"] += reruns
        lr = group["lr"]
        lr = lr.clone() if isinstance(lr, Tensor) else lr  # a scheduler may fill it before the apply runs
        wd, adj = group["weight_decay"], group["adjust_lr_fn"]
        # Every apply waits for every wave's scatter: a wave that failed (a dead peer, bad input found on a lane)
        # fails them all, so a step is applied whole or not at all. (The from_home lane is FIFO in wave order, so
        # this delays no apply: the last wave's, which the next forward needs first, ran last anyway.)
        scattered = [st.h_from for st in pending.values() if st.h_from is not None]
        with self._lock:
            for k in sorted(pending):
                st = pending[k]
                deps = scattered
                st.h_apply = self.lanes.submit("from_home", lambda st=st: self._apply_task(st, lr, wd, adj), deps=deps)
                st.committed = True
                self._pending.pop(k, None)
                self._applied[k] = st
        return reruns

    def _create_momentum(self, indices: Iterable[int]) -> None:
        """[Note: lazy state] in ``state.py``: momentum at a param's first gradient, created on the calling thread
        (``step()``), before any task writes it."""
        for i in indices:
            m = self.muon[i]
            if m.param.grad is not None and "momentum_buffer" not in self.state.get(m.param, ()):
                self.state[m.param]["momentum_buffer"] = torch.zeros_like(m.param, memory_format=torch.preserve_format)

    def adamw_elsewhere(self) -> set[int]:
        """``id``s of the AdamW params that had a gradient on another rank and not on this one at the last step's
        agreement ([Note: lazy state] in ``state.py``); read once."""
        out, self._adamw_elsewhere = self._adamw_elsewhere, set()
        return out

    def agree_before_launch(self) -> None:
        """A synchronous step, before it launches its waves: the step's one agreement on gradient presence now, so
        the waves skip their per-wave checks ([Note: gradient presence without the device]) and ``commit`` skips
        its own (no wave is speculative, nothing can be stale): one host collective per step instead of one per
        wave plus one.

        Raises:
            ValueError: on every rank, as :meth:`commit` would (nothing is launched or applied).
        """
        if self.ctrl_group is not None:
            self._agree_step([], {})
            self._agreed = True

    def _agree_step(self, stale: list[int], pending: dict[int, WaveState]) -> list[int]:
        """One host-side all-reduce (gloo, no device tensor): which waves any rank finds stale (``stale``: this
        rank's flags), and whether the ranks agree on which params have a gradient: a mismatch is a ValueError on
        every rank here, before anything is applied (the per-wave check on the lane only keeps the exchanges from
        hanging). Expert matrices differ between EP ranks: their presence is agreed within the expert domain first
        (every rank, in that order), and a mismatch there travels in the job-wide flags as one more flag.

        Returns:
            The job-wide stale flags.
        """
        dense = [m for m in self.muon if m.domain == 0]
        experts = [m for m in self.muon if m.domain == 1]
        split = self._split_presence(experts, self._expert_ctrl, pending) if self._expert_ctrl else []
        have = [1 if m.param.grad is not None else 0 for m in dense]
        adamw = [1 if p.grad is not None else 0 for p in self.adamw_params]
        flags = torch.tensor(stale + have + [1 - h for h in have] + adamw + [1 if split else 0], dtype=torch.uint8)
        self._agree(flags, self.ctrl_group, pending)
        n, k, a = len(stale), len(have), len(adamw)
        split += [m.name for m, x, y in zip(dense, flags[n:n + k].tolist(), flags[n + k:n + 2 * k].tolist()) if x and y]
        anywhere = flags[n + 2 * k:n + 2 * k + a].tolist()
        self._adamw_elsewhere = {id(p) for p, mine, any_ in zip(self.adamw_params, adamw, anywhere) if any_ and not mine}
        if split or flags[-1]:
            self.discard()
            raise ValueError(
                f"OverlapMuon step(): Muon params {split[:8] or '(on another rank)'}{' ...' if len(split) > 8 else ''} "
                "have a gradient on some ranks and not on others; every rank holding a param (every rank of its "
                "domain, and of every replica of it) must compute its gradient. Nothing was applied."
            )
        return flags[:n].tolist()

    def _split_presence(self, mps: list[MuonParam], group: dist.ProcessGroup, pending: dict[int, WaveState]
                        ) -> list[str]:
        """Names of the params of ``mps`` that have a gradient on some ranks of ``group`` and not on others."""
        have = [1 if m.param.grad is not None else 0 for m in mps]
        flags = torch.tensor(have + [1 - h for h in have], dtype=torch.uint8)
        self._agree(flags, group, pending)
        k = len(have)
        return [m.name for m, a, b in zip(mps, flags[:k].tolist(), flags[k:].tolist()) if a and b]

    def _agree(self, flags: Tensor, group: dist.ProcessGroup, pending: dict[int, WaveState]) -> None:
        """The element-wise MAX of ``flags`` over every rank, in place (host tensors, gloo). A failure here (a dead or stalled
        peer) usually fails the pending waves' exchanges too: report the first of those, which names the wave and
        the exchange, else this one.

        Raises:
            RuntimeError: the agreement or a pending wave's exchange failed.
        """
        try:
            _max_everywhere(flags, group)
        except Exception as e:
            with self._lock:
                states = list(self._applied.values()) + sorted(pending.values(), key=lambda st: st.wave.index)
            for st in states:
                for h in st.handles():
                    _wait(h, ())  # raises the wave's own error, chained
            ranks = dist.get_process_group_ranks(group)
            raise RuntimeError(
                f"OverlapMuon step(): agreeing on which waves to re-run failed on rank {dist.get_rank()} (all_reduce "
                f"over the runtime's gloo control group, global ranks {ranks}): {e}"
            ) from e

    def discard(self) -> None:
        """Forget every uncommitted wave (``zero_grad()``, a new backward before ``step()``, a skipped step).

        Their queued exchanges still run (every rank queued them), their results are dropped.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            for st in pending.values():
                self._orphan(st)

    def _orphan(self, st: WaveState) -> None:
        if self._eager_release and st.done():
            st.release()
            return
        self._orphans.append(st)

    # --------------------------------------------------------------------------------------------------------
    # waits and release
    # --------------------------------------------------------------------------------------------------------
    def wait(self, waves: Iterable[int], streams: Sequence[Any] = ()) -> None:
        """Make the caller wait until the committed updates of ``waves`` have landed.

        CPU: the host waits for each apply task. CUDA: the current stream, and each of ``streams`` (e.g. FSDP2's
        all-gather copy-in stream), wait on the apply event; the host does not wait. Uncommitted waves change
        nothing, so there is nothing to wait for.

        Raises:
            RuntimeError: a lane task of the wave failed (its traceback is chained).
        """
        for k in waves:
            with self._lock:
                st = self._applied.get(k)
            if st is None:
                continue
            with prof_range(f"OverlapMuon::wait::wave{k}", nvtx=self.config.nvtx):
                _wait(st.h_apply, streams)
            if st.done():
                with self._lock:
                    if self._applied.get(k) is st:
                        del self._applied[k]
                st.release()

    def wait_gradients_read(self) -> None:
        """``async_step``, at the end of ``step()``: make the caller wait until every committed wave has read its
        gradients (its pack task), so that the user may zero, free or overwrite ``.grad`` once ``step()`` returns.
        CPU: the host waits (the exchanges and NS go on); CUDA: the current stream waits on the pack events.

        Raises:
            RuntimeError: a lane task of the wave failed (its traceback is chained).
        """
        with self._lock:
            packs = [st.h_pack for st in self._applied.values() if st.h_pack is not None]
        for h in packs:
            _wait(h, ())

    def reap(self) -> None:
        """Release every state whose tasks have all finished; surface a failed task now. Never blocks."""
        with self._lock:
            finished = [k for k, st in self._applied.items() if st.done()]
            states = [self._applied.pop(k) for k in finished]
            orphans = [st for st in self._orphans if st.done()]
            self._orphans = [st for st in self._orphans if not st.done()]
        for st in orphans:
            st.release()
        for st in states:
            for h in st.handles():
                _wait(h, ())
            st.release()

    def synchronize(self) -> None:
        """Block the host until every committed wave is applied and every orphaned task has finished.

        Raises:
            RuntimeError: a lane task failed; its original exception (and traceback) is chained.
        """
        with self._lock:
            states, self._applied = list(self._applied.values()), {}
            orphans, self._orphans = self._orphans, []
        error: BaseException | None = None
        for st in orphans + states:
            for h in st.handles():
                if h.event is not None:
                    h.event.synchronize()
                try:
                    _wait(h, ())
                except BaseException as e:  # noqa: BLE001 - every wave is waited for first, then raised
                    if error is None and st.committed:
                        error = e
            st.release()
        if error is not None:
            raise error

    def all_finite(self) -> bool:
        """True when every Muon gradient on every rank is finite (``skip_nonfinite``): device flags, one all-reduce
        of their max on the gloo control group. Reads one flag on the host: on CUDA a sync, once per step; the
        option is off by default."""
        grads = [m.local(m.param.grad) for m in self.muon if m.param.grad is not None]
        bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any() if grads else torch.tensor(False)
        flag = bad.to("cpu", torch.uint8).reshape(1)
        if self.ctrl_group is not None:
            _max_everywhere(flag, self.ctrl_group)
        return int(flag[0]) == 0

    def has_pending(self) -> bool:
        """Some wave has been launched this step and not committed."""
        with self._lock:
            return bool(self._pending)

    def set_plans(self, plans: Sequence[WavePlan]) -> None:
        """The wave plan changed (construction, or the observed readiness order): build each wave's exchange from
        its frozen plan; route plans are per (wave, params), so drop them."""
        self._route_plans.clear()
        self.exchanges = {p.wave.index: (self._exchange_of(p), Local(self._ctx, p.wave.index, *self._doms[p.wave.domain]))
                          for p in plans}

    def _exchange_of(self, p: WavePlan) -> Exchange:
        w, ctx, (dom_to, dom_from) = p.wave, self._ctx, self._doms[p.wave.domain]
        if p.kind == "gathered":
            return Gathered(ctx, w.index, dom_to, dom_from)
        if p.kind == "team":
            return Team(ctx, w.index, dom_to, dom_from, dict(p.split_poly))
        if p.kind == "dp_shared":
            D = p.dp_size
            inner = Routed(ctx, w.index, dom_to, dom_from, {i: h // D for i, h in w.homes.items()}, {})
            return DPShared(inner, self.dp, {i: h % D for i, h in w.homes.items()})
        return Routed(ctx, w.index, dom_to, dom_from, dict(w.homes), {i: (hs, sv) for i, hs, sv in p.dup})

    def close(self) -> None:
        """Stop the lane threads once their queued tasks are done (does not wait for them)."""
        self.lanes.shutdown(wait=False)


#: The runtime's NS function of each exchange's ``ns_kind`` (looked up on the instance at call time).
_NS = {"plain": "_ns_many", "team": "_team_ns"}


def _max_everywhere(flags: Tensor, group: dist.ProcessGroup) -> None:
    """``flags`` (a 1-D CPU tensor) becomes its element-wise MAX over the ranks of ``group`` (gloo), in place.

    An all_to_all rather than an all_reduce: every rank hears from every peer directly, so a dead peer is a reset
    connection at once, not the timeout of a live ring neighbour stuck behind it.
    """
    world = dist.get_world_size(group)
    everyone = torch.empty(world * flags.numel(), dtype=flags.dtype)
    dist.all_to_all_single(everyone, flags.repeat(world), group=group)
    flags.copy_(everyone.view(world, -1).amax(dim=0))


def _versions(grad: Tensor) -> tuple[int, int]:
    """Version counters of a gradient and of its local shard: an in-place op on a DTensor bumps the wrapper's
    only (the local op runs below autograd's version tracking), one on the local shard bumps the shard's."""
    return grad._version, local_tensor(grad)._version


def _wait(h: LaneHandle | None, streams: Sequence[Any]) -> None:
    if h is None:
        return
    try:
        h.wait_on_current_stream()
        if h.event is not None:
            for s in streams:
                s.wait_event(h.event)
    except ValueError as e:  # bad input found on the lane (gradient presence): raised on every rank, stays a ValueError
        raise ValueError(f"OverlapMuon: {e}") from e
    except BaseException as e:
        raise RuntimeError(
            f"OverlapMuon: a {h.lane} lane task failed (see the chained exception for its traceback); "
            "the step's Muon update is incomplete"
        ) from e
