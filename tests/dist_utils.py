"""Spawn N gloo ranks for a test, with a hard timeout and every rank's traceback surfaced.

Usage::

    def _body(rank, world_size, x):      # module-level, so it pickles
        ...
        return something_picklable

    results = run_ranks(_body, 2, x, timeout=60)   # list indexed by rank

[Note: why forkserver] Children fork from a server that has already imported torch, so a rank starts in
milliseconds instead of re-importing torch (seconds on 2 cores), and no child inherits the pytest process's
OpenMP thread pool (which plain ``fork`` would, and which can deadlock).
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import traceback
from typing import Any, Callable

__all__ = ["run_ranks", "free_port"]

_CTX = None


def _context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "tests.dist_utils"])
    return _CTX


def free_port() -> int:
    """A free TCP port on the loopback interface (bound and released; the race is accepted)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, pg_timeout_s, env, args, kwargs, out_q, backend="gloo"):
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    os.environ["RANK"] = str(rank)
    os.environ["WORLD_SIZE"] = str(world_size)
    os.environ["LOCAL_RANK"] = str(rank)
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            backend,
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=pg_timeout_s),
        )
        result = fn(rank, world_size, *args, **kwargs)
        # By value: a tensor put on the queue directly travels as a shared-memory fd that the parent fetches
        # from this process later, which fails once this process has exited.
        buf = io.BytesIO()
        torch.save(result, buf)
        out_q.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - report everything, including KeyboardInterrupt from a kill
        out_q.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _decode(ok: bool, payload: Any) -> Any:
    import torch

    return torch.load(io.BytesIO(payload), weights_only=False) if ok else payload


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    expect_failure: bool = False,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` gloo ranks.

    Args:
        fn: a module-level function (it must pickle).
        world_size: number of ranks (processes).
        timeout: hard wall-clock limit for the whole group, seconds. Ranks still alive then are killed and the
            test fails with a message saying which ranks hung.
        pg_timeout: timeout of the default gloo process group, seconds.
        env: extra environment variables for the ranks (e.g. toggles).
        expect_failure: if True, return ``[(ok, result_or_traceback), ...]`` instead of raising.
        backend: ``gloo`` (default) or ``nccl`` (CUDA tests).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        AssertionError: a rank raised (all tracebacks are shown) or the group timed out.
    """
    ctx = _context()
    port = free_port()
    out_q = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(fn, r, world_size, port, pg_timeout, dict(env or {}), args, kwargs, out_q, backend),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=timeout)
    while len(results) < world_size:
        remaining = (deadline - datetime.datetime.now()).total_seconds()
        if remaining <= 0:
            break
        try:
            rank, ok, payload = out_q.get(timeout=min(remaining, 1.0))
            results[rank] = (ok, _decode(ok, payload))
        except queue.Empty:
            # A rank that died without reporting (segfault, os._exit) is a failure, not a wait.
            dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
            if dead:
                try:
                    while True:
                        rank, ok, payload = out_q.get(timeout=0.5)
                        results[rank] = (ok, _decode(ok, payload))
                except queue.Empty:
                    pass
                for r in dead:
                    if r not in results:
                        results[r] = (False, f"rank {r} exited with code {procs[r].exitcode} without reporting")
    for p in procs:
        p.join(timeout=5)
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
    hung = [r for r in range(world_size) if r not in results]
    if expect_failure:
        return [results.get(r, (False, "hung: no result before the timeout")) for r in range(world_size)]
    errors = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in sorted(results.items()) if not ok]
    if hung:
        errors.append(f"ranks {hung} gave no result within {timeout:.0f} s (hang) and were killed")
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [results[r][1] for r in range(world_size)]
