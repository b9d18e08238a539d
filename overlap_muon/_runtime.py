"""The runtime behind ``OverlapMuon``'s torch.optim surface: the plan, the hooks, and a step's launch, commit and
barrier over the wave pipeline.

``OverlapMuon`` (``optimizer.py``) holds one :class:`Runtime` and calls it; the runtime holds the optimizer only
weakly (its hooks must not keep a dropped optimizer alive).
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from . import _builder as builder, _version_fix as version_fix
from ._agreement import Agreement
from ._checks import check_plan_everywhere
from ._clip import ClipCount, clip_grads_by_total_norm_
from ._comm import CommContext
from ._placement import local_tensor
from ._forward_waits import ParamIndex
from ._ns_strategy import ns_strategies
from ._overlap_choice import overlap_choice
from ._pipeline import WavePipeline
from ._scheduler import BackwardCount, LearnedEdits, ReadinessRecorder, WaveDispatcher
from ._wave_state import Hyper
from ._wiring import Wiring

__all__ = ["Runtime", "StepPhase"]

class StepPhase(enum.Enum):
    """Where an ``OverlapMuon`` is in the training step (as FSDP2's ``TrainingState``)."""

    IDLE = enum.auto()
    """Between steps: backward's gradient-ready hooks launch waves, speculatively."""
    ACCUMULATING = enum.auto()
    """Inside ``no_sync()``: backward launches nothing (the last micro-batch's backward will)."""
    STEP = enum.auto()
    """Inside ``step()``: waves launched now are validated and committed by this call."""
    SYNC_STEP = enum.auto()
    """Inside a synchronous ``step()`` after its gradient-presence agreement: launched waves commit their momentum
    as they pack (nothing can make them stale)."""


class Runtime:
    """The plan, the hooks and the step's machinery of one optimizer; its verbs (``discard``, ``wait_for``,
    ``synchronize``, ...) are what the optimizer calls.

    Args:
        muon: the Muon params as placed.
        config: the options.
        stats: the optimizer's counters.
        state: the optimizer's state mapping (:meth:`set_state` when it is replaced).
        groups: returns the optimizer's param groups now (the Muon group's hyper-parameters are read at each
            launch and commit; the AdamW params' gradient presence is agreed too).
        comm: the groups (``_comm.build_comm``).
        ns_steps: for the NS cost.
    """

    def __init__(self, muon: list[Any], config: Any, stats: dict[str, int], state: Any,
                 groups: Callable[[], list[dict[str, Any]]], comm: CommContext, ns_steps: int) -> None:
        adamw_params = [p for g in groups()[1:] for p in g["params"]]
        self.muon, self.config, self._group = muon, config, lambda: groups()[0]
        device = local_tensor(muon[0].param).device if muon else torch.device("cpu")
        self.agreement = Agreement(muon, comm.ctrl, comm.expert[2] if comm.expert else None, adamw_params)
        self.pipeline = WavePipeline(muon, state, comm, config, device, stats, self.agreement)
        self.async_step = config.overlap and config.async_step
        self.sizes = (comm.dom_to.size, comm.expert[0].size if comm.expert else 1)
        self.dp_size = comm.dp.size if comm.dp is not None else 1
        self.per_node = comm.dom_to.nodes.ranks_per_node if comm.dom_to.nodes else None
        self.index = ParamIndex(muon)
        self.strategies = ns_strategies(muon, config, comm.dom_to, builder.cost_model(config.cost_model, device.type
                                        == "cuda"), stats)  # [Note: NS strategy per weight] in scheduler/strategy.py
        self.costs = [c if config.mode != "auto" or k == "home" else 0.0  # LPT balances the homes' work only
                      for c, k in zip(builder.ns_costs(muon, ns_steps, config.gram_ns), self.strategies.picks)]
        self.recorder = ReadinessRecorder(len(muon)) if config.readiness_order == "observed" else None
        self.phase = StepPhase.IDLE
        self.backwards = BackwardCount()  # [Note: learned accumulation] in scheduler/dispatch.py
        grads = lambda: [m.param.grad for m in muon]  # noqa: E731
        self.edits = LearnedEdits(lambda: version_fix.snapshot(grads()),  # [Note: learned clipping] in dispatch.py
                                  lambda then: version_fix.edited_since(then, grads()))
        self.clips = ClipCount()  # max_grad_norm's steps that clipped, read without a sync
        self.choice = overlap_choice(config, self.async_step, self.pipeline.lanes)  # [Note: overlap where it pays]
        self.wiring = Wiring(self)  # where readiness comes from, the forward waits, the version fix
        self.plan_waves(list(reversed(range(len(muon)))))
        self.stage_root = comm.stage_root
        check_plan_everywhere(muon, self.waves, [p.describe() for p in self.wave_plans], comm.stages)

    # verbs of the optimizer
    def discard(self) -> None:
        """Drop the waves launched since the last ``step()`` (``zero_grad()``, a reloaded state, a re-binding)."""
        self.pipeline.discard()
        self.dispatcher.reset()

    def wait_for(self, params: Any) -> None:
        """Wait until the committed updates of ``params`` (Muon params; others ignored) have landed."""
        self.pipeline.wait(self.index.waves_of(self.index.of_tensors(params)))

    def await_updates(self) -> None:
        """Wait until every committed update has landed (CPU: the host; CUDA: the current stream)."""
        self.pipeline.wait([w.index for w in self.waves])

    def synchronize(self) -> None:
        """Block until every committed wave is applied (``WavePipeline.synchronize``)."""
        self.pipeline.synchronize()

    def set_state(self, state: Any) -> None:
        """The optimizer's state mapping was replaced: the waves read and create momentum in ``state`` from now."""
        self.pipeline.state = state

    def register_wait(self, module: nn.Module, params: Any) -> None:
        """``async_step``: ``module``'s forward waits for ``params``' updates (nothing to do otherwise)."""
        if self.wiring.waits is not None:
            self.wiring.waits.register_wait(module, params)

    def plan_waves(self, order: list[int]) -> None:
        """Plan the waves for a gradient-ready ``order`` (``_builder.plan``); hand their frozen plans to the
        pipeline."""
        self.order = order
        self.waves, self.wave_plans = builder.plan(order, self.muon, self.costs, self.config, self.sizes,
                                                   self.dp_size, self.pipeline.lanes.cuda, self.per_node,
                                                   self.strategies)
        self.pipeline.set_plans(self.wave_plans)
        self.index.wave_of = {i: w.index for w in self.waves for i in w.params}
        self.dispatcher = WaveDispatcher(self.waves, self._launch)

    # hooks -> dispatcher -> pipeline
    def on_ready(self, first: int) -> None:
        if self.choice is not None and self.choice.result is None and not self.pipeline.lanes.capturing():
            self.choice.begin()  # [Note: overlap where it pays]: the iteration's clock starts
        if (self.phase is StepPhase.ACCUMULATING or not self.config.overlap or self.edits.hold
                or self.config.learn_accumulation and self.backwards.holds()):
            return
        if self.pipeline.lanes.capturing():
            self.wiring.warn_captured()
            return
        for i in self.index.siblings[first]:
            if self.dispatcher.launched > self.index.wave_of[i]:
                # A new backward before step(): its gradients supersede the waves already launched.
                self.pipeline.stats["reruns.extra_backward"] += self.dispatcher.launched
                self.pipeline.discard()
                self.dispatcher.reset()
            if self.recorder is not None:
                self.recorder.mark_ready(i)
            self.dispatcher.mark_ready(i)

    def on_backward_end(self) -> None:
        if self.pipeline.lanes.capturing():  # a replay runs no hook: count nothing, launch nothing
            return
        if not self._count_backward() and self.phase is not StepPhase.ACCUMULATING and self.config.overlap \
                and not self.edits.hold:
            self.dispatcher.flush()

    def on_ddp_backward_end(self) -> None:
        """Under an attached DDP: count the backward (learned accumulation), launch nothing (an unused param's
        gradient appears only in DDP's own end-of-backward work: ``step()`` flushes)."""
        self._count_backward()
        if self.wiring.ddp_copies:  # DDP's finalize_backward re-copied the bytes the waves read: new versions
            self.pipeline.rebase_grad_versions()

    def _count_backward(self) -> bool:
        """A backward ended ([Note: learned accumulation], [Note: learned clipping]); returns whether it was held
        (not expected to be the step's last)."""
        held = self.config.learn_accumulation and self.backwards.holds()
        self.backwards.backward_ended()
        self.edits.backward_ended()
        self.pipeline.stats["held_backwards"] += held
        return held

    def _launch(self, wave: Any) -> None:
        self.pipeline.launch(wave, Hyper.of(self._group()), committed=self.phase is StepPhase.SYNC_STEP)

    def set_phase(self, phase: StepPhase) -> StepPhase:
        """Move to ``phase`` (the gradient-ready hooks are off while accumulating); returns the phase before."""
        prev, self.phase = self.phase, phase
        if self.wiring.tracker is not None:
            self.wiring.tracker.enabled = phase is not StepPhase.ACCUMULATING
        return prev

    # the step: prepare, launch the rest, commit, then order the updates before what follows
    def prepare(self, max_grad_norm: float | None, params: list[Tensor]) -> tuple[bool, Tensor | None]:
        """Surface earlier lane errors; the non-finite check; the clip (``params`` in ``model.parameters()``
        order: the norm of the stacked norms depends on it, as in ``clip_grad_norm_``). Returns whether the step
        applies, and the norm before clipping (``None`` without ``max_grad_norm``)."""
        self.pipeline.reap()
        ok = self.agreement.all_finite() if self.config.skip_nonfinite else True
        norm = None
        if max_grad_norm is not None and ok:
            norm, clipped = clip_grads_by_total_norm_([p.grad for p in params if p.grad is not None], max_grad_norm)
            self.pipeline.stats["clipped_steps"] += self.clips.add(clipped)
        self.pipeline.stats["skipped_steps"] += not ok
        return ok, norm

    def launch_rest(self, ok: bool) -> bool:
        """Launch the waves backward did not. A synchronous step agrees on gradient presence once, first (one host
        collective per step instead of one per wave plus one), and its waves then skip their checks and commit their
        momentum as they pack (:attr:`StepPhase.SYNC_STEP`). Returns whether the step agreed so.

        Raises:
            ValueError: on every rank, the ranks disagree on gradient presence (nothing launched or applied).
        """
        agreed = ok and not self.config.overlap and not self.dispatcher.launched  # no wave launched this step yet
        if agreed:
            self.agreement.presence([], self.pipeline.in_flight)
            self.phase = StepPhase.SYNC_STEP
        try:
            self.dispatcher.flush()
        finally:
            self.phase = StepPhase.STEP
        return agreed

    def commit_step(self, max_grad_norm: float | None, clip_params: list[Tensor]) -> tuple[bool, Tensor | None, int]:
        """``step()`` up to its applies: :meth:`prepare`, :meth:`launch_rest`, :meth:`commit` (in
        :attr:`StepPhase.STEP`; :meth:`end_step` leaves it). Returns ``(applies, norm before clipping, reruns)``.

        Raises:
            RuntimeError: called inside a CUDA graph capture (before anything changes)."""
        self.pipeline.lanes.refuse_capture(
            "step() was called inside a CUDA graph capture, which its waves cannot run in (they wait on events and "
            "issue collectives a replay would not redo); nothing was changed. Capture the forward and backward only "
            "and call step() outside the graph")
        self.phase = StepPhase.STEP
        stats = self.pipeline.stats
        stats["edit_held_steps"] += self.edits.hold
        clipped = stats["clipped_steps"]
        ok, norm = self.prepare(max_grad_norm, clip_params)
        agreed = self.launch_rest(ok)
        reruns = self.commit(ok, agreed)
        if self.config.learn_clipping and self.config.overlap:  # [Note: learned clipping]: every rank alike
            self.edits.stepped(reruns, stats["clipped_steps"] > clipped, self.agreement.any_rank)
        return ok, norm, reruns

    def end_step(self) -> None:
        """Leave the step (also when it raised): backward's hooks launch speculative waves again, from the backward
        expected to be the last of the next step ([Note: learned accumulation] in ``scheduler/dispatch.py``)."""
        self.phase = StepPhase.IDLE
        self.backwards.stepped()

    def commit(self, ok: bool, agreed: bool = False) -> int:
        """Validate the waves (stale ones re-run) and queue their applies with the hyper-parameters of now;
        returns the number re-run."""
        return self.pipeline.commit(self.waves, self._group(), validate=self.config.overlap, skip=not ok,
                                    agreed=agreed)

    def finish(self) -> None:
        """Re-plan once from the observed order, then order the updates before what follows: the step barrier, or
        (``async_step``) the forward waits' policy and a wait for the gradient reads."""
        if self.recorder is not None and self.recorder.recorded:
            self._adopt_observed_order()
        self.dispatcher.reset()
        version_fix.end_step()  # the user's collectives of this step hold its gradients
        waits = self.wiring.waits
        if waits is None:
            self.barrier()
            if self.choice is not None:  # [Note: overlap where it pays]
                self.choice.after_step(self.agreement.ctrl_group, self._set_overlap, self.wiring.unhook_overlap,
                                       self.pipeline.stats)
            return
        waits.after_step([w.index for w in self.waves])
        waits.wait_gradients_read()  # the applies read no gradient: the user may zero them now

    def _set_overlap(self, on: bool) -> None:
        """Switch between launching the waves in backward (``on``) and the synchronous step (its plan, inline
        lanes). CPU: every task of the old plan finishes first (a discarded wave's exchange may still be running on
        a lane thread, and the next collectives must follow it on every rank). CUDA: its committed waves finish as
        they are (``WavePipeline.retire``: no host wait; every collective is enqueued from this thread, in order)."""
        if on == self.config.overlap:
            return
        if self.pipeline.lanes.cuda:
            self.pipeline.retire()
        else:
            self.pipeline.synchronize()
        self.config = dataclasses.replace(self.config, overlap=on)
        self.pipeline.lanes.inline = not on
        self.plan_waves(self.order)

    def barrier(self) -> None:
        """[Note: the step barrier] The default: ``step()`` orders its updates before anything after it, so every
        later reader (the next forward, ``model.unshard()``, a step post-hook, ``load_state_dict``, an averager, a
        second optimizer, user code) sees the updated weights. CPU: the host waits for every apply. CUDA: no host
        sync: the current stream waits on the apply events, and FSDP2's root pre-forward then makes its all-gather
        streams wait on the current stream (its ``set_post_optim_event`` would drop that wait, and with it the order
        of a write queued after ``step()``: torch 2.13, ``_fsdp_state.py``). What is given up is the overlap with
        the next forward (``async_step``)."""
        self.pipeline.wait([w.index for w in self.waves])

    def _adopt_observed_order(self) -> None:
        """After the first step: re-plan the waves with the readiness order the stage's first rank observed."""
        assert self.recorder is not None
        self.pipeline.synchronize()
        order = self.agreement.broadcast_order(self.recorder.order(), self.stage_root)
        self.recorder = None
        self.plan_waves(order)
