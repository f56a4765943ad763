"""Telling the operator when the swarm outgrows one averaging group.

Every member refuses a group larger than its cap (``leader_group_cap``: ``averaging.target_group_size``
when set, else ``averaging.robust.max_group_size``, 64), and hivemind's leaders stop gathering at
it, so a swarm larger than the cap splits each round into several groups. Those apply different
averages, and shoal's consistency check, which expects one anchor for the whole swarm, then sends
members of the smaller groups to re-sync to the others' anchor (simulated at 256 peers: 46-60% of
members a round; docs/scale.md). Rotating sub-groups, which would make that the design instead of a
fault, are not built yet. Until they are, a run should stay within the cap, and a peer says so
once, when it first sees the swarm cross it (and again if it crosses again after shrinking).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from averaging.math.robust import RobustConfig

HARD_CAP = RobustConfig().max_group_size  # a larger group is refused as an attack, whatever the target size


def over_cap_message(live_peers: int, cap: int) -> str:
    return (f"the swarm has {live_peers} live peers, more than one averaging group holds ({cap}: "
            f"averaging.target_group_size, else {HARD_CAP}): each round splits into groups that apply different "
            "averages, and members of the smaller ones re-sync to the others' anchor. Sub-groups for larger "
            f"swarms are not built yet (docs/scale.md): keep the run to {cap} peers or fewer"
            + (", or raise averaging.target_group_size" if cap < HARD_CAP else ""))


@dataclass
class GroupLimitWatch:
    """``observe(live_peers)`` returns the warning the first time the swarm is over ``cap`` (None:
    no cap, everybody fits), and again only after it was back within the cap."""

    cap: int | None
    _over: bool = field(default=False, init=False)

    def observe(self, live_peers: int) -> str | None:
        over = self.cap is not None and live_peers > self.cap
        first = over and not self._over
        self._over = over
        return over_cap_message(live_peers, self.cap) if first else None
