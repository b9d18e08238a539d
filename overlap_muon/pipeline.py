"""The wave pipeline: one Muon wave's trip from its gradients to its applied update, and nothing else.

[Note: one matrix from hook to forward wait] Read this file top to bottom to follow a matrix ``W`` (full shape
``(P, Q)``, this rank's shard ``w``) through one step:

1. Backward accumulates ``w.grad``; the grad-ready hook (``hooks.GradReadyTracker``) tells the optimizer, whose
   :class:`scheduler.WaveDispatcher` calls :meth:`WavePipeline.launch` for ``W``'s wave ``k`` once every matrix of
   the wave is ready (strictly in wave order on every rank: DESIGN.md invariant 2).
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

[Note: release on time] (DESIGN.md invariant 9) A :class:`WaveState` names every tensor the wave holds. On CPU
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

import math
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .scheduler.surplus import SurplusCostModel, team_splits_poly
from .scheduler.waves import Wave

from .config import OverlapMuonConfig
from .comm import DPSlots
from .domain import Domain, MuonParam, local_tensor
from .lanes import LaneHandle, Lanes
from .layer_sharded_a2a import all_gather_full, from_homes, from_team, local_shard, to_homes, to_team
from .muon_math import apply_update, momentum_update, momentum_update_, ns_input
from .ns import zeropower
from .profiling import prof_range, wave_range_name
from .split import split_ns
from .team_ns import team_norms, team_zeropower_blocks

__all__ = ["WavePipeline", "WaveState", "Hyper", "TestingSeam"]


@dataclass
class TestingSeam:
    """Private seam for tests: never part of the public constructor.

    Attributes:
        ns_delay_s: seconds slept at the start of each ``compute`` task (makes overlap observable on CPU).
        timeline: when a list, ``(event, wave, time.perf_counter())`` records of launches, NS starts and waits.
        ns_wrap: when set, ``ns_wrap(ns, mats, kw)`` replaces each batched NS call ``ns(mats, kw)`` (count calls,
            inject a failure).
        on_state: when set, called with each :class:`WaveState` at launch.
        before_apply: when set, called at the start of each apply task, on its lane (CUDA: inside its stream, e.g.
            ``torch.cuda._sleep`` to make a missing stream wait visible).
    """

    __test__ = False  # not a pytest class

    ns_delay_s: float = 0.0
    timeline: list[tuple[str, int, float]] | None = None
    ns_wrap: Callable[..., list[Tensor]] | None = None
    on_state: Callable[["WaveState"], None] | None = None
    before_apply: Callable[["WaveState"], None] | None = None

    def record(self, event: str, wave: int) -> None:
        if self.timeline is not None:
            self.timeline.append((event, wave, time.perf_counter()))


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
    packed: list[Tensor] | None = None
    """Shards, bf16: the NS inputs sent to the homes (``to_home``; released after ``from_home``)."""
    fulls: list[Tensor] | None = None
    """(P, Q) bf16: matrices assembled on this rank's homes, then the NS inputs of the wave's replicated params
    (NS'd locally, [Note: replicated params] in ``domain.py``) (``to_home``; released after NS)."""
    mine: list[int] | None = None
    """Of the wave's exchanged (not replicated) params, in ``items`` order, the positions of those homed on this rank
    (``to_home``); ``fulls[:len(mine)]`` are theirs. With duplicate homes, positions in :attr:`copies`."""
    copies: list[tuple[int, int]] | None = None
    """With duplicate homes (``WavePipeline.dup_homes``): the list the exchanges route, ``(position in the
    exchanged params, home)`` per copy of a matrix, one copy per home (``to_home``)."""
    outs: list[Tensor] | None = None
    """(P, Q) bf16: NS results on this rank's homes (``compute``; released after ``from_home``)."""
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
        self.grads = self.packed = self.fulls = self.outs = self.updates = self.momenta = None


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
        testing: the private :class:`TestingSeam`.
        dp_slots: the data-parallel replicas of the dense domain share its NS work ([Note: DP replicas as NS
            slots]); ``None``: each replica runs all of it.
        team_group: a group over this rank's dense domain for team NS (``surplus="team"``), used by the compute
            lane only.
        expert_doms: ``(dom_to, dom_from, ctrl_group)`` of this rank's expert domain, the routes of the waves with
            ``wave.domain == 1`` ([Note: two domains] in ``domain.py``); ``ctrl_group`` is a gloo group over that
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
        testing: TestingSeam,
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
        self.testing = testing
        # A synchronous step of one wave has nothing to pipeline: its lanes run inline (no thread hand-offs).
        one_wave = not config.overlap and config.wave_slots is None
        self.lanes = Lanes(device, side_streams=config.side_streams and not one_wave, delay_s=testing.ns_delay_s)
        # On CPU (and inline) a task may drop what the next no longer needs; on CUDA only whole states are
        # released, after their last event ([Note: release on time]).
        self._eager_release = not self.lanes.cuda
        self._route_plans: dict[Any, dict] = {}
        self.gathered: set[int] = set()
        """Waves run as in ``duplicated`` mode (every rank gathers and NS's every matrix, nothing is scattered):
        all of them in that mode, else those the surplus plan gives every rank (``surplus="duplicate"|"team"``)."""
        self.dup_homes: dict[int, dict[int, tuple[tuple[int, ...], tuple[int, ...]]]] = {}
        """``surplus="duplicate"``, fused exchanges: per wave, the matrices with several homes
        (``scheduler.surplus.duplicate_homes``): each home receives the whole matrix and runs its NS, and every rank
        takes its block from its serving home (a home from itself), so only the other ranks receive a scatter."""
        self.surplus_model: SurplusCostModel | None = None
        """The machine figures the surplus plan was made with (``None``: ``SurplusCostModel()``'s defaults)."""
        self.teamed: set[int] = set()
        """Of :attr:`gathered`, the waves whose NS the domain splits by columns instead (``surplus="team"|"auto"``,
        on ``team_group``: ``overlap_muon.team_ns``, not bitwise): re-laid by ``to_team``/``from_team``, no gather."""
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
        self.testing.record("launch", wave.index)
        if self.testing.on_state is not None:
            self.testing.on_state(st)
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

    def _exchanged(self, st: WaveState) -> tuple[list[int], list[int]]:
        """Positions in ``st.items`` of the wave's exchanged (not replicated) params: those routed in this rank's
        domain, and (DP slots) those another replica computes, which arrive in ``from_home``'s DP exchange."""
        mps = [self.muon[i] for i in st.items]
        ex = [j for j, m in enumerate(mps) if not m.replicated]
        if self.dp is None or st.wave.domain != 0:
            return ex, []
        D, d = self.dp.size, self.dp.replica
        mine = [j for j in ex if st.wave.homes[st.items[j]] % D == d]
        return mine, [j for j in ex if st.wave.homes[st.items[j]] % D != d]

    def _home(self, wave: Wave, i: int) -> int:
        """Param ``i``'s home as a rank of this rank's domain (DP slots: homes number ``D * S``, interleaved)."""
        h = wave.homes[i]
        return h // self.dp.size if self.dp is not None and wave.domain == 0 else h

    def _pack_task(self, st: WaveState, check: bool) -> None:
        """The wave's only reads of ``.grad``: new momentum, Nesterov, bf16 cast (``st.packed``)."""
        k, dom = st.wave.index, self._doms[st.wave.domain][0]
        if check:
            self._exchange(st, "a2a_to_home", dom, lambda: self._agree_on_gradients(st))
        if not st.items:
            st.empty = True
            return
        mps = [self.muon[i] for i in st.items]
        h = st.hyper
        skip = set(self._exchanged(st)[1])  # DP slots: another replica computes these, no NS input is needed here
        with prof_range(wave_range_name(k, "pack"), nvtx=self.config.nvtx):
            grads = [m.local(g) for m, g in zip(mps, st.grads)]
            if st.momentum_done:  # a synchronous step: commit in place (torch's own op), no copy
                bufs = [m.local(self.state[m.param]["momentum_buffer"]) for m in mps]
                for b, g in zip(bufs, grads):
                    momentum_update_(b, g, h.momentum)
                st.packed = [None if j in skip else ns_input(g, b, h.momentum, h.nesterov)
                             for j, (b, g) in enumerate(zip(bufs, grads))]
                return
            bufs = [self._momentum(m, g) for m, g in zip(mps, grads)]
            # The new momentum lives only as long as the NS input needs it; the apply recomputes it in place
            # (the same op on the same values: bitwise the same), so a speculative wave holds no momentum copy,
            # unless the apply runs after step() returns (async_step): then it keeps it.
            news = [momentum_update(b, g, h.momentum) for b, g in zip(bufs, grads)]
            st.packed = [None if j in skip else ns_input(g, n, h.momentum, h.nesterov)
                         for j, (n, g) in enumerate(zip(news, grads))]
            st.momenta = news if self.keep_momentum else None

    def _to_home_task(self, st: WaveState) -> None:
        if st.empty:
            return
        k, dom = st.wave.index, self._doms[st.wave.domain][0]
        mps = [self.muon[i] for i in st.items]
        ex = self._exchanged(st)[0]
        # Replicated params ([Note: replicated params] in domain.py) skip the exchanges: their NS input is the full
        # matrix already. The exchanged ones come first in ``fulls``, the replicated ones after them.
        packed = [st.packed[j] for j in ex]
        pds, shapes = [mps[j].partition_dim for j in ex], [mps[j].full_shape for j in ex]
        fulls: list[Tensor] = []
        st.mine = []
        with prof_range(wave_range_name(k, "a2a_to_home"), nvtx=self.config.nvtx):
            if not ex:
                pass  # every rank has the same items (gradient presence is agreed), so every rank skips
            elif k in self.teamed:  # [Note: team NS by columns]: each rank gets its block of the long dim
                plan = self._route_plans.setdefault(("to_team", k, tuple(st.items)), {})
                fulls = self._exchange(st, "a2a_to_home", dom, lambda: to_team(packed, pds, shapes, dom, plan))
                st.mine = list(range(len(ex)))
            elif self._gathers(st.wave):
                fulls = self._exchange(st, "a2a_to_home", dom, lambda: all_gather_full(packed, pds, shapes, dom))
                st.mine = list(range(len(ex)))
            else:
                dup = self.dup_homes.get(k, {})
                st.copies = [(x, h) for x, j in enumerate(ex)
                             for h in (dup[st.items[j]][0] if st.items[j] in dup else (self._home(st.wave, st.items[j]),))]
                homes = [h for _, h in st.copies]
                cp, cpds, cshapes = ([v[x] for x, _ in st.copies] for v in (packed, pds, shapes))
                plan = self._route_plans.setdefault(("to", k, tuple(st.items)), {})
                fulls, st.mine = self._exchange(
                    st, "a2a_to_home", dom,
                    lambda: to_homes(cp, homes, cpds, cshapes, dom, fused=self.config.fused_a2a, plan=plan),
                )
        st.fulls = list(fulls) + [st.packed[j] for j, m in enumerate(mps) if m.replicated]

    def _momentum(self, m: MuonParam, grad: Tensor) -> Tensor:
        """``m``'s committed momentum (local shard), or zeros before its first step ([Note: lazy state] in
        ``state.py``; read without inserting a key: the state dict is the user's until ``step()``)."""
        st = self.state.get(m.param)
        buf = st.get("momentum_buffer") if st else None
        return m.local(buf) if buf is not None else torch.zeros_like(grad, memory_format=torch.preserve_format)

    def _ns_task(self, st: WaveState) -> None:
        if st.empty:
            return
        self.testing.record("ns_start", st.wave.index)
        h = st.hyper
        kw = dict(ns_coefficients=h.ns_coefficients, ns_steps=h.ns_steps, eps=h.eps, syrk=self.config.syrk)
        with prof_range(wave_range_name(st.wave.index, "ns"), nvtx=self.config.nvtx):
            wrap = self.testing.ns_wrap
            # fulls: the exchanged matrices homed here (positions ex[st.mine]), then the replicated ones
            mps = [self.muon[i] for i in st.items]
            ex = self._exchanged(st)[0]
            pos = [st.copies[v][0] for v in st.mine] if st.copies is not None else st.mine
            homed = [mps[ex[x]] for x in pos] + [m for m in mps if m.replicated]
            # [Note: transposed weights] a weight stored (in, out) (HF Conv1D) is the (out, in) linear W^T: NS runs
            # on a contiguous copy of W^T, exactly the matrix torch.optim.Muon sees for the equivalent nn.Linear, and
            # the result is transposed back to the stored layout. Bitwise by construction (no op sees other values or
            # strides than the reference's); the lr ratio uses MuonParam.ns_shape, the (out, in) shape.
            if st.wave.index in self.teamed:  # team blocks; the optimizer teams no transposed or split matrix
                n_ex = len(st.fulls) - sum(m.replicated for m in homed)
                blocks = [(st.fulls[:n_ex], homed[:n_ex])]
                team = wrap(self._team_ns, blocks, kw) if wrap else self._team_ns(blocks, kw)
                rest = st.fulls[n_ex:]
                st.outs = team + (wrap(self._ns_many, rest, kw) if wrap else self._ns_many(rest, kw))
            else:
                mats = [f.T.contiguous() if m.transposed else f for f, m in zip(st.fulls, homed)]
                ns = self._ns_many
                outs = split_ns(mats, [m.parts for m in homed], lambda ms: wrap(ns, ms, kw) if wrap else ns(ms, kw))
                st.outs = [o.T.contiguous() if m.transposed else o for o, m in zip(outs, homed)]
        if self._eager_release:
            st.fulls = None

    def _from_home_task(self, st: WaveState) -> None:
        if st.empty:
            return
        mps = [self.muon[i] for i in st.items]
        ex, others = self._exchanged(st)
        rep = [j for j, m in enumerate(mps) if m.replicated]
        outs, rep_outs = st.outs[:len(st.mine)], st.outs[len(st.mine):]  # see _to_home_task's order
        packed = [st.packed[j] for j in ex]
        pds, shapes = [mps[j].partition_dim for j in ex], [mps[j].full_shape for j in ex]
        dom = self._doms[st.wave.domain][1]
        updates: list[Tensor] = []
        with prof_range(wave_range_name(st.wave.index, "a2a_from_home"), nvtx=self.config.nvtx):
            if not ex:
                pass
            elif st.wave.index in self.teamed:
                plan = self._route_plans.setdefault(("from_team", st.wave.index, tuple(st.items)), {})
                updates = self._exchange(st, "a2a_from_home", dom, lambda: from_team(outs, pds, shapes, dom, plan))
            elif self._gathers(st.wave):
                updates = [local_shard(o, pd, dom) for o, pd in zip(outs, pds)]
            else:
                dup = self.dup_homes.get(st.wave.index, {})
                copies = st.copies if st.copies is not None else [(x, self._home(st.wave, st.items[j]))
                                                                  for x, j in enumerate(ex)]
                homes = [h for _, h in copies]
                cp, cpds, cshapes = ([v[x] for x, _ in copies] for v in (packed, pds, shapes))
                # a copy serves the ranks whose serving home it is; a single-homed matrix serves everyone
                serve = [frozenset(r for r, s in enumerate(dup[st.items[ex[x]]][1]) if s == h)
                         if st.items[ex[x]] in dup else frozenset(range(dom.size)) for x, h in copies] if dup else None
                plan = self._route_plans.setdefault(("from", st.wave.index, tuple(st.items)), {})
                got = self._exchange(
                    st, "a2a_from_home", dom,
                    lambda: from_homes(outs, st.mine, cp, homes, cpds, cshapes, dom,
                                       fused=self.config.fused_a2a, plan=plan, serve=serve),
                )
                me = dom.flat_rank
                updates = [None] * len(ex)
                for v, (x, _) in enumerate(copies):
                    if serve is None or me in serve[v]:
                        updates[x] = got[v]
            shared: list[Tensor] = []
            if ex or others:  # DP slots: every rank of the wave's replicas takes part (presence is agreed job-wide)
                shared = self._exchange(st, "dp_share", dom, lambda: self._dp_share(st, ex, updates, others)) \
                    if self.dp is not None and st.wave.domain == 0 else []
        by_pos = dict(zip(ex, updates)) | dict(zip(others, shared)) | dict(zip(rep, rep_outs))
        st.updates = [by_pos[j] for j in range(len(mps))]
        if self._eager_release:
            st.outs = st.packed = None

    def _dp_share(self, st: WaveState, ex: list[int], updates: list[Tensor], others: list[int]) -> list[Tensor]:
        """[Note: DP replicas as NS slots] This rank's blocks of the results its replica computed (``ex``, in
        ``updates``) go to the same-position rank of every other replica, which sends back its own: one
        ``all_to_all`` over the DP group of flat bf16 buffers. Returns the blocks of ``others``, in order."""
        dp = self.dp
        owner = {j: st.wave.homes[st.items[j]] % dp.size for j in ex + others}
        shapes = {j: tuple(self.muon[st.items[j]].local(self.muon[st.items[j]].param).shape) for j in owner}
        numel = {j: math.prod(shapes[j]) for j in owner}
        n = [sum(numel[j] for j in sorted(owner) if owner[j] == r) for r in range(dp.size)]
        device = self.muon[st.items[(ex + others)[0]]].local(self.muon[st.items[(ex + others)[0]]].param).device
        dtype = updates[0].dtype if updates else torch.bfloat16  # NS results are bf16 (overlap_muon.ns)
        send = torch.cat([u.reshape(-1) for u in updates]) if updates else torch.empty(0, dtype=dtype, device=device)
        recv = torch.empty(sum(n), dtype=dtype, device=device)
        dist.all_to_all_single(recv, send.repeat(dp.size), output_split_sizes=n, input_split_sizes=[send.numel()] * dp.size,
                               group=dp.group)
        parts = dict(zip(range(dp.size), recv.split(n)))
        got: dict[int, Tensor] = {}
        for r in range(dp.size):
            if r == dp.replica:
                continue
            mine = [j for j in sorted(owner) if owner[j] == r]
            for j, flat in zip(mine, parts[r].split([numel[j] for j in mine])):
                got[j] = flat.view(shapes[j])
        return [got[j] for j in others]

    def _apply_task(self, st: WaveState, lr: float | Tensor, weight_decay: float, adjust_lr_fn: str | None) -> None:
        if self.testing.before_apply is not None:
            self.testing.before_apply(st)
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

    def _gathers(self, wave: Wave) -> bool:
        return self.config.mode == "duplicated" or wave.index in self.gathered

    def _team_ns(self, work: list[tuple[list[Tensor], list[MuonParam]]], kw: dict[str, Any]) -> list[Tensor]:
        """[Note: team NS by columns] The wave's team blocks (``(P, Q)`` layout, :func:`team_block`) of its
        exchanged matrices: one norm all-reduce, then NS of all of them in lockstep, one Gram all-reduce per step.
        Collective over ``team_group``, in the same order on every rank. ``work`` is ``[(blocks, params)]`` (one
        entry, so that a testing wrapper sees one call)."""
        ((blocks, mps),) = work
        self.stats["ns_matrices"] += len(blocks)
        self.stats["ns_calls"] += len(blocks)
        tall = [m.full_shape[0] > m.full_shape[1] for m in mps]
        xs = [b.mT if t else b for b, t in zip(blocks, tall)]  # oriented: columns of X (rows of a tall update)
        k = dist.get_world_size(self.team_group) if self.team_group is not None else 1
        split = [team_splits_poly(m.full_shape, k, self.surplus_model) for m in mps]
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

    def _exchange(self, st: WaveState, phase: str, dom: Domain, fn: Callable[[], Any]) -> Any:
        """Run a collective; name the wave, the exchange, the group and the params in any error it raises."""
        try:
            return fn()
        except ValueError:
            raise  # bad input, already named (raised on every rank before the collective)
        except Exception as e:
            fused = self.config.fused_a2a
            gathers = self._gathers(st.wave)
            op = "all_gather" if gathers and st.wave.index not in self.teamed else "all_to_all"
            raise RuntimeError(
                f"OverlapMuon wave {st.wave.index} {phase} failed on rank {dist.get_rank()} "
                f"({'fused' if fused else 'two-stage'} {op} over the runtime's {self._group_desc(dom, gathers)}; "
                f"params {[self.muon[i].name for i in st.items]}): {e}"
            ) from e

    def _group_desc(self, dom: Domain, gathers: bool) -> str:
        if self.config.fused_a2a or gathers:
            g, what = dom.flat_group, "flat R x T group"
        else:
            g, what = dom.remat_group or dom.tp_group, "remat/TP groups"
        ranks = dist.get_process_group_ranks(g) if g is not None else [dist.get_rank()]
        return f"{what} {dom.remat_size}x{dom.tp_size}, global ranks {ranks}"

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
            self.testing.record("wait_begin", k)
            with prof_range(f"OverlapMuon::wait::wave{k}", nvtx=self.config.nvtx):
                _wait(st.h_apply, streams)
            self.testing.record("wait_end", k)
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

    def reset_plans(self) -> None:
        """The wave plan changed: route plans are per (wave, params), drop them."""
        self._route_plans.clear()
        self.gathered.clear()
        self.dup_homes = {}
        self.teamed.clear()

    def close(self) -> None:
        """Stop the lane threads once their queued tasks are done (does not wait for them)."""
        self.lanes.shutdown(wait=False)


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
