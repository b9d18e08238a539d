"""Learned gradient accumulation wherever backward runs: NS once per matrix per step from step 2, equal to
``torch.optim.Muon`` + ``torch.optim.AdamW`` after every step ([Note: learned accumulation] in
``scheduler/dispatch.py``; [Note: end of backward] in ``hooks/grad_ready.py``)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from tests.models import ADAMW_KW, HP
from tests.seams import SeamedOverlapMuon as OverlapMuon

STEPS, MICRO = 4, 2


def _accumulated_step(pairs, xs: list[torch.Tensor]) -> None:
    """One step of ``len(xs)`` micro-batches on each ``(model, optimizers)`` pair, each loss divided by MICRO."""
    for m, opts in pairs:
        for x in xs:
            (m(x).pow(2).mean() / MICRO).backward()
        for o in opts:
            o.step()
        for o in opts:
            o.zero_grad()


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 32, bias=False)
        self.b = nn.Linear(32, 16, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class _Checkpointed(nn.Module):
    """Every Muon matrix inside a reentrant checkpoint (``use_reentrant=True``, as Hugging Face's
    ``gradient_checkpointing_kwargs={"use_reentrant": True}``): their hooks fire in nested graph tasks only."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])
        self.head = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=True)
        return self.head(x)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["default", "async_step"])
def test_reentrant_checkpointing_learns_the_accumulation(mode):
    """Bug: the end of a nested graph task was ignored and no hook fired in the outer one, so the accumulation was
    never learned: NS twice per step for every matrix, 0 held backwards, re-runs blamed on a changed count."""
    torch.manual_seed(0)
    model = _Checkpointed()
    ref = copy.deepcopy(model)
    opt = OverlapMuon(model, adamw_kwargs=ADAMW_KW, async_step=mode == "async_step", **HP)
    mats = set(opt.muon_param_names)
    named = dict(ref.named_parameters())
    refs = [torch.optim.Muon([p for n, p in named.items() if n in mats], **HP),
            torch.optim.AdamW([p for n, p in named.items() if n not in mats], **ADAMW_KW)]
    ns = []
    for s in range(STEPS):
        before = opt.stats["ns_matrices"]
        xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(10 * s + k)) for k in range(MICRO)]
        _accumulated_step(((model, [opt]), (ref, refs)), xs)
        opt.synchronize()
        ns.append(opt.stats["ns_matrices"] - before)
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters())), s
    assert ns[1:] == [len(mats)] * (STEPS - 1), ns
    assert opt.stats["held_backwards"] == STEPS - 1
    opt.close()


