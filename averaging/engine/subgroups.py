"""The sub-group round: groups that change every round, each mixing its members' state.

Each round the swarm splits into groups of about ``averaging.target_group_size`` (Moshpit SGD,
arXiv:2103.03239), and each group averages its members' anchors and outer momenta beside the
pseudo-gradient, or groups would drift apart for good. The invariant: **every member of a group
holds the same anchor right after the group's round**; anchors across groups converge.

From "group formed" to "anchor moved" (``SubGroups.end``): the group view says who is **far**
(weight 0 in the mean state); **check** the average and the mean state against what the claims
allow (``state_problem``); **mix**: take the group's state and apply its step (``SharedState.mix``;
a far member of a lattice-coded group steps its own state and re-syncs); **account** for our work.
A partial or failed round folds.

The extra vector is ``[anchor | momentum | the inner optimizer's moments, when they ride]``, in the
run's state code (``averaging.math.wire.mix_code``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from averaging.engine.kind import RoundConclusion, RoundEnding, account, alone_or_fold, take
from averaging.engine.recover import Recovery
from averaging.math.fingerprints import (
    DEFAULT_ABS_TOL,
    AnchorClaim,
    chunk_rms,
    claim_of,
    fingerprint,
    momentum_of,
    rms_difference,
)
from averaging.math.groups import balanced_groups, group_key_bits
from averaging.math.lattice import WITHIN_STEPS
from averaging.math.outer_step import OuterConfig
from averaging.math.wire import LATTICE_CODE, MIX_CODE, WireFormat
from averaging.network.interface import AverageOutcome
from averaging.state.accept import check_average
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Applied, Resync
from protocols.messages import ClaimMessage, MessageError

logger = logging.getLogger(__name__)

# round -> (our group in that round, the round's group count), from the live peers' records.
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
    most of them: a download assembles one state, and only one group's members hold one state.
    ``live``: the peers whose records we hold, whose hash order cut the groups."""
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


# The bound on the group's mean state, in units of what the claims allow (``state_problem``): 4
# projections estimate a chunk's RMS difference within about 3.7x at the 1% tail.
ESTIMATE_SLACK = 4.0
# ...plus this many step sizes: a member whose last sync landed after its claim is a step off it.
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


def left_out(claims: Mapping[str, ClaimMessage], far: frozenset[str], *, self_id: str) -> list[bool]:
    """Per claim, whether the group's mean state leaves that member out (the view's ``far``), so its
    distance must not widen ``state_problem``'s bound; nothing if we are far ourselves."""
    if self_id in far:
        return [False] * len(claims)
    return [peer in far for peer in claims]


def donors_if_far(claims: Mapping[str, ClaimMessage], far: frozenset[str], *, self_id: str) -> list[str] | None:
    """If we are far from our lattice-coded group, the near members to download its state from
    (we cannot decode it); else None."""
    if self_id not in far:
        return None
    return [peer for peer in claims if peer not in far and peer != self_id]


def far_by_our_step(ours: AnchorClaim, near: list[AnchorClaim]) -> bool:
    """Whether our anchor is beyond what a lattice grid covers (``WITHIN_STEPS`` steps) from the near
    members' (the median distance, per chunk), in *our own* claimed step. The group's far rule
    (``lattice.far``) measures in the steps its members claim, which members claiming step 0 shrink:
    two colluders of four made an honest member two steps away count as far and re-sync to the state
    most of its donors served, theirs (issue 54, item 4). Our re-sync is ours to decide: it needs
    both. Not a rule members must agree on (a far member keeps its own state either way)."""
    if not near:
        return True
    distance = torch.stack([rms_difference(ours.fingerprint, c.fingerprint) for c in near]).median(dim=0).values
    return bool((distance > WITHIN_STEPS * ours.scale + DEFAULT_ABS_TOL).any())


def state_problem(anchor: torch.Tensor, momentum: torch.Tensor, state: SharedState,
                  claims: list[ClaimMessage], *, members: int, local_pseudo_grad: torch.Tensor, mu: float,
                  left_out: list[bool] | None = None) -> str | None:
    """Why the group's mean state must not be taken, or None.

    Our own part bounds nothing for an anchor, so the members' signed claims do: every reducer rule
    leaves the mean inside the bounding box of the members' anchors, within ``sqrt(n) x D`` of ours
    (``D``: the farthest member's claimed distance). Per fingerprint chunk:
    ``RMS(mean - ours) <= ESTIMATE_SLACK x sqrt(n) x D + STEP_SLACK x step``, the momentum likewise
    (or, when a claim lacks its fingerprint, within ``1 / (1 - mu)`` steps). Members ``left_out`` of
    the mean do not count in ``D``; non-finite values are refused first."""
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
        allowed_momentum = (allowed + step) / max(1.0 - mu, 0.05)
    for name, mean, own, bound in (("anchor", anchor, state.anchor, allowed),
                                   ("momentum", momentum, state.momentum, allowed_momentum)):
        off = chunk_rms(mean - own, ours.chunk_len)
        worst = int(torch.argmax(off / bound))
        if off[worst] > bound[worst]:
            return (f"the group's mean {name} is {float(off[worst]):.3g} (RMS) from ours on chunk {worst}, more than "
                    f"the members' claims allow ({float(bound[worst]):.3g}): a reducer's answer is wrong; not taken")
    return None


