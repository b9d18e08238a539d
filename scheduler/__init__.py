"""Planning for overlap-muon: NS cost model, NS home assignment, waves and their dispatch.

Pure Python: nothing here needs a process group, a device or a stream, and every plan is a deterministic
function of its inputs, so all ranks compute the same one without communicating.
"""

if __name__ == "scheduler":  # the repository folder, found on the path from the repository root
    raise ImportError("scheduler/ is installed as overlap_muon._scheduler: import overlap_muon._scheduler")

from .cost import ns_flops
from .dispatch import BackwardCount, LearnedEdits, ReadinessRecorder, WaveDispatcher
from .homes import LoadReport, load_report, lpt_homes, round_robin_homes
from .plan_hash import PlanDifference, first_plan_difference, param_fingerprints, plan_hash
from .surplus import SurplusCostModel, SurplusPlan, plan_surplus
from .waves import Wave, WaveCostModel, plan_by_domain, plan_waves, plan_waves_by_cost

__all__ = [
    "ns_flops",
    "lpt_homes",
    "round_robin_homes",
    "LoadReport",
    "load_report",
    "Wave",
    "plan_waves",
    "plan_by_domain",
    "WaveCostModel",
    "plan_waves_by_cost",
    "WaveDispatcher",
    "ReadinessRecorder",
    "BackwardCount",
    "LearnedEdits",
    "plan_surplus",
    "SurplusPlan",
    "SurplusCostModel",
    "param_fingerprints",
    "plan_hash",
    "first_plan_difference",
    "PlanDifference",
]