def _ddp_attached_body(rank, world, mode):
    """``OverlapMuon(ddp_model)`` (DDP with ``gradient_as_bucket_view=True``), two micro-batches per step without
    ``no_sync()``: DDP averages both (as torch's loop does); the waves launch from the last one only."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from tests.models import TinyNet
    from tests.test_wave_inputs import _diff, _ref_opts

    torch.manual_seed(0)
    base = TinyNet()
    ref = copy.deepcopy(base)
    ddp = DDP(base, gradient_as_bucket_view=True)
    opt = OverlapMuon(ddp, adamw_kwargs=ADAMW_KW, async_step=mode == "async_step", **HP)
    ref_ddp, ref_opts = DDP(ref, gradient_as_bucket_view=True), _ref_opts(ref)
    ns, bad = [], None
    for s in range(STEPS):
        before = opt.stats["ns_matrices"]
        xs = [torch.randn(4, 12, generator=torch.Generator().manual_seed(40 * s + 10 * k + rank)) for k in range(MICRO)]
        _accumulated_step(((ddp, [opt]), (ref_ddp, ref_opts)), xs)
        opt.synchronize()
        ns.append(opt.stats["ns_matrices"] - before)
        bad = bad or (_diff(base, ref) and (s, _diff(base, ref)))
    out = bad, ns, opt.stats["held_backwards"], len(opt.muon_param_names), opt.stats["reruns"]
    opt.close()
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["default", "async_step"])
def test_ddp_attached_accumulation_without_no_sync(mode):
    """Bug: under an attached DDP no end of backward was counted, so every micro-batch launched the waves: NS twice
    per step on every step, each blamed on "the accumulation count changed"."""
    from tests.dist_utils import run_ranks

    for bad, ns, held, mats, reruns in run_ranks(_ddp_attached_body, 2, mode, timeout=200):
        assert not bad, bad
        assert ns[1:] == [mats] * (STEPS - 1) and held == STEPS - 1, (ns, held)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("other", [dict(async_step=True), dict(overlap=False), dict(wave_slots=1)])
def test_auto_overlap_with_an_option_that_decides_says_which_wins(other):
    """Bug: ``auto_overlap=True`` with ``async_step=True`` ran no trial, recorded nothing and said nothing."""
    import warnings

    from tests.models import TinyNet

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = OverlapMuon(TinyNet(), auto_overlap=True, **other, **HP)
    said = [str(w.message) for w in caught if "auto_overlap" in str(w.message)]
    assert len(said) == 1 and "which wins" in said[0] and next(iter(other)) in said[0], said
    opt.close()


@pytest.mark.timeout(60)
def test_auto_overlap_is_the_default_unless_a_mode_is_chosen():
    """``auto_overlap`` is on by default: a default optimizer runs the trial and keeps a mode (bitwise either way);
    an ``overlap`` the user sets decides without a trial and without a warning."""
    import warnings

    from tests.models import TinyNet
    from tests.test_wave_inputs import _diff, _ref_opts

    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    opt, refs = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **HP), _ref_opts(ref)
    assert opt.config.auto_overlap and opt.config.sources["auto_overlap"] == "default"
    for s in range(16):  # one untimed step, 5 + 1 + 5 trial iterations, then the choice
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
        for m, opts in ((model, [opt]), (ref, refs)):
            m(x).pow(2).mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
        assert not _diff(model, ref), s
    assert "overlap_auto_chose_on" in opt.stats and opt.stats["overlap_auto_on_us"] > 0, dict(opt.stats)
    opt.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        chosen = OverlapMuon(TinyNet(), overlap=True, **HP)
    assert chosen._rt.choice is None
    chosen.close()


def test_superseded_launches_never_read_as_more_reruns_than_waves():
    """Bug: "18 of 6 waves re-ran in step()": the extra backwards re-launched the waves during backward, several
    times a step. The message now counts launches and says so."""
    import warnings
    from collections import defaultdict

    from overlap_muon._messages import rerun_warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rerun_warnings(defaultdict(int, {"reruns.extra_backward": 18, "reruns.grad_edited": 9, "steps": 3}), {},
                       set(), 6)
    said = sorted(str(w.message) for w in caught)
    assert "18 wave launches (the plan has 6 waves a step) were superseded before step()" in said[0], said
    assert "6 of 6 waves re-ran in step()" in said[1], said


def _clip_run(how: str, steps: int = 5, bite_until: int = 99, before_clip=None, **kw):
    """Clip every step by ``max_grad_norm`` (``how="max_grad_norm"``) or by the user's ``clip_grad_norm_`` between
    backward and ``step()``; the bound bites for steps ``< bite_until`` and not after. Returns the first differing
    step, NS matrices per step, the Muon matrix count and the optimizer's stats."""
    from tests.models import TinyNet
    from tests.test_wave_inputs import _diff, _ref_opts

    torch.manual_seed(0)
    model = TinyNet()
    ref = copy.deepcopy(model)
    kw = dict(kw, max_grad_norm=1e-3) if how == "max_grad_norm" else kw
    opt, refs = OverlapMuon(model, adamw_kwargs=ADAMW_KW, **kw, **HP), _ref_opts(ref)
    ns, bad, speculated = [], None, []
    for s in range(steps):
        bound = 1e-3 if s < bite_until else 1e6
        if how == "max_grad_norm":
            opt.max_grad_norm = bound
        before = opt.stats["ns_matrices"]
        x = torch.randn(4, 12, generator=torch.Generator().manual_seed(s))
        for m, opts in ((model, [opt]), (ref, refs)):
            launched = opt.stats["waves_launched"]
            m(x).pow(2).mean().backward()
            if m is model:
                speculated.append(opt.stats["waves_launched"] > launched)  # launched in backward
                if before_clip is not None:
                    before_clip(opt)
            if how == "user" or m is ref:
                torch.nn.utils.clip_grad_norm_(m.parameters(), bound)
            for o in opts:
                o.step()
                o.zero_grad()
        ns.append(opt.stats["ns_matrices"] - before)
        bad = bad or (_diff(model, ref) and (s, _diff(model, ref)))
    out = bad, ns, len(opt.muon_param_names), dict(opt.stats), speculated
    opt.close()
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["max_grad_norm", "user"])
def test_learned_clipping(how):
    """Bug: a clip that bites every step threw every speculative wave away and re-ran it in ``step()``: NS twice
    per matrix per step. Now ([Note: learned clipping] in ``scheduler/dispatch.py``) the step after a biting clip
    launches its waves in ``step()``, after the clip: NS once per step from step 2; once the clip stops biting,
    the next step speculates again. Bitwise equal to torch after every step."""
    bad, ns, mats, stats, speculated = _clip_run(how, steps=6, bite_until=3)
    assert not bad, bad
    assert ns == [2 * mats, mats, mats, mats, mats, mats], ns
    assert stats["edit_held_steps"] == 3 and stats["reruns"] == mats, stats  # steps 1-3 held; step 3 unclipped
    assert speculated == [True, False, False, False, True, True], speculated


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["user", "max_grad_norm"])
@pytest.mark.parametrize("content_check", [True, False])
def test_clip_on_a_device_reads_no_coefficient(monkeypatch, how, content_check):
    """Bug: the process-wide wrapper of ``clip_grads_with_norm_`` read the clip coefficient on the host in every
    user clip (on CUDA a sync per ``clip_grad_norm_`` call, also in loops without OverlapMuon), and so did
    ``max_grad_norm`` in every step. Now, where that read is not free ([Note: a clip that does not bite] in
    ``_version_fix.py``; CPU patched to act as a device here), the gradients are multiplied as always; the waves the
    clip moved are judged by their content fingerprints, and held steps by the clip's flag read behind an event.
    Same bits, same schedule as with the host read: a clip that does not bite re-runs nothing. Without the content
    check every clipped wave re-runs (exact, slower)."""
    from overlap_muon import _clip as clip, _version_fix as version_fix
    def packs_done(opt):  # a pack that ran after the clip read the clipped bytes: no re-run, and no hold after it
        for st in list(opt._rt.pipeline._pending.values()):
            if st.h_pack is not None:
                st.h_pack.settle()

    monkeypatch.setattr(version_fix, "host_read_free", lambda device: False)
    monkeypatch.setattr(clip, "host_read_free", lambda device: False)
    bad, ns, mats, stats, speculated = _clip_run(how, steps=6, bite_until=3, before_clip=packs_done,
                                                 content_check=content_check)
    assert how == "user" or stats["clipped_steps"] == 3, stats
    assert not bad, bad
    if content_check:
        assert speculated == [True, False, False, False, True, True], speculated
        assert ns == [2 * mats, mats, mats, mats, mats, mats], ns
        assert stats["reruns"] == stats["reruns.grad_edited:clip_grad_norm_"] == mats, stats
    else:  # step 5 re-runs too (by its counters), so step 6 is held; its clip did not bite
        assert speculated == [True, False, False, False, True, False], speculated
        assert ns == [2 * mats, mats, mats, mats, 2 * mats, mats], ns
