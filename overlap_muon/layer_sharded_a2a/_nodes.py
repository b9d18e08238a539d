"""A fused exchange in two hops over nodes: the same route, at most ``(L - 1) + (N - 1)`` peers per rank.

[Note: node-aware exchange] is in ``overlap_muon/_domain.py`` (the groups). Here, the transport: a fused route
(``_route._Route``) says what this rank sends to every flat rank ``d = n*L + l`` of the domain and what it receives
from each. In two hops:

1. **within the node** (``intra_group``): this rank sends to its node-mate of local index ``l`` every piece bound
   for local index ``l`` on any node. Its send buffer is packed in ``(l, n)`` order of the destination instead of
   the fused ``(n, l)`` order (the route's pieces, re-laid: no extra copy);
2. **across nodes** (``inter_group``): what it now holds from its ``L`` node-mates, bound for its own local index on
   node ``n``, goes to that node's rank of its local index. One copy re-lays the first hop's receive buffer from
   ``(mate, node)`` to ``(node, mate)`` order.

What the second hop receives from node ``n`` is, in local-index order, what each of ``n``'s ranks sent this rank:
the fused receive buffer, byte for byte (flat order is ``(n, l)``). The sizes of the first hop's receive buffer are
the node-mates' own send splits, which every rank computes from the same metadata (the mates' routes), so no sizes
travel. Cost against the fused exchange: two collectives instead of one, the pieces bound for other local indices
cross the node once more (intra-node bytes), one re-lay copy of what leaves the node; the bytes that cross nodes
are the same.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import accumulate

import torch
from torch import Tensor

from overlap_muon._domain import Domain, NodeHops

from ._route import _all_to_all, _buffer, _Piece, _Route


@dataclass(frozen=True, slots=True)
class TwoHops:
    """One route's two-hop transport (``_route._execute(..., hops=)``). Splits are in elements."""

    sends: tuple[_Piece, ...]  #: the route's send pieces at their offsets in ``(local index, node)`` order
    hop1_send: tuple[int, ...]  #: to each node-mate, by local index
    hop1_recv: tuple[int, ...]  #: from each node-mate, by local index
    relay: tuple[tuple[int, int], ...]  #: ``(offset, length)`` of hop 1's receive buffer, in hop 2's send order
    hop2_send: tuple[int, ...]  #: to this local index's rank of each node
    hop2_recv: tuple[int, ...]  #: from this local index's rank of each node
    groups: NodeHops

    def run(self, send: Tensor, recv: Tensor, buffers: dict | None) -> None:
        """Move ``send`` (packed by :attr:`sends`) into ``recv`` (the fused route's receive layout)."""
        g = self.groups
        if g.intra_group is None:  # one rank of the domain per node: the first hop is the identity
            mid = send
        else:
            mid = _buffer(buffers, "hop1", sum(self.hop1_recv), send.dtype, send.device)
            _all_to_all(mid, send, self.hop1_recv, self.hop1_send, g.intra_group)
        out = _buffer(buffers, "hop2", sum(self.hop2_send), send.dtype, send.device)
        if self.relay:
            torch.cat([mid[o : o + n] for o, n in self.relay], out=out)
        _all_to_all(recv, out, self.hop2_recv, self.hop2_send, g.inter_group)


def two_hops(route: _Route, domain: Domain, mate_sends: Callable[[Domain], Sequence[int]]) -> TwoHops:
    """The two-hop transport of this rank's fused ``route`` over ``domain.nodes``.

    ``mate_sends(dom)``: the send splits (by flat rank) of the route that the rank at ``dom``'s coordinates builds
    for the same call (pure metadata: the caller's route builder at another rank's coordinates)."""
    hops: NodeHops = domain.nodes
    L, N, me = hops.ranks_per_node, hops.nodes, domain.flat_rank
    node, mine = divmod(me, L)
    T = domain.tp_size
    mates = [route.send_splits if node * L + l == me else tuple(mate_sends(dataclasses.replace(
        domain, remat_rank=(node * L + l) // T, tp_rank=(node * L + l) % T))) for l in range(L)]
    own = route.send_splits
    # This rank's send buffer: destination (n, l) in (l, n) order.
    order = [n * L + l for l in range(L) for n in range(N)]
    fused_at = [0, *accumulate(own)]
    hop_at = dict(zip(order, accumulate((own[d] for d in order), initial=0)))
    sends = tuple(dataclasses.replace(p, offset=p.offset - fused_at[d] + hop_at[d])
                  for p in route.sends for d in [bisect.bisect_right(fused_at, p.offset) - 1])
    # Hop 1 receives from mate l its pieces bound for (n, mine), node by node; hop 2 sends them node by node.
    seg = [[mates[l][n * L + mine] for n in range(N)] for l in range(L)]
    at = [list(accumulate(row, initial=0)) for row in seg]
    base = list(accumulate((at[l][-1] for l in range(L)), initial=0))
    relay = tuple((base[l] + at[l][n], seg[l][n]) for n in range(N) for l in range(L) if seg[l][n])
    return TwoHops(
        sends=sends,
        hop1_send=tuple(sum(own[n * L + l] for n in range(N)) for l in range(L)),
        hop1_recv=tuple(at[l][-1] for l in range(L)),
        relay=relay,
        hop2_send=tuple(sum(seg[l][n] for l in range(L)) for n in range(N)),
        hop2_recv=tuple(sum(route.recv_splits[n * L + l] for l in range(L)) for n in range(N)),
        groups=hops,
    )

