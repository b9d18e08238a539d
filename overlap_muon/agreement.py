"""Host-side agreement between the ranks: which waves are stale, and which params have a gradient.

Only host tensors on gloo groups: no device tensor is read or made. :class:`Agreement` is the wave pipeline's part
that does it; it reads the pipeline's params, groups and wave states.

[Note: gradient presence without the device] A param without a gradient is skipped (as ``torch.optim.Muon``
does), so which params take part is decided per rank, and ranks that disagree would post mismatched exchanges.
Each wave's ``to_home`` task first exchanges one byte per matrix with every peer on the domain's *gloo* group
(``Domain.ctrl_group``), built from ``param.grad is None`` on the host: no device tensor is read or made, so on
CUDA the launch never waits for the GPU. It runs on the lane (a worker thread on CPU); on CUDA, where lane work
is enqueued from the launching thread, it waits for the peers' hosts only.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .domain import MuonParam
from .reads import Hyper
from .wave_state import WaveState, wait_handle

__all__ = ["Agreement", "max_everywhere"]


class Agreement:
    """The agreement methods of ``WavePipeline`` (which provides ``muon``, ``adamw_params``, ``ctrl_group``,
    ``_expert_ctrl``, ``_doms``, ``_lock``, ``_applied``, ``_agreed``, ``_adamw_elsewhere`` and ``discard``)."""

    muon: list[MuonParam]
    state: Any
    adamw_params: list[Tensor]
    ctrl_group: Any
    _expert_ctrl: Any
    _agreed: bool
    _adamw_elsewhere: set[int]

    def stale(self, st: WaveState, hyper: Hyper) -> bool:
        """Would the wave compute something else if launched now? Its params with a gradient, then what its pack
        read ([Note: a wave's reads] in ``reads.py``). Host-side only."""
        items = [i for i in st.wave.params if self.muon[i].param.grad is not None]
        if items != st.items:
            return True
        return bool(items) and not st.reads.unchanged(self.state, hyper, [self.muon[i] for i in items])

    def _stale_flags(self, waves: list[Any], pending: dict[int, WaveState], hyper: Hyper, validate: bool
                     ) -> list[int]:
        """Per wave of the plan, 1 when ``commit`` must launch it again: it is not pending (discarded after backward
        launched it: ``load_state_dict``), or (``validate``) it is stale; agreed over the ranks (any rank's flag)."""
        if validate:
            for st in pending.values():
                if st.h_pack is not None and st.reads.buf_versions is None:
                    st.h_pack.settle()  # the pack records what it reads ([Note: a wave's reads])
        stale = [1 if w.index not in pending or validate and self.stale(pending[w.index], hyper) else 0 for w in waves]
        if self.ctrl_group is not None and not self._agreed:
            stale = self._agree_step(stale, pending)
        self._agreed = False
        return stale

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
        self._adamw_elsewhere = {id(p) for p, mine, any_ in zip(self.adamw_params, adamw, anywhere)
                                 if any_ and not mine}
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
        """The element-wise MAX of ``flags`` over every rank, in place (host tensors, gloo). A failure here (a dead or
        stalled peer) usually fails the pending waves' exchanges too: report the first of those, which names the wave and
        the exchange, else this one.

        Raises:
            RuntimeError: the agreement or a pending wave's exchange failed.
        """
        try:
            max_everywhere(flags, group)
        except Exception as e:
            with self._lock:
                states = list(self._applied.values()) + sorted(pending.values(), key=lambda st: st.wave.index)
            for st in states:
                for h in st.handles():
                    wait_handle(h, ())  # raises the wave's own error, chained
            ranks = dist.get_process_group_ranks(group)
            raise RuntimeError(
                f"OverlapMuon step(): agreeing on which waves to re-run failed on rank {dist.get_rank()} (all_reduce "
                f"over the runtime's gloo control group, global ranks {ranks}): {e}"
            ) from e

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


def max_everywhere(flags: Tensor, group: dist.ProcessGroup) -> None:
    """``flags`` (a 1-D CPU tensor) becomes its element-wise MAX over the ranks of ``group`` (gloo), in place.

    An all_to_all rather than an all_reduce: every rank hears from every peer directly, so a dead peer is a reset
    connection at once, not the timeout of a live ring neighbour stuck behind it.
    """
    world = dist.get_world_size(group)
    everyone = torch.empty(world * flags.numel(), dtype=flags.dtype)
    dist.all_to_all_single(everyone, flags.repeat(world), group=group)
    flags.copy_(everyone.view(world, -1).amax(dim=0))
