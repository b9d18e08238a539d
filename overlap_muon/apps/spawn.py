"""Spawn N local ranks (gloo by default) for benchmarks and tests, with a hard timeout and every rank's traceback.

[Note: why forkserver] Children fork from a server that has already imported torch, so a rank starts in
milliseconds instead of re-importing torch (seconds on 2 cores), and no child inherits the parent's OpenMP
thread pool (which plain ``fork`` would, and which can deadlock).

[Note: results by value] A rank's return value is serialized with ``torch.save`` before it goes on the queue. A
tensor put on a ``multiprocessing`` queue directly travels as a shared-memory file descriptor that the parent
fetches from the child later, which fails once the child has exited.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

__all__ = ["spawn_ranks", "free_port", "preload"]

_CTX: Any = None
_PRELOAD = ["torch", "torch.distributed", "overlap_muon.apps.spawn"]


def preload(*modules: str) -> None:
    """Have the fork server import ``modules`` too (before the first spawn only): ranks that import a large
    library (a framework: seconds each) then start with it imported once. A module that fails to import there is
    skipped by the server."""
    if _CTX is None:
        _PRELOAD.extend(m for m in modules if m not in _PRELOAD)


def _context() -> Any:
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(list(_PRELOAD))
    return _CTX


def free_port() -> int:
    """A free TCP port on the loopback interface (bound and released; :func:`spawn_ranks` retries on the race)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(fn, rank, world_size, port, pg_timeout_s, env, backend, args, kwargs, out_q) -> None:
    import torch
    import torch.distributed as dist

    os.environ.update(env)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = fn(rank, world_size, *args, **kwargs)
        buf = io.BytesIO()
        torch.save(result, buf)
        out_q.put((rank, True, buf.getvalue()))
    except BaseException:  # noqa: BLE001 - every failure goes back to the parent with its traceback
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


def spawn_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    timeout: float = 120.0,
    pg_timeout: float = 60.0,
    env: dict[str, str] | None = None,
    backend: str = "gloo",
    **kwargs: Any,
) -> list[tuple[bool, Any]]:
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` local ranks.

    Args:
        fn: a module-level function (it must pickle).
        world_size: number of ranks (processes).
        timeout: hard wall-clock limit for the whole group, seconds; ranks still alive then are killed.
        pg_timeout: timeout of the default process group, seconds.
        env: extra environment variables for the ranks.
        backend: ``gloo`` or ``nccl``.

    Returns:
        Per rank ``(True, return value)``, or ``(False, message)`` with the rank's traceback, or a note that it
        died without reporting or gave no result before ``timeout`` (a hang). Never raises for a rank's failure.
    """
    for _ in range(3):  # free_port's race: another process may take the port before rank 0's store binds it
        res = _spawn_once(fn, world_size, args, timeout, pg_timeout, env, backend, kwargs)
        if not any(not ok and "EADDRINUSE" in str(msg) for ok, msg in res):
            break
    return res


def _spawn_once(fn: Callable[..., Any], world_size: int, args: tuple, timeout: float, pg_timeout: float,
                env: dict[str, str] | None, backend: str, kwargs: dict) -> list[tuple[bool, Any]]:
    """One attempt of :func:`spawn_ranks` on a fresh port; a rank whose store could not bind it ends the attempt
    at once (the others would wait for the store until ``timeout``)."""
    ctx = _context()
    port = free_port()
    out_q = ctx.Queue()
    procs = [
        ctx.Process(target=_worker, daemon=True,
                    args=(fn, r, world_size, port, pg_timeout, dict(env or {}), backend, args, kwargs, out_q))
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    results: dict[int, tuple[bool, Any]] = {}
    deadline = time.monotonic() + timeout

    def take(wait: float) -> None:
        rank, ok, payload = out_q.get(timeout=wait)
        results[rank] = (ok, _decode(ok, payload))

    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0 or any(not ok and "EADDRINUSE" in str(msg) for ok, msg in results.values()):
                break
            try:
                take(min(left, 1.0))
            except queue.Empty:
                # A rank that died without reporting (segfault, os._exit) is a failure, not a wait.
                dead = [r for r, p in enumerate(procs) if not p.is_alive() and r not in results]
                if dead:
                    try:
                        while True:
                            take(0.5)
                    except queue.Empty:
                        pass
                    for r in dead:
                        results.setdefault(r, (False, f"rank {r} exited with code {procs[r].exitcode} without reporting"))
    finally:
        for p in procs:
            p.join(timeout=5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return [results.get(r, (False, f"hung: no result within {timeout:.0f} s (killed)")) for r in range(world_size)]
