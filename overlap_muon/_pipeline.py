"""The wave pipeline: one Muon wave's trip from its gradients to its applied update, and nothing else.

[Note: one matrix from hook to forward wait] Read this file top to bottom to follow a matrix ``W`` (full shape
``(P, Q)``, this rank's shard ``w``) through one step:

1. Backward accumulates ``w.grad``; the grad-ready hook (``hooks.GradReadyTracker``) tells the optimizer, whose
   ``WaveDispatcher`` calls :meth:`WavePipeline.launch` for ``W``'s wave ``k`` once every matrix of the wave is
   ready (strictly in wave order on every rank: docs/design.md, invariant 2).
2. ``launch`` builds a :class:`WaveState` (the gradients it reads, the hyper-parameters, the record of its inputs)
   and queues up to five lane tasks (``_lanes.py``): ``check`` (the domain agrees on gradient presence,
   ``_agreement.py``; on CUDA posted, the other four queued once it is back), ``pack`` (wait for collectives still
   writing its gradients; new momentum, Nesterov, bf16 cast: the wave's only reads of ``.grad``), ``to_home`` (the
   wave's exchange, ``_exchanges.py``, to the ranks that orthogonalize each matrix), ``compute`` (the exchange kind's
   NS) and ``from_home`` (the exchange back: this rank's block of every ``O``). The exchange kind is the wave's
   frozen plan's (``scheduler/kinds.py``). Nothing the user can see changes: the wave is *speculative*.
3. ``step()`` calls :meth:`WavePipeline.commit`: a wave is *stale* when its set of gradients changed, or when
   anything it read changed since (a gradient edited in place or replaced, the state mapping, a state entry or
   momentum buffer replaced or edited, a momentum/NS hyper-parameter: [Note: a wave's reads] in ``_wave_state.py``);
   the ranks agree on the stale set and on gradient presence (``_agreement.py``) and re-launch those waves. Then
   one ``apply`` task per wave, after every wave's scatter (a step applies whole or not at all), commits the
   momentum and applies weight decay and the update with the ``lr`` and ``weight_decay`` of that ``step()`` call,
   each element rounded as ``torch.optim.Muon``'s ``add_`` rounds it in the full matrix ([Note: the apply follows
   torch's kernel path] in ``_muon_math.py``).
4. ``step()`` waits for the applies before it returns ([Note: the step barrier] in ``_runtime.py``; CUDA: a
   stream wait), or with ``async_step`` the next forward's pre-hook for ``W``'s module does
   (``_forward_waits.py``). Then the wave's state is released (:meth:`WavePipeline.reap`).

[Note: release on time] (docs/design.md, invariant 9) A :class:`WaveState` names every tensor the wave holds. On CPU
each task drops what the next one no longer needs (the full matrices after NS, the NS results and packed
momenta after the scatter, the gradients and update blocks after the apply), and the state leaves
the pipeline at the first wait or reap after its apply. On CUDA a tensor read on another stream than the one
that allocated it must live until that stream is done with it (invariant 5, no ``record_stream``), so the state
keeps all of them until the current stream has waited on its apply event (the step barrier, or ``async_step``'s
forward wait for its module), and is released then, with no host sync (why that is enough: ``LateRelease`` in
``_wave_state.py``); a wave nothing waits on (discarded, or retired by a new plan) is released once its events have
completed (``event.query()``). Nothing is held into the next step.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import Tensor

from ._scheduler.kinds import WavePlan
from ._scheduler.waves import Wave

from ._agreement import Agreement, PostedChecks
from ._comm import CommContext
from .config import OverlapMuonConfig
from ._domain import Domain
from ._placement import MuonParam
from ._lanes import Lanes, prof_range, wave_range_name
from ._exchanges import ExchangeContext, WaveExchanges, build_exchange
from ._muon_math import (CommitAtApply, CommitAtPack, KeepForApply, apply_update, create_momentum, host_alphas,
                        ns_input)
from ._wave_state import EarlyRelease, Hyper, LateRelease, Reads, WaveState

__all__ = ["WavePipeline"]


class WavePipeline:
    """Owns the lanes, the exchanges (one per wave) and one state per launched wave.

    Args:
        muon: the Muon params (index ``i`` is ``muon[i].index``).
        state: the optimizer's ``state`` dict (``state[param]["momentum_buffer"]``).
        comm: the runtime's groups (``_comm.build_comm``): the dense domain with the group sets of the gather and
            the scatter lanes ([Note: one process-group set per communicating lane] in ``_lanes.py``), the expert
            domain's (the routes of the waves with ``wave.domain == 1``, [Note: two domains] in ``_discovery.py``;
            without one, expert matrices are this rank's own, NS'd where they live), the DP slots ([Note: DP
            replicas as NS slots]) and the team group (``surplus="team"``).
        config: the runtime options.
        device: where the Muon params live.
        stats: the optimizer's counters (``ns_matrices``, ``ns_calls``, ``waves_launched``, ``reruns``).
        agreement: what the ranks agree on (``_agreement.py``): each wave's gradient presence, the step's stale waves.
    """

    def __init__(self, muon: Sequence[MuonParam], state: dict, comm: CommContext, config: OverlapMuonConfig,
                 device: torch.device, stats: dict[str, int], agreement: Agreement) -> None:
        self.muon, self.state, self.agreement = list(muon), state, agreement
        single = Domain.single()
        self._doms = [(comm.dom_to, comm.dom_from), comm.expert[:2] if comm.expert else (single, single)]
        self.dp = comm.dp
        self.config, self.stats = config, stats
        # A synchronous step of one wave has nothing to pipeline: its lanes run inline (no thread hand-offs).
        one_wave = not config.overlap and config.wave_slots is None
        self.lanes = Lanes(device, side_streams=config.side_streams and not one_wave, nvtx=config.nvtx)
        # CPU (and inline): a task drops what the next no longer needs; CUDA: whole states, after their last event.
        self._release = LateRelease() if self.lanes.cuda else EarlyRelease()
        self.exchanges: dict[int, WaveExchanges] = {}
        """Per wave index: its exchanges (:meth:`set_plans`)."""
        self._ctx = ExchangeContext(config.fused_a2a, stats, config.batch_ns, comm.team,
                                    buffers=None if device.type == "cuda" else {},
                                    gram_restart_every=config.gram_restart_every)
        self.keep_momentum = config.overlap and config.async_step
        """``async_step``: a wave keeps its new momentum from ``to_home`` to its apply, which then copies it instead
        of recomputing it from the gradient (the apply runs after ``step()`` returns)."""
        self._pending: dict[int, WaveState] = {}  # launched, not yet committed, by wave index
        self._applied: dict[int, WaveState] = {}  # committed, apply not yet waited for
        self._orphans: list[WaveState] = []  # discarded while tasks were still queued (their exchanges run on)
        self._lock = threading.RLock()
        self.checks = PostedChecks(self.lanes.cuda, [d for d, _ in self._doms])

    # --------------------------------------------------------------------------------------------------------
    # launch: the lane tasks up to the scatter (check, pack, to_home, NS, from_home), speculative
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
        # A committed wave (launched inside step()) is never compared: no fingerprint ([Note: content fingerprints]).
        reads = Reads(hyper, self.state, [self.muon[i] for i in items], grads,
                      self.config.content_check and not committed)
        st = WaveState(wave, items, hyper, grads, reads=reads, momentum=how)
        if committed:
            create_momentum(self.state, [self.muon[i] for i in items])
        self.stats["waves_launched"] += 1
        dom = self._doms[wave.domain][0]
        check = self.config.check_grad_presence and not committed and dom.ctrl_group is not None
        if not items and not check:
            st.empty = True
        else:
            # The pack waits for the applies of earlier waves that still write its momentum buffers; without any,
            # the buffers' counters are recorded now ([Note: a wave's reads] in _wave_state.py), else by the pack.
            with self._lock:
                writers = [a.h_apply for a in self._applied.values()
                           if a.h_apply is not None and not a.h_apply.done() and set(a.items) & set(items)]
            if not writers:
                st.reads.record_buffers()
            if check and self.checks.post[wave.domain]:  # [Note: gradient presence without the device]
                self.checks.add(st, self.agreement.post_check(st, dom), lambda: self._submit_tasks(st, writers))
            else:
                if check:
                    st.h_check = self.lanes.submit("to_home", lambda: self.agreement.check_wave(st, dom),
                                                   deps=writers)
                self._submit_tasks(st, writers)
        with self._lock:
            old = self._pending.pop(wave.index, None)
            if old is not None:
                self._orphan(old)
            self._pending[wave.index] = st
        return st

    def _submit_tasks(self, st: WaveState, writers: list) -> None:
        """Queue the wave's pack, exchange, NS and exchange back (after ``writers`` and its check, if any)."""
        k = st.wave.index
        st.h_pack = self.lanes.submit("to_home", lambda: self._pack_task(st), writers + st.handles(),
                                      wave_range_name(k, "pack"))
        st.h_to = self.lanes.submit("to_home", lambda: self._to_home_task(st), [st.h_pack],
                                    wave_range_name(k, "a2a_to_home"))
        st.h_ns = self.lanes.submit("compute", lambda: self._ns_task(st), [st.h_to], wave_range_name(k, "ns"),
                                    shareable=self.exchanges[k].ns_shareable)
        st.h_from = self.lanes.submit("from_home", lambda: self._from_home_task(st), [st.h_ns],
                                      wave_range_name(k, "a2a_from_home"))

    def _pack_task(self, st: WaveState) -> None:
        """The wave's only reads of ``.grad``: new momentum, Nesterov, bf16 cast; then its legs (one per exchange)."""
        if not st.items:
            st.empty = True
            return
        mps = [self.muon[i] for i in st.items]
        exchanges = self.exchanges[st.wave.index]
        st.packed = self._pack(st, mps, [not m.replicated and not exchanges.needs_input(m) for m in mps])
        st.legs = exchanges.legs(mps, st.packed)

    def _pack(self, st: WaveState, mps: list[MuonParam], skip: list[bool]) -> list[Tensor | None]:
        """The NS input of each item (bf16 shards; ``None`` where ``skip``: another replica computes it). The new
        momentum is made as the wave's commit policy says (``st.momentum``: out of place, kept, or in place)."""
        h = st.hyper
        grads, bufs = st.reads.read(self.state, mps)  # [Note: a wave's reads] in _wave_state.py
        news = st.momentum.pack(bufs, grads, h.momentum)
        return [None if s else ns_input(g, n, h.momentum, h.nesterov) for s, n, g in zip(skip, news, grads)]

    def _to_home_task(self, st: WaveState) -> None:
        """To the ranks that orthogonalize each matrix (every leg: one exchange each)."""
        if st.empty:
            return
        for leg in st.legs:
            leg.exchange.to_compute(leg)

    def _ns_task(self, st: WaveState) -> None:
        """Newton-Schulz on what this rank orthogonalizes (each leg with its kind's NS)."""
        if st.empty:
            return
        h = st.hyper
        kw = dict(ns_coefficients=h.ns_coefficients, ns_steps=h.ns_steps, eps=h.eps, syrk=self.config.syrk,
                  gram=self.config.gram_ns)
        for leg in st.legs:
            leg.outs = leg.exchange.orthogonalize(leg, kw)
            self._release.after_ns(leg)

    def _from_home_task(self, st: WaveState) -> None:
        """Back to storage: this rank's block of every result, in ``items`` order."""
        if st.empty:
            return
        by_position: dict[int, Tensor] = {}
        for leg in st.legs:
            by_position.update(zip(leg.positions, leg.exchange.back_to_storage(leg)))
        st.updates = [by_position[j] for j in range(len(st.items))]
        self._release.after_scatter(st)

    def _apply_task(self, st: WaveState, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None,
                    alphas: dict | None) -> None:
        for j, i in enumerate([] if st.empty else st.items):
            m = self.muon[i]
            st.momentum.commit(j, m.local(st.bufs[j]), m.local(st.grads[j]), st.hyper.momentum)
            p, u = m.local(m.param), st.updates[j]
            if m.transposed:  # apply to the (out, in) matrix torch's nn.Linear reference updates
                p, u = p.T, u.T
            for a, b, shape, region in m.runs:  # one run unless the matrix is split (overlap_muon.split)
                whole = a == 0 and b == p.size(0)
                apply_update(p if whole else p[a:b], u if whole else u[a:b], lr, weight_decay, adjust_lr_fn,
                             shape, region, None if alphas is None else alphas[tuple(shape)])
        self._release.after_apply(st)

    # --------------------------------------------------------------------------------------------------------
    # commit: only step() changes params and state
    # --------------------------------------------------------------------------------------------------------
    def commit(self, waves: Sequence[Wave], group: dict[str, Any], *, validate: bool, skip: bool, agreed: bool
               ) -> int:
        """Validate the launched waves, re-run the stale ones, and queue every wave's apply with ``group``'s values.

        Args:
            waves: the plan (every wave has been launched this step).
            group: the Muon param group now (``lr``, ``weight_decay``, ``adjust_lr_fn`` read here).
            validate: check for stale waves (``False`` when the waves were launched inside this ``step()``).
            skip: drop the step (``skip_nonfinite``): nothing is applied, momentum stays as it was.
            agreed: the ranks agreed on gradient presence before this step launched its waves (a synchronous
                step): nothing is stale, so there is nothing more to agree on.

        Returns:
            The number of waves re-run.

        Raises:
            ValueError: the ranks disagree on gradient presence (``Agreement.presence``; nothing applied).
        """
        self.checks.advance(block=True)  # every wave's tasks queued before it is validated
        with self._lock:
            pending = dict(self._pending)
        if skip:
            self.discard()
            return 0
        hyper = Hyper.of(group)
        try:
            stale = self.agreement.stale_flags(list(waves), pending, hyper, self.state, validate=validate,
                                               agreed=agreed, in_flight=lambda: self.in_flight(pending))
        except ValueError:
            self.discard()
            raise
        create_momentum(self.state, self.muon)
        reruns = 0
        for w, why in zip(waves, stale):
            if why is not None:
                pending[w.index] = self.launch(w, hyper)
                reruns += 1
                self.stats[f"reruns.{why}"] += 1  # messages.RERUN_CAUSES
        self.stats["reruns"] += reruns
        self.checks.advance(block=True)  # the re-runs' tasks, before the applies that wait for their scatters
        self._queue_applies(pending, group)
        return reruns

    def _queue_applies(self, pending: dict[int, WaveState], group: dict[str, Any]) -> None:
        """One apply per wave, with ``group``'s ``lr``, ``weight_decay`` and ``adjust_lr_fn`` of now, into the
        momentum buffers the state holds now. Every apply waits for every wave's scatter: a wave that failed fails
        them all, so a step is applied whole or not at all (the from_home lane is FIFO in wave order, so this delays
        no apply: the last wave's, which the next forward needs first, ran last anyway)."""
        lr, wd, adj = group["lr"], group["weight_decay"], group["adjust_lr_fn"]
        alphas = None
        if isinstance(lr, Tensor):  # as torch.optim's _to_scalar: a 1-element tensor of any shape acts as 0-d;
            lr = lr.reshape(()).clone()  # cloned: a scheduler may fill it before the apply runs
            alphas = host_alphas(lr, adj, [tuple(r[2]) for st in pending.values() for i in st.items
                                           for r in self.muon[i].runs])
        scattered = [st.h_from for st in pending.values() if st.h_from is not None]
        with self._lock:
            for k in sorted(pending):
                st = pending[k]
                st.bufs = [self.state[self.muon[i].param]["momentum_buffer"] for i in st.items]
                st.h_apply = self.lanes.submit("from_home", lambda st=st: self._apply_task(st, lr, wd, adj, alphas),
                                               scattered, wave_range_name(k, "apply"))
                st.committed = True
                self._pending.pop(k, None)
                self._applied[k] = st

    def discard(self) -> None:
        """Forget every uncommitted wave (``zero_grad()``, a new backward before ``step()``, a skipped step).

        Their queued exchanges still run (every rank queued them), their results are dropped.
        """
        self.checks.advance(block=True)  # a posted wave is queued on every rank before it is dropped
        with self._lock:
            pending, self._pending = self._pending, {}
            for st in pending.values():
                self._orphan(st)

    def rebase_grad_versions(self) -> None:
        """Re-take the uncommitted waves' gradient versions ([Note: DDP readiness], hooks/ddp_readiness.py)."""
        with self._lock:
            for st in self._pending.values():
                if st.reads is not None:
                    st.reads.rebase_grads()

    def in_flight(self, pending: dict[int, WaveState] | None = None) -> list[WaveState]:
        """The committed waves not yet waited for, then ``pending`` (default: the uncommitted ones) in wave order:
        whose own errors explain a failed agreement."""
        with self._lock:
            pending = self._pending if pending is None else pending
            return list(self._applied.values()) + sorted(pending.values(), key=lambda st: st.wave.index)

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
        self.lanes.help()  # [Note: a waiting thread helps] in _lanes.py
        for k in waves:
            with self._lock:
                st = self._applied.get(k)
            if st is None:
                continue
            with prof_range(f"OverlapMuon::wait::wave{k}", nvtx=self.config.nvtx):
                st.h_apply.wait(streams)
            if st.done() or self._release.at_wait(st):  # [Note: release on time]
                with self._lock:
                    if self._applied.get(k) is st:
                        del self._applied[k]
                st.release()

    def reap(self) -> None:
        """Release every state whose tasks have all finished; surface a failed task now. Never blocks."""
        self._release.prune()
        with self._lock:
            finished = [k for k, st in self._applied.items() if st.done()]
            states = [self._applied.pop(k) for k in finished]
            orphans = [st for st in self._orphans if st.done()]
            self._orphans = [st for st in self._orphans if not st.done()]
        for st in orphans:
            st.release()
        for st in states:
            for h in st.handles():
                h.wait()
            st.release()

    def synchronize(self) -> None:
        """Block the host until every committed wave is applied and every orphaned task has finished.

        Raises:
            RuntimeError: a lane task failed; its original exception (and traceback) is chained.
        """
        self.checks.advance(block=True)
        self.lanes.help()
        self._release.synchronize()  # applies released at a wait (CUDA)
        with self._lock:
            states, self._applied = list(self._applied.values()), {}
            orphans, self._orphans = self._orphans, []
        error: BaseException | None = None
        for st in orphans + states:
            for h in st.handles():
                if h.event is not None:
                    h.event.synchronize()
                try:
                    h.wait()
                except BaseException as e:  # noqa: BLE001 - every wave is waited for first, then raised
                    if error is None and st.committed:
                        error = e
            st.release()
        if error is not None:
            raise error

    def retire(self) -> None:
        """A new plan replaces the waves: the committed states leave their wave indices and wait for their last
        tasks as orphans (released by :meth:`reap` once done; no host wait, so none on CUDA either)."""
        self.checks.advance(block=True)
        with self._lock:
            applied, self._applied = list(self._applied.values()), {}
            for st in applied:
                self._orphan(st)

    def set_plans(self, plans: Sequence[WavePlan]) -> None:
        """The wave plan changed (construction, or the observed readiness order): build each wave's exchange from
        its frozen plan (``_exchanges.build_exchange``); the routing caches are per (wave, params), so drop them."""
        self._ctx.routes.clear()
        if self._ctx.buffers is not None:
            self._ctx.buffers.clear()
        self.exchanges = {p.wave.index: build_exchange(p, self._ctx, self._doms[p.wave.domain], self.dp) for p in plans}

    def close(self) -> None:
        """Stop the lane threads once their queued tasks are done (does not wait for them)."""
        self.lanes.shutdown(wait=False)