def group_rounds_done(state: SharedState, claims: list[ClaimMessage], *, round: int) -> int:
    """The most outer steps a member claims, ours included, capped by the schedule: the count every
    member takes with the group's state, so they serve joiners one state (no math reads it)."""
    return max([state.rounds_done, *(m.rounds_done for m in claims if m.rounds_done <= round)])


def conclude(state: SharedState, outcome: AverageOutcome, local_pseudo_grad: torch.Tensor, *, round: int, mu: float,
             averaged: torch.Tensor | None = None, mixed: torch.Tensor | None = None,
             alone: bool = False, self_id: str = "", lattice: bool = False) -> RoundConclusion:
    """Check and mix: if the round succeeded and both the average and the group's mean state
    (``mixed``) are usable, take the group's state and apply its step, so every member ends with
    the same anchor; otherwise our own step if alone, else the work folds. ``lattice``: a far
    member cannot decode the state, so it applies the step to its own and re-syncs from the near ones."""
    conclusion = RoundConclusion(applied=Applied.FOLDED, group_size=max(1, len(outcome.group)), error=outcome.error)
    if outcome.ok and averaged is not None and mixed is not None:
        conclusion.group_size = len(outcome.group)
        anchor, momentum = unpack_state(mixed, state.layout.numel)
        by_peer = claims_by_peer(state, outcome.gathered, round=round)
        claims = list(by_peer.values())
        far = outcome.far or frozenset()  # the group view's, as its reducers found it
        donors = donors_if_far(by_peer, far, self_id=self_id) if lattice else None
        if donors:  # our averager kept our own state (we could not decode the group's): its step on ours
            take(conclusion, check_average(averaged, local_pseudo_grad, reference_rms=state.last_rms),
                 lambda: state.apply(averaged, round=round))
            if self_id in by_peer and not far_by_our_step(claim_of(by_peer[self_id]),
                                                          [claim_of(by_peer[p]) for p in donors]):
                logger.warning(f"round {round}: the group's claims put our anchor far from theirs, but it is within "
                               f"{WITHIN_STEPS:g} of our own steps of the near members': no re-sync (claimed steps "
                               "of 0 shrink the group's measure)")
                return conclusion
            conclusion.resync = Resync(donors=donors, reference=None)
            return conclusion
        problem = check_average(averaged, local_pseudo_grad, reference_rms=state.last_rms) or state_problem(
            anchor, momentum, state, claims, members=len(outcome.group), local_pseudo_grad=local_pseudo_grad, mu=mu,
            left_out=left_out(by_peer, far, self_id=self_id))
        take(conclusion, problem, lambda: state.mix(
            anchor, momentum, averaged, round=round, rounds_done=group_rounds_done(state, claims, round=round)))
    return alone_or_fold(conclusion, state, local_pseudo_grad, round=round, alone=alone)


class SubGroups:
    """The sub-group kind of round (``averaging.engine.kind.RoundKind``); worker thread only."""

    keep_partial = True  # our own values stand in for a missing share: the next groups mix them

    def __init__(self, *, mixing: Mixing, state: SharedState, outer: OuterConfig, wire: WireFormat,
                 recovery: Recovery, peer_id: str, alone: Callable[[], bool]):
        self.mixing, self.state, self.outer, self.wire, self.recovery = mixing, state, outer, wire, recovery
        self.peer_id, self._alone = peer_id, alone
        self.state_numel = state_numel(state.layout.numel)
        self.extra_code = mixing.code
        self.group_count: int | None = None  # the count of the last round we prepared (our progress record's)

    def key_bits(self, round: int) -> str | None:
        bits, _, self.group_count = self.mixing.key_bits(round)
        return bits

    def claim(self, round: int) -> dict:
        return self.state.claim_message(round=round, with_momentum=True).encode()

    def pack(self, extra: torch.Tensor) -> None:
        pack_state(self.state, extra)

    def end(self, round: int, outcome: AverageOutcome, *, pseudo_grad: torch.Tensor, sent: torch.Tensor,
            averaged: torch.Tensor, extra: torch.Tensor | None, weight: float,
            correction_out: torch.Tensor) -> RoundEnding:
        old_anchor = self.state.anchor.clone()
        usable = averaged if outcome.ok else None
        conclusion = conclude(self.state, outcome, pseudo_grad, round=round, mu=self.outer.momentum, averaged=usable,
                              mixed=extra if outcome.ok else None, alone=self._alone(), self_id=self.peer_id,
                              lattice=self.mixing.code == LATTICE_CODE)
        resynced = False
        if conclusion.resync is not None:
            logger.warning(f"round {round}: our anchor is far from our group's (its claims), too far to decode the "
                           "group's lattice-coded state; downloading it")
            # (as any re-sync: a donor that has not applied this round's step yet gets it on top)
            resynced = self.recovery.resync(round, conclusion.resync, usable)
        accounted, correction = account(self.state, conclusion, pseudo_grad=pseudo_grad, sent=sent,
                                        old_anchor=old_anchor, in_group_step=False,
                                        error_feedback=self.wire.error_feedback, out=correction_out)
        return RoundEnding(conclusion, correction, reached=accounted is not None, resynced=resynced)
