"""Spawn N gloo ranks for a test, with a hard timeout and every rank's traceback surfaced.

Usage::

    def _body(rank, world_size, x):      # module-level, so it pickles
        ...
        return something_picklable

    results = run_ranks(_body, 2, x, timeout=60)   # list indexed by rank

The spawning itself is ``overlap_muon.apps.spawn.spawn_ranks`` (shared with the benchmarks); this adds the test
policy: any failed or hung rank fails the test with every rank's message.
"""

from __future__ import annotations

from typing import Any, Callable

from overlap_muon.apps.spawn import free_port, spawn_ranks

__all__ = ["run_ranks", "free_port"]


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
    """Run ``fn(rank, world_size, *args, **kwargs)`` on ``world_size`` ranks.

    Args:
        fn: a module-level function (it must pickle).
        world_size: number of ranks (processes).
        timeout: hard wall-clock limit for the whole group, seconds. Ranks still alive then are killed and the
            test fails with a message saying which ranks hung.
        pg_timeout: timeout of the default process group, seconds.
        env: extra environment variables for the ranks (e.g. toggles).
        expect_failure: if True, return ``[(ok, result_or_traceback), ...]`` instead of raising.
        backend: ``gloo`` (default) or ``nccl`` (CUDA tests).

    Returns:
        The per-rank return values, indexed by rank.

    Raises:
        AssertionError: a rank raised (all tracebacks are shown), died, or the group timed out.
    """
    res = spawn_ranks(fn, world_size, *args, timeout=timeout, pg_timeout=pg_timeout, env=env, backend=backend,
                      **kwargs)
    if expect_failure:
        return res
    errors = [f"--- rank {r} ---\n{payload}" for r, (ok, payload) in enumerate(res) if not ok]
    if errors:
        raise AssertionError("distributed test failed:\n" + "\n".join(errors))
    return [payload for _, payload in res]
