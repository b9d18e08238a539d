"""overlap-muon: layer-sharded Muon whose optimizer work hides inside backward and the next forward."""

from .config import OverlapMuonConfig, resolve_config
from .ns import adjusted_lr, zeropower
from .scheduler.cost import ns_flops
from .optimizer import OverlapMuon
from .qk_clip import QKClip, record_max_logits
from .split import GateUpSplit, HeadSplit, QKVSplit, RowSplit

__all__ = [
    "OverlapMuon", "OverlapMuonConfig", "resolve_config", "zeropower", "ns_flops", "adjusted_lr", "RowSplit", "QKVSplit",
    "GateUpSplit", "HeadSplit", "QKClip", "record_max_logits",
]
