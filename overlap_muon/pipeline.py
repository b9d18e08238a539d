"""The wave pipeline: one Muon wave's trip from its gradients to its applied update, and nothing else.

[Note: one matrix from hook to forward wait] Read this file top to bottom to follow a matrix ``W`` (full shape
``(P, Q)``, this rank's shard ``w``) through one step:

1. Backward accumulates ``w.grad``; the grad-ready hook (``hooks.GradReadyTracker``) tells the optimizer, whose
   ``WaveDispatcher`` calls :meth:`WavePipeline.launch` for ``W``'s wave ``k`` once every matrix of the wave is
   ready (strictly in wave order on every rank: docs/design.md, invariant 2).
2. ``launch`` builds a :class:`WaveState` (the gradients it reads, the hyper-parameters, the record of its inputs)
   and queues four lane tasks (``lanes.py``): ``pack`` (agree on gradient presence; wait for collectives still
   writing its gradients; new momentum, Nesterov, bf16 cast: the wave's only reads of ``.grad``), ``to_home``
   (the wave's exchange, ``exchanges.py``, to the ranks that orthogonalize each matrix), ``compute`` (NS) and
   ``from_home`` (the exchange back: this rank's block of every ``O``). The exchange kind is the wave's frozen
   plan's (``scheduler/kinds.py``). Nothing the user can see changes: the wave is *speculative*.
3. ``step()`` calls :meth:`WavePipeline.commit`: a wave is *stale* when its set of gradients changed, or when
   anything it read changed since (a gradient edited in place or replaced, the state mapping, a state entry
   or momentum buffer replaced or edited, a momentum/NS hyper-parameter: [Note: a wave's reads] in ``reads.py``);
   the ranks agree on the stale set and on gradient presence (``agreement.py``) and re-launch those waves. Then
   one ``apply`` task per wave, after every wave's scatter (a step applies whole or not at all), commits the
   momentum and applies weight decay and the update with the ``lr`` and ``weight_decay`` of that ``step()`` call,
   each element rounded as ``torch.optim.Muon``'s ``add_`` rounds it in the full matrix ([Note: the apply follows
   torch's kernel path] in ``muon_math.py``).
4. ``step()`` waits for the applies before it returns ([Note: the step barrier] in ``runtime.py``; CUDA: a
   stream wait), or with ``async_step`` the next forward's pre-hook for ``W``'s module does
   (``forward_waits.py``). Then the wave's state is released (:meth:`WavePipeline.reap`).

[Note: release on time] (docs/design.md, invariant 9) A :class:`WaveState` names every tensor the wave holds. On CPU
each task drops what the next one no longer needs (the full matrices after NS, the NS results and packed
momenta after the scatter, the gradients and update blocks after the apply), and the state leaves
the pipeline at the first wait or reap after its apply. On CUDA a tensor read on another stream than the one
that allocated it must live until that stream is done with it (invariant 5, no ``record_stream``), so the state
keeps all of them until its apply event has completed (``event.query()``, never a host sync) and is released
then. Nothing is held into the next step.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .scheduler.kinds import WavePlan
from .scheduler.waves import Wave

from .config import OverlapMuonConfig
from .comm import DPSlots
from .agreement import Agreement, max_everywhere
from .domain import Domain, MuonParam
from .lanes import Lanes
from .exchanges import Exchange, ExchangeContext, Leg, Local, build_exchange, run_collective
from .muon_math import CommitAtApply, CommitAtPack, KeepForApply, apply_update, ns_input
from .ns import zeropower_each
from .profiling import prof_range, wave_range_name
from .reads import Hyper, Reads
from .state import create_momentum
from .team_ns import team_norms, team_zeropower_blocks
from .wave_state import EarlyRelease, LateRelease, WaveState, wait_handle

__all__ = ["WavePipeline", "WaveState", "Hyper"]


class WavePipeline(Agreement):
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
        single = Domain.single()
        self._doms = [(dom_to, dom_from), expert_doms[:2] if expert_doms else (single, single)]
        self._expert_ctrl = expert_doms[2] if expert_doms else None
        self.dp, self.team_group, self.ctrl_group = dp_slots, team_group, ctrl_group
        self.config, self.stats = config, stats
        # A synchronous step of one wave has nothing to pipeline: its lanes run inline (no thread hand-offs).
        one_wave = not config.overlap and config.wave_slots is None
        self.lanes = Lanes(device, side_streams=config.side_streams and not one_wave)
        # CPU (and inline): a task drops what the next no longer needs; CUDA: whole states, after their last event.
        self._release = LateRelease() if self.lanes.cuda else EarlyRelease()
        self._route_plans: dict[Any, dict] = {}
        self.exchanges: dict[int, tuple[Exchange, Exchange]] = {}
        """Per wave index: its exchange and the ``local`` one of its replicated params (:meth:`set_plans`)."""
        self._ctx = ExchangeContext(config.fused_a2a, self._route_plans, self._run,
                                    None if device.type == "cuda" else {})
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
    # launch: four lane tasks, speculative
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
        how = CommitAtPack() if committed else KeepForApply() if self.keep_momentum else CommitAtApply()
        reads = Reads(hyper, self.state, [self.muon[i] for i in items], grads)
        st = WaveState(wave, items, hyper, grads, reads=reads, momentum=how)
        if committed:
            create_momentum(self.state, [self.muon[i] for i in items])
        self.stats["waves_launched"] += 1
        check = (self.config.check_grad_presence and not self._agreed
                 and self._doms[wave.domain][0].ctrl_group is not None)
        if not items and not check:
            st.empty = True
        else:
            # The pack waits for the applies of earlier waves that still write its momentum buffers; without any,
            # the buffers' counters are recorded now ([Note: a wave's reads] in reads.py), else by the pack.
            with self._lock:
                writers = [a.h_apply for a in self._applied.values()
                           if a.h_apply is not None and not a.h_apply.done() and set(a.items) & set(items)]
            if not writers:
                st.reads.record_buffers()
            if check:  # [Note: gradient presence without the device] in agreement.py
                st.h_check = self.lanes.submit("to_home", lambda: self._check_task(st), deps=writers)
            st.h_pack = self.lanes.submit("to_home", lambda: self._pack_task(st), deps=writers + st.handles())
            st.h_to = self.lanes.submit("to_home", lambda: self._to_home_task(st), deps=[st.h_pack])
            st.h_ns = self.lanes.submit("compute", lambda: self._ns_task(st), deps=[st.h_to])
            st.h_from = self.lanes.submit("from_home", lambda: self._from_home_task(st), deps=[st.h_ns])
        with self._lock:
            old = self._pending.pop(wave.index, None)
            if old is not None:
                self._orphan(old)
            self._pending[wave.index] = st
        return st

    def _check_task(self, st: WaveState) -> None:
        """The ranks of the wave's domain agree on which of its params have a gradient, before any exchange."""
        dom = self._doms[st.wave.domain][0]
        self._run(st.wave.index, st.items, "a2a_to_home", dom, lambda: self._agree_on_gradients(st), "all_to_all")

    def _pack_task(self, st: WaveState) -> None:
        """The wave's only reads of ``.grad``: new momentum, Nesterov, bf16 cast; then its legs (one per exchange)."""
        if not st.items:
            st.empty = True
            return
        k, mps = st.wave.index, [self.muon[i] for i in st.items]
        main, local = self.exchanges[k]
        with prof_range(wave_range_name(k, "pack"), nvtx=self.config.nvtx):
            st.packed = self._pack(st, mps, [not m.replicated and not main.needs_input(m) for m in mps])
        ex = [j for j, m in enumerate(mps) if not m.replicated]
        rep = [j for j, m in enumerate(mps) if m.replicated]  # [Note: replicated params] in domain.py
        st.legs = [Leg(e, pos, [mps[j] for j in pos], [st.packed[j] for j in pos])
                   for e, pos in ((main, ex), (local, rep)) if pos]

    def _pack(self, st: WaveState, mps: list[MuonParam], skip: list[bool]) -> list[Tensor | None]:
        """The NS input of each item (bf16 shards; ``None`` where ``skip``: another replica computes it). The new
        momentum is made as the wave's commit policy says (``st.momentum``: out of place, kept, or in place)."""
        h = st.hyper
        grads, bufs = st.reads.read(self.state, mps)  # [Note: a wave's reads] in reads.py
        news = st.momentum.pack(bufs, grads, h.momentum)
        return [None if s else ns_input(g, n, h.momentum, h.nesterov) for s, n, g in zip(skip, news, grads)]

    def _to_home_task(self, st: WaveState) -> None:
        """To the ranks that orthogonalize each matrix (every leg: one exchange each)."""
        if st.empty:
            return
        with prof_range(wave_range_name(st.wave.index, "a2a_to_home"), nvtx=self.config.nvtx):
            for leg in st.legs:
                leg.exchange.to_compute(leg)

    def _ns_task(self, st: WaveState) -> None:
        """Newton-Schulz on what this rank orthogonalizes (each leg with its kind's NS)."""
        if st.empty:
            return
        h = st.hyper
        kw = dict(ns_coefficients=h.ns_coefficients, ns_steps=h.ns_steps, eps=h.eps, syrk=self.config.syrk,
                  gram=self.config.gram_ns)
        with prof_range(wave_range_name(st.wave.index, "ns"), nvtx=self.config.nvtx):
            for leg in st.legs:
                leg.outs = leg.exchange.orthogonalize(leg, getattr(self, _NS[leg.exchange.ns_kind]), kw)
                self._release.after_ns(leg)

    def _from_home_task(self, st: WaveState) -> None:
        """Back to storage: this rank's block of every result, in ``items`` order."""
        if st.empty:
            return
        by_position: dict[int, Tensor] = {}
        with prof_range(wave_range_name(st.wave.index, "a2a_from_home"), nvtx=self.config.nvtx):
            for leg in st.legs:
                by_position.update(zip(leg.positions, leg.exchange.back_to_storage(leg)))
        st.updates = [by_position[j] for j in range(len(st.items))]
        self._release.after_scatter(st)

    def _apply_task(self, st: WaveState, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None) -> None:
        if not st.empty:
            with prof_range(wave_range_name(st.wave.index, "apply"), nvtx=self.config.nvtx):
                for j, i in enumerate(st.items):
                    m = self.muon[i]
                    buf = m.local(st.bufs[j])
                    st.momentum.commit(j, buf, m.local(st.grads[j]), st.hyper.momentum)
                    p, u = m.local(m.param), st.updates[j]
                    if m.transposed:  # apply to the (out, in) matrix torch's nn.Linear reference updates
                        p, u = p.T, u.T
                    for a, b, shape, region in m.runs:  # one run unless the matrix is split (overlap_muon.split)
                        whole = a == 0 and b == p.size(0)
                        apply_update(p if whole else p[a:b], u if whole else u[a:b], lr, weight_decay,
                                     adjust_lr_fn, shape, region)
        self._release.after_apply(st)

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
        kw = {k: v for k, v in kw.items() if k != "gram"}  # team NS keeps the plain iteration
        outs = team_zeropower_blocks(xs, team_norms(xs, self.team_group), self.team_group, split_poly=split, **kw)
        return [o.mT.contiguous() if t else o for o, t in zip(outs, tall)]

    def _ns_many(self, mats: list[Tensor], kw: dict[str, Any]) -> list[Tensor]:
        """NS of each matrix (``ns.zeropower_each``; same-shape ones batched with ``batch_ns``)."""
        return zeropower_each(mats, kw, self.config.batch_ns, self.stats)

    def _run(self, wave: int, params: list[int], phase: str, dom: Domain, fn: Callable[[], Any], op: str) -> Any:
        """Run a collective; name the wave, the exchange, the group and the params in any error it raises."""
        return run_collective(fn, f"wave {wave} {phase}", [self.muon[i].name for i in params], dom, op,
                              self.config.fused_a2a)

    # --------------------------------------------------------------------------------------------------------
    # commit: only step() changes params and state
    # --------------------------------------------------------------------------------------------------------
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
        hyper = Hyper.of(group)
        stale = self._stale_flags(waves, pending, hyper, validate)
        create_momentum(self.state, self.muon)
        reruns = 0
        for w, f in zip(waves, stale):
            if f:
                pending[w.index] = self.launch(w, hyper)
                reruns += 1
        self.stats["reruns"] += reruns
        self._queue_applies(pending, group)
        return reruns

    def _queue_applies(self, pending: dict[int, WaveState], group: dict[str, Any]) -> None:
        """One apply per wave, with ``group``'s ``lr``, ``weight_decay`` and ``adjust_lr_fn`` of now, into the
        momentum buffers the state holds now. Every apply waits for every wave's scatter: a wave that failed fails
        them all, so a step is applied whole or not at all (the from_home lane is FIFO in wave order, so this delays
        no apply: the last wave's, which the next forward needs first, ran last anyway)."""
        lr = group["lr"]
        if isinstance(lr, Tensor):  # as torch.optim's _to_scalar: a 1-element tensor of any shape acts as 0-d;
            lr = lr.reshape(()).clone()  # cloned: a scheduler may fill it before the apply runs
        wd, adj = group["weight_decay"], group["adjust_lr_fn"]
        scattered = [st.h_from for st in pending.values() if st.h_from is not None]
        with self._lock:
            for k in sorted(pending):
                st = pending[k]
                st.bufs = [self.state[self.muon[i].param]["momentum_buffer"] for i in st.items]
                st.h_apply = self.lanes.submit("from_home", lambda st=st: self._apply_task(st, lr, wd, adj),
                                               deps=scattered)
                st.committed = True
                self._pending.pop(k, None)
                self._applied[k] = st

    def discard(self) -> None:
        """Forget every uncommitted wave (``zero_grad()``, a new backward before ``step()``, a skipped step).

        Their queued exchanges still run (every rank queued them), their results are dropped.
        """
        with self._lock:
            pending, self._pending = self._pending, {}
            for st in pending.values():
                self._orphan(st)

    def _orphan(self, st: WaveState) -> None:
        if self._release.eager and st.done():
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
                wait_handle(st.h_apply, streams)
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
            wait_handle(h, ())

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
                wait_handle(h, ())
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
                    wait_handle(h, ())
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
            max_everywhere(flag, self.ctrl_group)
        return int(flag[0]) == 0

    def has_pending(self) -> bool:
        """Some wave has been launched this step and not committed."""
        with self._lock:
            return bool(self._pending)

    def set_plans(self, plans: Sequence[WavePlan]) -> None:
        """The wave plan changed (construction, or the observed readiness order): build each wave's exchange from
        its frozen plan (``exchanges.build_exchange``); route plans are per (wave, params), so drop them."""
        self._route_plans.clear()
        if self._ctx.buffers is not None:
            self._ctx.buffers.clear()
        self.exchanges = {p.wave.index: (build_exchange(p, self._ctx, self._doms[p.wave.domain], self.dp),
                                         Local(self._ctx, p.wave.index, *self._doms[p.wave.domain])) for p in plans}

    def close(self) -> None:
        """Stop the lane threads once their queued tasks are done (does not wait for them)."""
        self.lanes.shutdown(wait=False)


#: The runtime's NS function of each exchange's ``ns_kind`` (looked up on the instance at call time).
_NS = {"plain": "_ns_many", "team": "_team_ns"}
