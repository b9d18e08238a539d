"""All-to-all routing for layer-sharded Muon: shards to each matrix's Newton-Schulz home and back.

Layer sharding gives every Muon matrix one NS *home* in the ``R x T`` weight-shard domain (docs/design.md §2).
Before ``zeropower`` the home needs the complete ``(P, Q)`` matrix, so every rank sends it its local block
(``to``); afterwards the home sends every rank its block of the orthogonalized result (``from``). Only data
moves: every result is assembled by copies, so all paths here are bit exact.

Which file holds what:

* ``_seed_api.py``: the seed API (``params_by_home``, ``route_to_ns_home``, ``route_from_ns_home``), axis-generic:
  one exchange over one process group along one ``shard_dim`` per param.
* ``_domain_exchange.py``: the domain API over the ``R x T`` layouts, ``local_shard``, ``to_homes`` and
  ``from_homes`` (``fused=False``: the two seed stages; ``fused=True``: one ``all_to_all_single`` over the flat
  group).
* ``_gather.py``: ``all_gather_full``, the duplicated-mode baseline.
* ``_team.py``: ``team_block``, ``to_team`` / ``from_team`` (the shard layout <-> the team NS layout).
* ``_route.py``: what every exchange is made of: the plan records, the packer, the plan cache and the execution
  (one ``all_to_all_single``); [Note: transport as bytes], [Note: results may alias].
* ``_checks.py``: the input checks, seed-level and domain-level; [Note: validation is local].

Every name other modules import is re-exported here: ``from overlap_muon.layer_sharded_a2a import to_homes``.
"""

from __future__ import annotations

from ._domain_exchange import from_homes, local_shard, to_homes
from ._gather import all_gather_full
from ._seed_api import params_by_home, route_from_ns_home, route_to_ns_home
from ._team import from_team, team_block, to_team

__all__ = [
    "params_by_home",
    "route_to_ns_home",
    "route_from_ns_home",
    "local_shard",
    "to_homes",
    "from_homes",
    "all_gather_full",
    "team_block",
    "to_team",
    "from_team",
]
