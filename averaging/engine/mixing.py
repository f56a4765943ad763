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
``[anchor | momentum | the inner optimizer's moments, when they ride too]``, as the lattice code
(``averaging.math.lattice``: the averager encodes and decodes it) or in fp16, or in fp32 where
reducers return deltas or the moments ride (``averaging.math.wire.mix_code``). These helpers are
pure: the round engine drives them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from averaging.math import lattice
from averaging.math.fingerprints import (
    chunk_rms,
    claim_of,
    fingerprint,
    momentum_of,
    rms_difference,
)
from averaging.math.groups import balanced_groups, group_key_bits
from averaging.math.wire import MIX_CODE
from averaging.state.shared_state import SharedState
from protocols.messages import ClaimMessage, MessageError

logger = logging.getLogger(__name__)

# round -> (our group in that round, the round's group count): ``averaging.math.groups`` applied
# to the live peers' records (``node.library.swarm``).
GroupPlan = Callable[[int], tuple[int, int]]


@dataclass(frozen=True, slots=True)
class Mixing:
    """The round engine's sub-group settings: which group we join in each round."""

    plan: GroupPlan
    code: str = MIX_CODE  # the extra vector's code both ways (``averaging.math.wire.mix_code``)

    def key_bits(self, round: int) -> tuple[str, int, int]:
        """(hivemind's matchmaking bits, our group, the count) for ``round``: the round's 4 bits,
        then the group's (one group: exactly the bits every round had before sub-groups)."""
        group, count = self.plan(round)
        return group_key_bits(round, group, count), group, count


def one_group(donors: list[str], *, live: Iterable[str], round: int, groups: int, salt: str) -> list[str]:
    """Of ``donors`` (in the order to ask them), the members of the ``round`` group that holds the
    most of them, in that order: a joiner's download assembles one state from several donors, and
    only one group's members hold one state (ties: the group whose member comes first in
    ``donors``). ``live``: the peers whose records we hold, whose hash order cut the groups."""
    if groups == 1 or not donors:
        return list(donors)
    order = {donor: i for i, donor in enumerate(donors)}
    cut = balanced_groups({*live, *donors}, round, groups, salt=salt)
    assigned: dict[int, list[str]] = {}
    for donor in donors:
        assigned.setdefault(cut[donor], []).append(donor)
    return max(assigned.values(), key=lambda group: (len(group), -order[group[0]]))


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


# The bound on the group's mean state, in units of what the members' claims allow (``state_problem``):
# a fingerprint's 4 projections estimate a chunk's RMS difference within a factor of about 3.7 at
# the 1% tail (chi-square, 4 degrees of freedom), so 4 keeps honest rounds in.
ESTIMATE_SLACK = 4.0
# ...plus this many of the chunk's step sizes (our own pseudo-gradient's, or the last applied
# step's): a member whose last sync landed after it made its claim sends an anchor a step from it.
STEP_SLACK = 4.0


def claims_by_peer(state: SharedState, gathered: Mapping[str, Any], *, round: int) -> dict[str, ClaimMessage]:
    """The group's valid claims for ``round`` by member (ours included), each decoded once; an
    invalid one is logged and left out."""
    claims = {}
    for peer, raw in gathered.items():
        try:
            message = state.decode_message(raw)
        except MessageError as e:
            logger.warning(f"round {round}: ignoring the claim of {peer}: {e}")
            continue
        if message.round == round:
            claims[peer] = message
    return claims


def far_claims(claims: Mapping[str, ClaimMessage], *, self_id: str, lattice_coded: bool = False) -> list[bool]:
    """Per claim (in ``claims``' order), whether the group's mean state leaves that member out
    (the run's far rule, ``averaging.math.lattice.left_out``, as the reducers apply it: they give
    its anchor and momentum weight 0), so its distance must not widen our bound (``state_problem``'s
    ``left_out``). If we are far ourselves nothing is left out: the mean is then the others', far
    from us by our own distance."""
    far = lattice.left_out([claim_of(message) for message in claims.values()], coded=lattice_coded)
    if any(f for peer, f in zip(claims, far) if peer == self_id):
        return [False] * len(far)
    return far


def far_from_group(claims: Mapping[str, ClaimMessage], *, self_id: str) -> list[str] | None:
    """If we are far from our lattice-coded group by the claims (``averaging.math.lattice.far``: as
    its reducers find), the members that are not (the donors of the group's state); else None. A
    far member cannot decode the group's state and downloads it from them instead."""
    far = lattice.far([claim_of(message) for message in claims.values()])
    if not any(f for peer, f in zip(claims, far) if peer == self_id):
        return None
    return [peer for peer, f in zip(claims, far) if not f and peer != self_id]


def state_problem(anchor: torch.Tensor, momentum: torch.Tensor, state: SharedState,
                  claims: list[ClaimMessage], *, members: int, local_pseudo_grad: torch.Tensor,
                  left_out: list[bool] | None = None) -> str | None:
    """Why the group's mean state must not be taken, or None.

    A reducer returns its part of the mean itself, and our own part is all a member can check a
    part against, which for an anchor bounds nothing (its norm is the weights' own). The members'
    signed claims bound it instead: every rule the reducers apply (weights bounded, CenteredClip
    from the coordinate median) leaves the result inside the bounding box of the members' anchors,
    and any point of that box is within ``sqrt(n) x D`` of our anchor, ``D`` the farthest member's
    distance (``||c - a||^2 <= sum_i ||x_i - a||^2 <= n D^2`` coordinate by coordinate). So per
    fingerprint chunk: ``RMS(mean - ours) <= ESTIMATE_SLACK x sqrt(n) x D + STEP_SLACK x step``, with
    ``D`` estimated from the claims, and the momentum likewise from the momentum fingerprints the
    members' claims carry (``SharedState.claim_message(with_momentum=True)``); when a member's claim
    lacks one, only by how far momenta can honestly lie apart (``1 / (1 - mu)`` steps). A member far
    from the rest (``left_out``, from ``far_claims``) is not in the mean and does not count in ``D``;
    a stale member that is not that far widens ``D`` for everyone (its anchor is in the mean); a
    reducer that lies gains at most that bound on its share. Non-finite values are refused first."""
    if not bool(torch.isfinite(anchor).all()) or not bool(torch.isfinite(momentum).all()):
        return "the group's mean anchor or momentum has NaN/inf values; it was not taken"
    ours = state.claim().fingerprint
    our_momentum = fingerprint(state.momentum)
    farthest = torch.zeros(ours.num_chunks, dtype=torch.float64)
    farthest_momentum = torch.zeros(ours.num_chunks, dtype=torch.float64)
    momenta_claimed = 0
    for message, out in zip(claims, left_out or [False] * len(claims)):
        theirs = momentum_of(message)
        momenta_claimed += theirs is not None
        if out:
            continue
        farthest = torch.maximum(farthest, rms_difference(claim_of(message).fingerprint, ours))
        if theirs is not None:
            farthest_momentum = torch.maximum(farthest_momentum, rms_difference(theirs, our_momentum))
    step = torch.maximum(state.scale, chunk_rms(local_pseudo_grad, ours.chunk_len))
    spread = ESTIMATE_SLACK * math.sqrt(max(1, members))
    allowed = spread * farthest + STEP_SLACK * step + state.abs_tol
    if momenta_claimed >= members:  # every member claimed its momentum: bounded like the anchor
        allowed_momentum = spread * farthest_momentum + STEP_SLACK * step + state.abs_tol
    else:  # bounded by how far momenta can honestly differ: loose
        allowed_momentum = (allowed + step) / max(1.0 - state.config.momentum, 0.05)
    for name, mean, own, bound in (("anchor", anchor, state.anchor, allowed),
                                   ("momentum", momentum, state.momentum, allowed_momentum)):
        off = chunk_rms(mean - own, ours.chunk_len)
        worst = int(torch.argmax(off / bound))
        if off[worst] > bound[worst]:
            return (f"the group's mean {name} is {float(off[worst]):.3g} (RMS) from ours on chunk {worst}, more than "
                    f"the members' claims allow ({float(bound[worst]):.3g}): a reducer's answer is wrong; not taken")
    return None


def group_rounds_done(state: SharedState, claims: list[ClaimMessage], *, round: int) -> int:
    """The most outer steps a member of the group claims (its attached claim), counting ours, each
    capped by the schedule (one step a round): the count every member takes with the group's mean
    state, so that they serve one state to joiners (a download compares step counts). An inflated
    claim moves only this count, which no rule of the math reads."""
    return max([state.rounds_done, *(m.rounds_done for m in claims if m.rounds_done <= round)])
