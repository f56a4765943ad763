"""Round-seeded averaging sub-groups: which peers average together in a round, computed by every peer alone.

Sub-groups of about ``target_group_size`` bound how many peers each member talks to and how many a
leaver spoils, without a coordinator: every peer orders the live peers by a hash of (salt, round,
peer id), cuts the order into ``groups`` equal runs (``balanced_groups``) and puts its run's index
in hivemind's matchmaking key. The hash changes every round, so groups remix (Moshpit SGD,
arXiv:2103.03239). Pure functions: no DHT, no clock, no torch.

Ranks rather than the hash's top bits (``group_of``, rule 1), because hashed sizes are binomial
(docs/scale.md); the price is that a peer with a slightly different live view may land in the
neighbouring group, one member larger.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Iterable

# The assignment rule's version, in the run manifest: 1 hashed (``group_of``), 2 balanced.
RULE = 2
ROUND_BITS = 4  # round % 16 in the key: neighbouring rounds never share a key (as round_bits always did)
_HASH_BITS = 64
_PERSON = b"shoal-groups-v1"  # blake2b personalisation: these digests mean nothing elsewhere


def _is_power_of_two(value: int) -> bool:
    return value >= 1 and value & (value - 1) == 0


def group_count(live_peers: int, target_group_size: int) -> int:
    """How many groups ``live_peers`` peers split into: 1 when ``target_group_size`` is 0 or they fit
    one group; else the smallest power of two that brings the mean size to at most the target (a
    power of two, so counts a doubling apart disagree on one key bit only)."""
    if live_peers < 0 or target_group_size < 0:
        raise ValueError(f"live_peers ({live_peers}) and target_group_size ({target_group_size}) must be >= 0")
    if target_group_size == 0 or live_peers <= target_group_size:
        return 1
    # integer arithmetic: the smallest k with target * 2**k >= live (a float log2 misrounds at the boundaries)
    return 1 << (-(-live_peers // target_group_size) - 1).bit_length()


def settled_group_count(live_peers: int, target_group_size: int, current: int | None, *,
                        slack: float = 0.25) -> int:
    """``current`` while its mean group size stays within ``[target/2 * (1 - slack), target * (1 + slack)]``,
    else ``group_count``: live counts lag, and peers with different counts never meet, so the band
    keeps the count still while the swarm drifts by a few peers."""
    if not 0 <= slack < 1:
        raise ValueError(f"slack ({slack}) must be in [0, 1)")
    fresh = group_count(live_peers, target_group_size)
    if current is None or target_group_size == 0 or not _is_power_of_two(current):
        return fresh
    mean = live_peers / current
    low = 0.0 if current == 1 else target_group_size / 2 * (1 - slack)
    return current if low <= mean <= target_group_size * (1 + slack) else fresh


def agreed_group_count(published: Iterable[int | None], live_peers: int, target_group_size: int, *,
                       slack: float = 0.25) -> int:
    """The count to use this round: the most common count the live peers published last round (ties
    to the smaller), kept by ``settled_group_count``'s band. Starting from what most peers used
    (not one's own history) pulls a minority that switched early back, instead of splitting the swarm."""
    current = most_published(published)
    if current is None:
        return group_count(live_peers, target_group_size)
    return settled_group_count(live_peers, target_group_size, current, slack=slack)


def most_published(published: Iterable[int | None]) -> int | None:
    """The count most peers published (ties to the smaller count), of the valid ones (powers of
    two); None if none is."""
    counts = Counter(count for count in published if isinstance(count, int) and _is_power_of_two(count))
    if not counts:
        return None
    most = max(counts.values())
    return min(count for count, seen in counts.items() if seen == most)


def round_hash(peer_id: str, round: int, *, salt: str = "") -> int:
    """A 64-bit blake2b digest of (salt, round, peer id): the same on every machine (unlike ``hash``)."""
    fields = (salt.encode(), str(int(round)).encode(), peer_id.encode())
    message = b"".join(len(field).to_bytes(4, "big") + field for field in fields)  # unambiguous framing
    return int.from_bytes(hashlib.blake2b(message, digest_size=_HASH_BITS // 8, person=_PERSON).digest(), "big")


def group_of(peer_id: str, round: int, groups: int, *, salt: str = "") -> int:
    """Rule 1, kept for the simulator to compare: the top log2(groups) bits of ``round_hash``."""
    if not _is_power_of_two(groups):
        raise ValueError(f"groups ({groups}) must be a power of two")
    if groups == 1:
        return 0
    return round_hash(peer_id, round, salt=salt) >> (_HASH_BITS - (groups.bit_length() - 1))


def balanced_groups(peer_ids: Iterable[str], round: int, groups: int, *, salt: str = "") -> dict[str, int]:
    """Each peer's group in ``round``: rank ``i`` of ``n`` by ``round_hash`` goes to group
    ``i * groups // n``. Sizes differ by one at most, and counts a doubling apart disagree on one
    key bit only (``(i * 2g // n) // 2 == i * g // n``)."""
    if not _is_power_of_two(groups):
        raise ValueError(f"groups ({groups}) must be a power of two")
    order = sorted(set(peer_ids), key=lambda peer: (round_hash(peer, round, salt=salt), peer))
    return {peer: rank * groups // len(order) for rank, peer in enumerate(order)}


def group_among(peer_id: str, live: Iterable[str], round: int, groups: int, *, salt: str = "") -> int:
    """``peer_id``'s group in ``round`` among the ``live`` peers it knows of (itself always counted)."""
    return balanced_groups({*live, peer_id}, round, groups, salt=salt)[peer_id]


def group_key_bits(round: int, group: int, groups: int) -> str:
    """hivemind's matchmaking bits for ``group`` in ``round``: the round's 4 bits, then log2(groups)
    bits of the group. One group (``groups == 1``) is exactly the round's bits: today's key."""
    if not _is_power_of_two(groups):
        raise ValueError(f"groups ({groups}) must be a power of two")
    if not 0 <= group < groups:
        raise ValueError(f"group ({group}) must be in [0, {groups})")
    width = groups.bit_length() - 1
    return format(round % (1 << ROUND_BITS), f"0{ROUND_BITS}b") + (format(group, f"0{width}b") if width else "")


def members(peer_ids: Iterable[str], round: int, groups: int, *, salt: str = "") -> dict[int, list[str]]:
    """Every group of ``round`` with its peers (sorted), from the live peer ids (``balanced_groups``):
    who a peer expects to meet, and whom a joiner can fetch one group's state from."""
    assigned: dict[int, list[str]] = {}
    for peer_id, group in sorted(balanced_groups(peer_ids, round, groups, salt=salt).items()):
        assigned.setdefault(group, []).append(peer_id)
    return assigned
