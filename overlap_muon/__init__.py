"""overlap-muon: layer-sharded Muon whose optimizer work hides inside backward and the next forward.

The face holds what a user calls: the optimizer, its config's type, the fused-weight splits and QK-clip. The
library's internal modules are named with a leading underscore (``overlap_muon._pipeline``, ...); ``docs/design.md``
([Note: what is public], in its module map) lists the public ones.
"""

from .config import OverlapMuonConfig
from .optimizer import OverlapMuon
from .qk_clip import QKClip, record_max_logits
from .split import GateUpSplit, HeadSplit, QKVSplit, RowSplit

__all__ = ["OverlapMuon", "OverlapMuonConfig", "RowSplit", "QKVSplit", "GateUpSplit", "HeadSplit", "QKClip",
           "record_max_logits"]
