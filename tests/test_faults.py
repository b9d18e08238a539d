"""Faults: process-group timeouts, a rank dying or stalling mid-step, an exception inside a lane.

The runtime must never hang: every process group it creates carries ``pg_timeout_s``, a peer that dies or
stalls makes every other rank raise an error naming the exchange that was waiting (``OverlapMuon wave k
a2a_to_home|a2a_from_home failed ...``), and a lane's exception reaches the main thread with its traceback
chained. Timings (kill -> error on each surviving rank) are printed; run with ``pytest -s`` to see them.
"""

from __future__ import annotations

import os
import re
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from tests.seams import SeamedOverlapMuon as OverlapMuon, TestingSeam
from tests.dist_utils import run_ranks
from tests.models import ADAMW_KW, HP, MUON_2D, PlainShardNet, TinyNet, build_dtensor_model, explicit_groups

EXCHANGE_RE = re.compile(r"OverlapMuon wave \d+ (a2a_to_home|a2a_from_home) failed")


def _chain(e: BaseException) -> list[str]:
    """Messages of ``e`` and of its ``__cause__`` chain."""
    out = []
    while e is not None:
        out.append(f"{type(e).__name__}: {e}")
        e = e.__cause__
    return out


def _write(path: str, value: float) -> None:
    with open(path + ".tmp", "w") as f:
        f.write(repr(value))
    os.replace(path + ".tmp", path)  # atomic: a reader never sees a half-written file


def _read(path: str) -> float | None:
    try:
        with open(path) as f:
            return float(f.read())
    except FileNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------------------------
# every group the runtime creates carries the configured timeout
# ---------------------------------------------------------------------------------------------------------------
def _new_group_timeouts(make):
    """``(make(), timeouts in seconds of the process groups make() created)``.

    Reads the c10d registry (``_world.pg_map``) and each gloo backend's options; private torch API, checked on
    torch 2.13. A group this rank is not a member of is not registered, so each rank sees its own groups.
    """
    reg = dist.distributed_c10d._world.pg_map
    before = set(reg)
    obj = make()
    new = [pg for pg in reg if pg not in before]
    return obj, [pg._get_backend(torch.device("cpu")).options._timeout.total_seconds() for pg in new]


def _groups_per_rank(R, T):
    """Groups the runtime creates that hold a given rank: (remat, tp, flat) for the to-home and the from-home
    lane ([Note: one process-group set per communicating lane] in _lanes.py) + the control group; size-1 groups
    are not created."""
    return 2 * ((R > 1) + (T > 1) + 1) + 1


def _check_timeouts(timeouts: dict[str, list[float]], R: int, T: int, want: float) -> list[str]:
    bad = []
    for tag, ts in timeouts.items():
        if len(ts) != _groups_per_rank(R, T):
            bad.append(f"{tag}: {len(ts)} runtime groups hold this rank, expected {_groups_per_rank(R, T)}")
        if any(x != want for x in ts):
            bad.append(f"{tag}: group timeouts {ts} s, expected {want} s")
    return bad


# ---------------------------------------------------------------------------------------------------------------
# a rank dies or stalls mid-step
# ---------------------------------------------------------------------------------------------------------------
PG_TIMEOUT_S = 10.0  # kills: a dead peer is noticed by the transport at once, long before this
STALL_TIMEOUT_S = 5.0  # stall: only the timeout frees the others, so it sets the test's length
SCHED_SLACK_S = 5.0  # past a timeout, the time a loaded machine may take to deliver the error (not a speed claim)
FAULT_STEP = 1


class _Fault(torch.autograd.Function):
    """Identity whose backward calls ``action()``: a fault in the middle of backward, after the waves of the
    layers whose gradients came first have been launched."""

    @staticmethod
    def forward(ctx, y, action):
        ctx.action = action
        return y.view_as(y)

    @staticmethod
    def backward(ctx, gy):
        ctx.action()
        return gy, None


