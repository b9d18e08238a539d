"""Import torchtitan 0.3.0 on a CPU-only machine, for the tests.

torchtitan's model package imports ``torchtitan.distributed.minimal_async_ep.kernels``, whose module body imports
``triton`` (absent without CUDA); the tests never run those kernels (no asynchronous EP). :func:`import_torchtitan`
puts a stand-in module of the same name in ``sys.modules`` whose functions raise if called, and points
``torchtitan.distributed.parallel_dims.device_type`` (``"cuda"`` when no accelerator is found) at ``"cpu"`` so
``ParallelDims.build_mesh`` builds a CPU (gloo) mesh.
"""

from __future__ import annotations

import importlib.util
import sys
import types

__all__ = ["import_torchtitan"]

_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_NAMES = ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
          "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
          "reduce_topk_slots_kernel", "topk_scores_grad_kernel")


def import_torchtitan() -> str | None:
    """Make torchtitan importable here; ``None``, or why it is not (the reason to skip with)."""
    if importlib.util.find_spec("torchtitan") is None:
        return "torchtitan is not installed (pip install torchtitan==0.3.0)"
    if importlib.util.find_spec("triton") is None and _KERNELS not in sys.modules:
        stub = types.ModuleType(_KERNELS)

        def _unavailable(*args, **kwargs):
            raise RuntimeError("tests/torchtitan_stub.py: the triton EP kernels are not available on this machine")

        for n in _NAMES:
            setattr(stub, n, _unavailable)
        sys.modules[_KERNELS] = stub
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"
    return None
