"""Telling the operator when a swarm of one group each round outgrows it.

With ``averaging.target_group_size = 0`` every round is one group of everybody, and every member
refuses a group larger than ``averaging.robust.max_group_size`` (64, ``leader_group_cap``):
hivemind's leaders stop gathering there, so a larger swarm splits each round into several groups.
Those apply different averages, and the consistency check, which expects one anchor for the whole
swarm, then sends many members to re-sync every round (docs/scale.md). Sub-groups are the design for
such swarms; a peer says so once when it sees the swarm cross the cap (again if it crosses again).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from averaging.math.robust import RobustConfig

HARD_CAP = RobustConfig().max_group_size  # a larger group is refused as an attack, whatever the target size


def over_cap_message(live_peers: int, cap: int) -> str:
    return (f"the swarm has {live_peers} live peers, more than one averaging group holds ({cap}): each "
            "round splits into groups that apply different averages, and members of the smaller ones "
            "re-sync to the others' anchor. Set averaging.target_group_size (8-16) so that the swarm "
            "averages in sub-groups that change every round (docs/scale.md), or keep the run to "
            f"{cap} peers or fewer")


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