def _loss(net, cs, action=None):
    """PlainShardNet's loss; with ``action``, l2's output passes through :class:`_Fault` (backward reaches l5, l4,
    l3 first: later nodes run first on the CPU engine)."""
    loss = (net.scale * cs["scale"]).sum()
    for n in net.SHAPES:
        y = getattr(net, n)(cs[n])
        if action is not None and n == "l2":
            y = _Fault.apply(y, action)
        loss = loss + y
    return loss


def _fault_body(rank, world, R, T, point, fused, timeout_from_env, check_dtensor, tmp):
    """Rank 1 faults at step FAULT_STEP; the others train on and must raise (not hang).

    point: ``"kill_backward"`` (os._exit inside backward), ``"kill_after_step"`` (os._exit right after step()
    returned, its waves in flight), ``"stall_backward"`` (rank 1 sleeps inside backward until the others
    reported, so only the group timeout can free them).

    Returns (survivors): the error time, where it surfaced, its message chain, and the timeouts of the groups
    the runtime created (from ``pg_timeout_s`` or, with ``timeout_from_env``, OVERLAP_MUON_PG_TIMEOUT_S).
    """
    g, t = divmod(rank, T)
    pg_timeout = STALL_TIMEOUT_S if point.startswith("stall") else PG_TIMEOUT_S
    kw = {} if timeout_from_env else {"pg_timeout_s": pg_timeout}
    timeouts = {}
    if check_dtensor:
        torch.manual_seed(0)
        model, mesh = build_dtensor_model(TinyNet(), R, T)
        o, timeouts["dtensor"] = _new_group_timeouts(
            lambda: OverlapMuon(model, device_mesh=mesh, adamw_kwargs=ADAMW_KW, **HP, **kw)
        )
        o.close()
    net = PlainShardNet(R, T, g, t)
    tp, rm = explicit_groups(R, T, g, t)
    # An NS delay keeps each wave in flight long enough that a fault lands while exchanges are pending.
    opt, timeouts["plain"] = _new_group_timeouts(
        lambda: OverlapMuon(net, adamw_kwargs=ADAMW_KW, tp_group=tp, remat_group=rm, overlap=True, fused_a2a=fused,
                            _testing=TestingSeam(ns_delay_s=0.2), **MUON_2D, **HP, **kw)
    )
    fault_file = os.path.join(tmp, "fault_time")

    def die():
        _write(fault_file, time.time())
        os._exit(17)

    def stall():
        _write(fault_file, time.time())
        deadline = time.time() + 3 * pg_timeout + 20
        while time.time() < deadline:
            if all(os.path.exists(os.path.join(tmp, f"done_{r}")) for r in range(world) if r != rank):
                break
            time.sleep(0.1)
        os._exit(17)

    where = "end"
    res = {"t_err": None, "chain": [], "timeouts": timeouts}
    try:
        for s in range(4):
            cs, _ = net.local_grads(s)
            action = None
            if rank == 1 and s == FAULT_STEP:
                action = {"kill_backward": die, "stall_backward": stall}.get(point)
            where = f"step {s} forward"
            loss = _loss(net, cs, action)
            where = f"step {s} backward"
            loss.backward()
            where = f"step {s} step()"
            opt.step()
            opt.zero_grad()
            if rank == 1 and s == FAULT_STEP and point == "kill_after_step":
                die()
        where = "synchronize()"
        opt.synchronize()
    except RuntimeError as e:
        res.update(t_err=time.time(), chain=_chain(e))
    res["where"] = where
    _write(os.path.join(tmp, f"done_{rank}"), time.time())
    return res


