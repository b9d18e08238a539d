"""Host-side agreement between the ranks: which waves are stale, and which params have a gradient.

Only host tensors on gloo groups: no device tensor is read or made (one exception, named: :meth:`Agreement.all_finite`).
The runtime makes one :class:`Agreement` and hands it to the wave pipeline, which agrees through it at each wave's
launch and at ``step()``'s commit.

[Note: gradient presence without the device] A param without a gradient is skipped (as ``torch.optim.Muon``
does), so which params take part is decided per rank, and ranks that disagree would post mismatched exchanges.
Each wave's ``to_home`` task first exchanges one byte per matrix with every peer on the domain's *gloo* group
(``Domain.ctrl_group``), built from ``param.grad is None`` on the host: no device tensor is read or made, so on
CUDA the launch never waits for the GPU. It runs on the lane (a worker thread on CPU); on CUDA, where lane work
is enqueued from the launching thread, the launch posts it instead (``all_to_all`` with ``async_op``, run on gloo's
threads; :class:`PostedChecks`) and enqueues the wave's device work at a later launch once the flags are back, in
wave order, or at the latest when ``step()`` commits: a grad hook never waits for another rank's host.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from ._domain import Domain
from ._exchanges import run_collective
from ._lanes import LaneHandle
from ._placement import MuonParam
from ._wave_state import Hyper, WaveState

__all__ = ["Agreement", "PostedChecks", "max_everywhere"]

#: The launched waves whose own errors explain a failed agreement (the step's in flight, first committed ones).
InFlight = Callable[[], list[WaveState]]


class Agreement:
    """What the ranks agree on, host-side: which waves are stale, which params have a gradient, whether every
    gradient is finite.

    Args:
        muon: the Muon params.
        ctrl_group: a gloo group over every rank of the job (``None``: one process, nothing to agree).
        expert_ctrl: a gloo group over this rank's expert domain (``None``: no expert domain).
        adamw_params: the AdamW params, whose gradient presence the step's agreement also carries ([Note: lazy
            state] in ``_state.py``).
    """

    def __init__(self, muon: list[MuonParam], ctrl_group: dist.ProcessGroup | None,
                 expert_ctrl: dist.ProcessGroup | None, adamw_params: list[Tensor]) -> None:
        self.muon, self.ctrl_group, self.expert_ctrl = muon, ctrl_group, expert_ctrl
        self.adamw_params = adamw_params
        self._adamw_elsewhere: set[int] = set()

    def stale(self, st: WaveState, hyper: Hyper, state: Any) -> str | None:
        """Would the wave compute something else if launched now, and why (a cause of ``_messages.RERUN_CAUSES``)?
        Its params with a gradient, then what its pack read ([Note: a wave's reads] in ``_wave_state.py``).
        Host-side only."""
        items = [i for i in st.wave.params if self.muon[i].param.grad is not None]
        if items != st.items:
            return "grads_changed"
        return st.reads.change(state, hyper, [self.muon[i] for i in items]) if items else None

    def stale_flags(self, waves: list[Any], pending: dict[int, WaveState], hyper: Hyper, state: Any, *,
                    validate: bool, agreed: bool, in_flight: InFlight) -> list[str | None]:
        """Per wave of the plan, why ``commit`` must launch it again (``None``: it need not): it is not pending
        (``"discarded"`` after backward launched it: ``load_state_dict``), or (``validate``) it is stale; agreed
        over the ranks (``"other_rank"``: stale on another rank only) unless the step has ``agreed`` already (a
        synchronous step: nothing can be stale).

        Raises:
            ValueError: as :meth:`presence`.
        """
        if validate:
            for st in pending.values():
                if st.h_pack is not None and st.reads.buf_versions is None:
                    st.h_pack.settle()  # the pack records what it reads ([Note: a wave's reads])
        why = ["discarded" if w.index not in pending else self.stale(pending[w.index], hyper, state) if validate
               else None for w in waves]
        if validate:
            why = self._content(waves, pending, why)
        if self.ctrl_group is not None and not agreed:
            flags = self.presence([0 if c is None else 1 for c in why], in_flight)
            why = [c or ("other_rank" if f else None) for c, f in zip(why, flags)]
        return why

    @staticmethod
    def _content(waves: list[Any], pending: dict[int, WaveState], why: list[str | None]) -> list[str | None]:
        """``why`` with ``"content"`` for each wave the records found unchanged whose bytes differ now ([Note:
        content fingerprints] in ``_wave_state.py``): one host read of every wave's flag together (on CUDA, one
        sync per step)."""
        checks: list[tuple[int, Tensor]] = []
        for k, w in enumerate(waves):
            st = pending.get(w.index)
            if why[k] is not None or st is None or st.h_pack is None or not st.items:
                continue
            st.h_pack.settle()
            if st.reads.fp is None:
                continue  # a pack that failed (its error surfaces with the wave's)
            if st.h_pack.event is not None:
                st.h_pack.wait()  # CUDA: the current stream after the pack's fingerprint
            checks.append((k, st.reads.content_changed()))
        if not checks:
            return why
        flags = torch.stack([c.to(checks[0][1].device) for _, c in checks]).tolist()
        out = list(why)
        for (k, _), changed in zip(checks, flags):
            if changed:  # [Note: a clip that does not bite] in _version_fix.py: a device clip that bit
                out[k] = "grad_edited:clip_grad_norm_" if pending[waves[k].index].reads.clipped else "content"
        return out

    def post_check(self, st: WaveState, dom: Domain) -> Callable[[], None]:
        """:meth:`check_wave` posted without blocking: returns its verdict (waits for the flags, raises as
        :meth:`check_wave` does); the flags are back when ``verdict.done()``."""
        names = [self.muon[i].name for i in st.wave.params]
        posted = run_collective(lambda: self._post(st, dom, wait=False), f"wave {st.wave.index} a2a_to_home", names,
                                dom, "all_to_all", True)

        def verdict() -> None:
            run_collective(lambda: self._verdict(st, dom, posted), f"wave {st.wave.index} a2a_to_home", names, dom,
                           "all_to_all", True)

        verdict.done = posted[1].is_completed  # type: ignore[attr-defined]
        return verdict

    def any_rank(self, flag: bool) -> bool:
        """Whether ``flag`` holds on any rank (one host flag, a max over the runtime's gloo group): a decision every
        rank must take alike ([Note: learned clipping] in ``scheduler/dispatch.py``)."""
        if self.ctrl_group is None:
            return flag
        flags = torch.tensor([1 if flag else 0], dtype=torch.uint8)
        self._agree(flags, self.ctrl_group, lambda: [])
        return bool(flags[0])

    def broadcast_order(self, order: list[int], src: int) -> list[int]:
        """The readiness ``order`` rank ``src`` observed (the stage's first rank; rank 0 without stages), on every
        rank: ranks can observe different orders, and every rank must plan the same waves."""
        box = [order]
        if self.ctrl_group is not None:
            dist.broadcast_object_list(box, src=src, group=self.ctrl_group)
        return list(box[0])

    def adamw_elsewhere(self) -> set[int]:
        """``id``s of the AdamW params that had a gradient on another rank and not on this one at the last step's
        agreement ([Note: lazy state] in ``_state.py``); read once."""
        out, self._adamw_elsewhere = self._adamw_elsewhere, set()
        return out

    def presence(self, stale: list[int], in_flight: InFlight) -> list[int]:
        """The step's one host-side collective (an element-wise MAX over every rank, gloo, no device tensor): which
        waves any rank finds stale (``stale``: this rank's flags), and whether the ranks agree on which params have
        a gradient: a mismatch is a ValueError on every rank here, before anything is applied (the per-wave check
        on the lane only keeps the exchanges from hanging). A synchronous step calls it before it launches its
        waves, which then skip their per-wave checks. Expert matrices differ between EP ranks: their presence is
        agreed within the expert domain first (every rank, in that order), and a mismatch there travels in the
        job-wide flags as one more flag.

        Returns:
            The job-wide stale flags.

        Raises:
            ValueError: some Muon params have a gradient on some ranks and not on others (nothing applied).
        """
        if self.ctrl_group is None:
            return stale
        dense = [m for m in self.muon if m.domain == 0]
        experts = [m for m in self.muon if m.domain == 1]
        split = self._split_presence(experts, self.expert_ctrl, in_flight) if self.expert_ctrl else []
        have = [1 if m.param.grad is not None else 0 for m in dense]
        adamw = [1 if p.grad is not None else 0 for p in self.adamw_params]
        flags = torch.tensor(stale + have + [1 - h for h in have] + adamw + [1 if split else 0], dtype=torch.uint8)
        self._agree(flags, self.ctrl_group, in_flight)
        n, k, a = len(stale), len(have), len(adamw)
        split += [m.name for m, x, y in zip(dense, flags[n:n + k].tolist(), flags[n + k:n + 2 * k].tolist()) if x and y]
        anywhere = flags[n + 2 * k:n + 2 * k + a].tolist()
        self._adamw_elsewhere = {id(p) for p, mine, any_ in zip(self.adamw_params, adamw, anywhere)
                                 if any_ and not mine}
        if split or flags[-1]:
            raise ValueError(
                f"OverlapMuon step(): Muon params {split[:8] or '(on another rank)'}{' ...' if len(split) > 8 else ''} "
                "have a gradient on some ranks and not on others; every rank holding a param (every rank of its "
                "domain, and of every replica of it) must compute its gradient. Nothing was applied."
            )
        return flags[:n].tolist()

    def _split_presence(self, mps: list[MuonParam], group: dist.ProcessGroup, in_flight: InFlight) -> list[str]:
        """Names of the params of ``mps`` that have a gradient on some ranks of ``group`` and not on others."""
        have = [1 if m.param.grad is not None else 0 for m in mps]
        flags = torch.tensor(have + [1 - h for h in have], dtype=torch.uint8)
        self._agree(flags, group, in_flight)
        k = len(have)
        return [m.name for m, a, b in zip(mps, flags[:k].tolist(), flags[k:].tolist()) if a and b]

    @staticmethod
    def _agree(flags: Tensor, group: dist.ProcessGroup, in_flight: InFlight) -> None:
        """:func:`max_everywhere`. A failure here (a dead or stalled peer) usually fails the waves in flight too:
        report the first of those, which names the wave and the exchange, else this one.

        Raises:
            RuntimeError: the agreement or a wave in flight failed.
        """
        try:
            max_everywhere(flags, group)
        except Exception as e:
            for st in in_flight():
                for h in st.handles():
                    h.wait()  # raises the wave's own error, chained
            ranks = dist.get_process_group_ranks(group)
            raise RuntimeError(
                f"OverlapMuon step(): agreeing on which waves to re-run failed on rank {dist.get_rank()} (an "
                f"element-wise max over the runtime's gloo control group, global ranks {ranks}): {e}"
            ) from e

    def check_wave(self, st: WaveState, dom: Domain) -> None:
        """Raise on every rank of the wave's domain ``dom`` if its ranks disagree on which params of the wave have a
        gradient. Host-side only ([Note: gradient presence without the device]): CPU uint8 flags, one
        ``all_to_all`` on the domain's gloo group (every rank hears from every peer directly, so a dead peer shows
        at once).

        Raises:
            ValueError: some params have a gradient on some ranks of the domain and not on others.
            RuntimeError: the collective failed (naming the wave, the group and the params).
        """
        params = st.wave.params
        names = [self.muon[i].name for i in params]
        run_collective(lambda: self._check(st, dom), f"wave {st.wave.index} a2a_to_home", names, dom, "all_to_all",
                       True)

    def _check(self, st: WaveState, dom: Domain) -> None:
        self._verdict(st, dom, self._post(st, dom, wait=True))

    @staticmethod
    def _post(st: WaveState, dom: Domain, wait: bool) -> tuple[Tensor, Any]:
        """Send this rank's flags to every peer: ``(everyone's flags, the collective's work or None)``."""
        n = dist.get_world_size(dom.ctrl_group)  # the domain, or (DP slots) every replica of it
        have = torch.tensor([1 if i in st.items else 0 for i in st.wave.params], dtype=torch.uint8)
        everyone = torch.empty(n * have.numel(), dtype=torch.uint8)
        work = dist.all_to_all_single(everyone, have.repeat(n), group=dom.ctrl_group, async_op=not wait)
        return everyone.view(n, -1), work

    def _verdict(self, st: WaveState, dom: Domain, posted: tuple[Tensor, Any]) -> None:
        table, work = posted
        if work is not None:
            work.wait()
        params = st.wave.params
        agree = (table == table[0]).all(dim=0).tolist()
        split = [self.muon[i].name for i, ok in zip(params, agree) if not ok]
        if split:
            raise ValueError(
                f"Muon params {split} have a gradient on some ranks of the {dom.remat_size}x{dom.tp_size} domain "
                f"and not on others (this rank: {[self.muon[i].name for i in st.items if self.muon[i].name in split]} "
                "have one); every rank of a domain must compute the same params' gradients"
            )

    def all_finite(self) -> bool:
        """True when every Muon gradient on every rank is finite (``skip_nonfinite``): device flags, one max of them
        over every rank on the gloo control group. Reads one flag on the host: on CUDA a sync, once per step; the
        option is off by default."""
        grads = [m.local(m.param.grad) for m in self.muon if m.param.grad is not None]
        bad = torch.stack([~torch.isfinite(g).all() for g in grads]).any() if grads else torch.tensor(False)
        flag = bad.to("cpu", torch.uint8).reshape(1)
        if self.ctrl_group is not None:
            max_everywhere(flag, self.ctrl_group)
        return int(flag[0]) == 0


def max_everywhere(flags: Tensor, group: dist.ProcessGroup) -> None:
    """``flags`` (a 1-D CPU tensor) becomes its element-wise MAX over the ranks of ``group`` (gloo), in place.

    An all_to_all rather than an all_reduce: every rank hears from every peer directly, so a dead peer is a reset
    connection at once, not the timeout of a live ring neighbour stuck behind it.
    """
    world = dist.get_world_size(group)
    everyone = torch.empty(world * flags.numel(), dtype=flags.dtype)
    dist.all_to_all_single(everyone, flags.repeat(world), group=group)
    flags.copy_(everyone.view(world, -1).amax(dim=0))


class PostedChecks:
    """The waves whose presence check is posted ([Note: gradient presence without the device]), in wave order, each
    with the function that enqueues its tasks once the check is back (its ``h_check`` then holds the check's error,
    which the wave's tasks carry, as a failed lane task's).

    Args:
        cuda: the lanes are CUDA streams (on CPU the check is the wave's first lane task).
        domains: the runtime's domains (dense, expert).
    """

    def __init__(self, cuda: bool, domains: list[Domain]) -> None:
        self._queue: list[tuple[WaveState, Callable[[], None], Callable[[], None]]] = []
        self.post = [cuda and d.ctrl_group is not None and d.flat_group is not None
                     and dist.get_backend(d.flat_group) != "gloo" for d in domains]
        """Per domain: post the checks. Only where the check's gloo group is its own: on a group the exchanges use
        too (a gloo job), the order of a later wave's check and an earlier wave's exchange would follow timing."""

    def add(self, st: WaveState, verdict: Callable[[], None], submit: Callable[[], None]) -> None:
        self._queue.append((st, verdict, submit))
        self.advance()

    def advance(self, block: bool = False) -> None:
        """Enqueue the tasks of the leading waves whose flags are back (every wave's with ``block``: the host waits
        for the flags). Every rank enqueues every posted wave, in order, whatever the timing."""
        while self._queue and (block or self._queue[0][1].done()):  # type: ignore[attr-defined]
            st, verdict, submit = self._queue.pop(0)
            st.h_check = LaneHandle("to_home")
            try:
                verdict()
            except Exception as e:  # noqa: BLE001 - raised at the next wait, as a lane task's error
                st.h_check.error = e
            submit()
