"""Sub-group rounds: each round the swarm splits into groups of about ``averaging.target_group_size``
that change every round (Moshpit SGD, arXiv:2103.03239), and each group averages its members'
anchors and outer momenta beside the pseudo-gradient.

Why the state rides along: groups apply different averages, so "every peer holds the same anchor"
cannot hold. Averaging pseudo-gradients alone lets groups drift apart for good (simulated: 7.6 x a
pseudo-gradient's RMS apart, against 1.0 with anchors averaged; docs/scale.md). With the state
averaged, the invariant is: **every member of a group holds the same anchor right after the
group's round** (the reducers return the same bytes to every member, and the members apply the
same step), and anchors across groups converge at the rate ``benchmarks/scale_sim.py`` measures.
What that replaces: the consistency verdict's catch-up and re-sync (anchors of different groups
differ by design, and a stale anchor is pulled into its next group's mean anyway), and the split
swarm's reunion logic (every round meets peers from other groups).

The all-reduce's extra vector (``HivemindBackend(extra_numel=...)``) is laid out as
``[anchor | momentum | the inner optimizer's moments, when they ride too]``, in fp32
(``averaging.math.wire.MIX_CODE``). These helpers are pure: the round engine drives them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from averaging.math.groups import group_key_bits, members
from averaging.state.shared_state import SharedState
from protocols.messages import MessageError

logger = logging.getLogger(__name__)

# round -> (our group in that round, the round's group count): ``averaging.math.groups`` applied
# to the live peers' records (``node.library.swarm``).
GroupPlan = Callable[[int], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Mixing:
    """The round engine's sub-group settings: which group we join in each round."""

    plan: GroupPlan

    def key_bits(self, round: int) -> tuple[str, int, int]:
        """(hivemind's matchmaking bits, our group, the count) for ``round``: the round's 4 bits,
        then the group's (one group: exactly the bits every round had before sub-groups)."""
        group, count = self.plan(round)
        return group_key_bits(round, group, count), group, count


def one_group(donors: list[str], *, round: int, groups: int, salt: str) -> list[str]:
    """Of ``donors`` (in the order to ask them), the members of ``round``'s largest group, in that
    order: a joiner's download assembles one state from several donors, and only one group's
    members hold one state (ties: the group whose member comes first in ``donors``)."""
    if groups == 1 or not donors:
        return list(donors)
    order = {donor: i for i, donor in enumerate(donors)}
    assigned = members(donors, round, groups, salt=salt).values()
    best = min(assigned, key=lambda group: (-len(group), min(order[d] for d in group)))
    return [donor for donor in donors if donor in set(best)]


def state_numel(numel: int) -> int:
    """Values the anchor and momentum take at the head of the extra vector."""
    return 2 * numel


def pack_state(state: SharedState, out: torch.Tensor) -> None:
    """Our anchor and momentum into the head of the extra vector (the sync worker's thread, the only
    one that changes them)."""
    numel = state.layout.numel
    out[:numel].copy_(state.anchor)
    out[numel:2 * numel].copy_(state.momentum)


def unpack_state(extra: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's mean anchor and momentum (views into the averaged extra vector)."""
    return extra[:numel], extra[numel:2 * numel]


def state_problem(anchor: torch.Tensor, momentum: torch.Tensor) -> str | None:
    """Why the group's mean state must not be taken, or None. The reducers judged every member's
    part (CenteredClip around the median) and every returned part was checked against ours; what is
    left to refuse is a mean that is not finite."""
    if not bool(torch.isfinite(anchor).all()) or not bool(torch.isfinite(momentum).all()):
        return "the group's mean anchor or momentum has NaN/inf values; it was not taken"
    return None


def group_rounds_done(state: SharedState, gathered: Mapping[str, Any], *, round: int) -> int:
    """The most outer steps a member of the group claims (its attached claim), counting ours, each
    capped by the schedule (one step a round): the count every member takes with the group's mean
    state, so that they serve one state to joiners (a download compares step counts). An inflated
    claim moves only this count, which no rule of the math reads."""
    most = state.rounds_done
    for peer, raw in gathered.items():
        try:
            message = state.decode_message(raw)
        except MessageError as e:
            logger.warning(f"round {round}: ignoring the claim of {peer}: {e}")
            continue
        if message.round == round and message.rounds_done <= round:
            most = max(most, message.rounds_done)
    return most
