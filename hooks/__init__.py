"""Generic training-loop hooks for overlap-muon: gradient-ready signals and forward waits.

No optimizer knowledge: hooks report param indices and call back; the caller decides what to launch or wait on.
"""

if __name__ == "hooks":  # the repository folder, found on the path from the repository root
    raise ImportError("hooks/ is installed as overlap_muon._hooks: import overlap_muon._hooks")

from .forward_wait import compile_boundary, fsdp_param_streams, params_read_by_module, register_forward_waits
from .ownership import ParamOwners
from .grad_ready import EndOfBackward, GradReadyTracker, weak_callback
from .ddp_readiness import attach_ddp_readiness, ddp_readiness_hook, watch_for_ddp
from .pipeline_stage import watch_stage

__all__ = [
    "GradReadyTracker", "EndOfBackward", "attach_ddp_readiness", "compile_boundary", "ddp_readiness_hook",
    "fsdp_param_streams", "params_read_by_module", "register_forward_waits", "ParamOwners", "weak_callback",
    "watch_stage", "watch_for_ddp",
]
