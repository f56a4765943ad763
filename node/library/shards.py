"""Which data shard this peer trains on: claimed through the progress records, least used first.

Each peer publishes its shard in its progress record (which expires when the peer leaves, so a
shard is released by itself). A peer picks the least-used shard, ties broken by a hash of its id
and the shard, so peers that join at the same moment spread out instead of all picking shard 0.
When two peers find themselves on one shard while another is free, the one with the larger peer
id moves: every peer decides the same way from the same records, so nobody needs to negotiate,
and the swarm covers the data after one heartbeat.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Mapping


def _tiebreak(peer_id: str, shard: int) -> bytes:
    return hashlib.sha256(f"{peer_id}/{shard}".encode()).digest()


def choose_shard(num_shards: int, me: str, claims: Mapping[str, int | None], current: int | None) -> int:
    """The shard ``me`` should train on, given the other peers' ``claims`` (peer id -> shard).

    Keep ``current`` unless it is out of range, or shared with a peer of smaller id while another
    shard has fewer peers (a free one, while there is one); otherwise take the least-used shard."""
    others = {peer: shard for peer, shard in claims.items() if peer != me and shard is not None
              and 0 <= shard < num_shards}
    used = Counter(others.values())
    if current is not None and 0 <= current < num_shards:
        outranked = any(peer < me for peer, shard in others.items() if shard == current)
        fewer_elsewhere = min(used[shard] for shard in range(num_shards) if shard != current) < used[current] \
            if num_shards > 1 else False
        if not (outranked and fewer_elsewhere):
            return current
    return min(range(num_shards), key=lambda shard: (used[shard], _tiebreak(me, shard)))