# world, R, T, point, fused, timeout from env, also check a DTensor optimizer's groups
# The default tier keeps a death at world 4 (DTensor, timeout from the environment) and a stall at world 2; the
# others join the long tier (-m slow).
FAULTS = [
    pytest.param(2, 1, 2, "kill_backward", True, False, False, marks=pytest.mark.slow),
    (4, 2, 2, "kill_backward", True, True, True),
    pytest.param(4, 2, 2, "kill_after_step", False, True, False, marks=pytest.mark.slow),
    (2, 1, 2, "stall_backward", True, False, False),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(
    "world,R,T,point,fused,from_env,dtensor",
    FAULTS,
    ids=[f"{f[0]}-{f[3]}-{'fused' if f[4] else 'two_stage'}" for f in (getattr(f, "values", f) for f in FAULTS)],
)
def test_peer_fault_raises_naming_the_exchange(world, R, T, point, fused, from_env, dtensor, tmp_path):
    """Regression for a hang: a peer that dies (or stalls) mid-step must make every other rank raise, within the
    group timeout, an error naming the wave and the exchange that was waiting. Also checks that every group
    the runtime created carries the configured timeout (argument or OVERLAP_MUON_PG_TIMEOUT_S)."""
    pg_timeout = STALL_TIMEOUT_S if point.startswith("stall") else PG_TIMEOUT_S
    env = {"OVERLAP_MUON_PG_TIMEOUT_S": str(pg_timeout)} if from_env else {}
    t0 = time.time()
    res = run_ranks(_fault_body, world, R, T, point, fused, from_env, dtensor, str(tmp_path), timeout=80, env=env,
                    expect_failure=True)
    wall = time.time() - t0
    ok1, payload1 = res[1]
    assert not ok1 and "exited with code 17" in str(payload1), f"rank 1 did not fault as planned: {payload1}"
    t_fault = _read(str(tmp_path / "fault_time"))
    assert t_fault is not None
    lines, kill_delays = [], []
    for rank, (ok, r) in enumerate(res):
        if rank == 1:
            continue
        assert ok, f"rank {rank} failed outside the step:\n{r}"
        bad = _check_timeouts(r["timeouts"], R, T, pg_timeout)
        assert not bad, f"rank {rank}: " + "; ".join(bad)
        assert r["t_err"] is not None, f"rank {rank} finished without an error although rank 1 faulted"
        delay = r["t_err"] - t_fault
        exch = [m for m in r["chain"] if EXCHANGE_RE.search(m)]
        lines.append(f"  rank {rank}: error {delay:6.2f} s after the fault, at {r['where']}: {exch[:1]}")
        assert exch, f"rank {rank}'s error does not name the exchange:\n" + "\n".join(r["chain"])
        if point.startswith("kill"):
            # Every rank raises within one group timeout of the fault (no hang). Not necessarily sooner: a rank
            # whose exchange partner is alive but has itself failed on the dead peer (its lane then posts no more
            # collectives) can only time out, which a loaded machine's scheduling makes possible (seen at 10.0-10.1 s
            # with a 10 s timeout). Asserting speed would make the test fail when the machine is slow.
            assert delay < pg_timeout + SCHED_SLACK_S, f"rank {rank} took {delay:.1f} s to notice a dead peer"
            kill_delays.append(delay)
        else:
            # a stalled peer: only the timeout frees the others, once (later exchanges then fail at once)
            assert 0.8 * pg_timeout < delay < 1.5 * pg_timeout + 3, (
                f"rank {rank} gave up on a stalled peer after {delay:.1f} s; the group timeout is {pg_timeout} s"
            )
    if kill_delays:  # the ranks that exchange with the dead peer see the connection reset at once
        assert min(kill_delays) < pg_timeout, f"no rank noticed the dead peer before the timeout: {lines}"
    print(f"\n[{world} ranks {R}x{T}, {point}, {'fused' if fused else 'two-stage'}, pg_timeout_s={pg_timeout} "
          f"({'env' if from_env else 'argument'})] spawn wall {wall:.1f} s\n" + "\n".join(lines))


# ---------------------------------------------------------------------------------------------------------------
# an exception inside a lane
# ---------------------------------------------------------------------------------------------------------------
class _InjectedNSError(FloatingPointError):
    pass


def _exploding_ns(mats, ns_kw):
    raise _InjectedNSError("injected NS failure")


def _net_and_opt(R=1, T=1, g=0, t=0, **kw):
    net = PlainShardNet(R, T, g, t)
    if R * T == 1:
        return net, OverlapMuon(net, adamw_kwargs=ADAMW_KW, overlap=True, **MUON_2D, **HP, **kw)
    tp, rm = explicit_groups(R, T, g, t)
    return net, OverlapMuon(net, adamw_kwargs=ADAMW_KW, tp_group=tp, remat_group=rm, overlap=True, **MUON_2D, **HP,
                            **kw)


def _check_lane_error(e: BaseException) -> list[str]:
    bad = []
    chain = []
    c = e
    while c is not None:
        chain.append(c)
        c = c.__cause__
    if not isinstance(e, RuntimeError) or "lane task failed" not in str(e):
        bad.append(f"outer error: {type(e).__name__}: {e}")
    if not any(isinstance(c, _InjectedNSError) for c in chain):
        bad.append(f"the injected exception is not chained: {_chain(e)}")
    tb = "".join(traceback.format_exception(e))
    if "_exploding_ns" not in tb or "ns_task" not in tb:
        bad.append("the chained traceback lacks the lane frames (ns_task -> _exploding_ns)")
    return bad


def test_lane_exception_surfaces_at_next_wait_with_traceback():
    """The step whose NS fails raises at its first wait point (step()'s reap or the next forward's wait), never
    later, with the original exception and traceback chained; the next forward never runs on stale weights."""
    net, opt = _net_and_opt(_testing=TestingSeam(ns_delay_s=0.1))
    cs, _ = net.local_grads(0)
    net(cs).backward()
    opt.step()
    opt.zero_grad()
    opt.synchronize()  # step 0's NS must not pick up the patched function
    opt._testing.ns_wrap = lambda ns, mats, kw: _exploding_ns(mats, kw)
    cs, _ = net.local_grads(1)
    net(cs).backward()
    raised_at = None
    with pytest.raises(RuntimeError) as ei:
        raised_at = "step()"
        opt.step()
        raised_at = "next forward"
        net(net.local_grads(2)[0])
    assert raised_at in ("step()", "next forward")
    bad = _check_lane_error(ei.value)
    assert not bad, "\n".join(bad)
    # synchronize() reports the step's other failed tasks; after that close() neither raises nor hangs
    with pytest.raises(RuntimeError):
        opt.synchronize()
    opt.close()


def _lane_error_body(rank, world):
    """Rank 1's NS raises; rank 1 surfaces its own error, rank 0 an error naming the exchange it waited in (freed
    when rank 1 leaves, long before the group timeout)."""
    net, opt = _net_and_opt(1, 2, 0, rank, pg_timeout_s=PG_TIMEOUT_S)
    if rank == 1:
        opt._testing.ns_wrap = lambda ns, mats, kw: _exploding_ns(mats, kw)
    try:
        for s in range(3):
            cs, _ = net.local_grads(s)
            net(cs).backward()
            opt.step()
            opt.zero_grad()
        opt.synchronize()
    except RuntimeError as e:
        return {"t_err": time.time(), "chain": _chain(e), "bad": _check_lane_error(e) if rank == 1 else []}
    return {"t_err": None, "chain": [], "bad": ["no error"]}


@pytest.mark.timeout(60)
def test_lane_exception_on_one_rank_frees_the_others():
    """A lane failure on one rank leaves its peers blocked in the exchange it will never join; they must be
    freed (with an error naming that exchange) once the failed rank raises and leaves, not hang."""
    res = run_ranks(_lane_error_body, 2, timeout=50, expect_failure=True)
    assert all(ok for ok, _ in res), res
    r0, r1 = res[0][1], res[1][1]
    assert not r1["bad"], "\n".join(r1["bad"])
    assert r0["t_err"] is not None, "rank 0 finished although its peer's NS failed"
    exch = [m for m in r0["chain"] if EXCHANGE_RE.search(m)]
    assert exch, "\n".join(r0["chain"])
    delay = r0["t_err"] - r1["t_err"]
    print(f"\n[lane error on rank 1] rank 0 raised {delay:.2f} s after rank 1: {exch[0][:160]}")
    assert delay < PG_TIMEOUT_S
