"""Judging a round: what the group's claims say this peer must do before it applies the step.

Every member attaches a claim about its anchor to the all-reduce (``SharedState.claim_message``);
after it, each member decodes the others' claims, finds the anchor most of them hold
(``averaging.math.fingerprints.consensus``: every member reaches the same one) and returns a
``Verdict``: nothing to do, catch up (replay missed outer steps, tried in order), or re-sync
(download the state from these donors, checked against this reference). ``judge`` only reads the
state; the round engine acts on the verdict (``averaging.engine.recover``).

The claims describe anchors *before* this round's step, so recovery comes first and every peer
applies the same steps in the same order.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from averaging.math.fingerprints import AnchorClaim, Consensus, claim_of, consensus
from averaging.state import accept
from averaging.state.shared_state import HISTORY_ROUNDS, SharedState
from protocols.messages import MessageError

logger = logging.getLogger(__name__)


class Applied(StrEnum):
    """What a round did to the anchor (the ``applied`` field of a round record)."""

    AVERAGED = "averaged"  # the group's average was applied
    LOCAL = "local"  # alone in the swarm: our own pseudo-gradient was applied
    FOLDED = "folded"  # nothing applied: the work is folded into our next contribution


@dataclass(frozen=True, slots=True)
class CatchUp:
    """Undo our last ``rewind`` outer steps, replay ``steps`` steps fetched from ``donors``, and keep
    the result only if our anchor then matches ``reference`` (2 bytes/param a step)."""

    donors: tuple[str, ...]
    steps: int
    reference: AnchorClaim
    rewind: int = 0


@dataclass(frozen=True, slots=True)
class Resync:
    """Download the state from ``donors`` and keep it only if it matches ``reference`` (8 bytes/param)."""

    donors: list[str]
    reference: AnchorClaim | None  # None: the donors must agree with each other (a sub-group's state)


@dataclass(slots=True)
class Verdict:
    """What this peer must do about its anchor this round. Recovery: try ``catch_up`` in order until
    one reaches its reference; if none does (or none is listed), ``resync`` when set."""

    consensus: Consensus | None = None  # None: fewer than two valid claims
    bad_claims: int = 0  # claims that failed validation (ignored)
    catch_up: tuple[CatchUp, ...] = ()
    resync: Resync | None = None
    # Each valid claimant's outer steps, as it claims them (free to inflate: used only to tell a
    # member that stepped apart, a split's other side, from one that is merely behind).
    claimed_steps: dict[str, int] = field(default_factory=dict)

    @property
    def diverged(self) -> list[str]:
        return sorted(self.consensus.diverged) if self.consensus is not None else []


def judge(state: SharedState, gathered: Mapping[str, Any], *, round: int, self_id: str) -> Verdict:
    """The verdict on ``round`` from the group's raw claims (``gathered``, by peer id)."""
    agreement, bad, claims = _consensus(state, gathered, round)
    verdict = Verdict(consensus=agreement, bad_claims=bad, claimed_steps={p: c.rounds_done for p, c in claims.items()})
    if agreement is None:
        return verdict
    if self_id in agreement.diverged:
        agreeing = tuple(sorted(agreement.agreeing))
        reference = claims[agreement.reference]
        behind = reference.rounds_done - state.rounds_done
        if behind < 0 and state.agreed_before(reference):
            return verdict  # the reference's claim predates steps we applied since: ahead, not apart
        plans = []
        if 0 <= behind <= HISTORY_ROUNDS:
            plans.append(CatchUp(agreeing, behind, reference))
        if 0 <= behind < HISTORY_ROUNDS:
            # We applied a later step without an earlier one (we joined while the claims of a round
            # predated a step, so nobody saw we lacked it): undo ours, replay both.
            plans.append(CatchUp(agreeing, behind + 1, reference, rewind=1))
        verdict.catch_up, verdict.resync = tuple(plans), Resync(list(agreeing), reference)
    elif agreement.contested and self_id in agreement.agreeing:
        # We won a tie, but a diverged member may be ahead of us: replay its steps, verified against
        # its claim (a false claim costs a small fetch and changes nothing).
        ahead = sorted(((claims[p].rounds_done - state.rounds_done, p) for p in agreement.diverged
                        if 0 < claims[p].rounds_done - state.rounds_done <= HISTORY_ROUNDS), reverse=True)
        verdict.catch_up = tuple(CatchUp((peer,), steps, claims[peer]) for steps, peer in ahead)  # furthest first
    elif self_id in agreement.agreeing and state.last_round < round - 1:
        # We missed the last round's step and the members that applied it are fewer: we win, but
        # would later force them to re-sync and lose their step (docs/incidents.md). So replay it,
        # verified against their claim, when two or more members agree on it (a group's step).
        ahead = sorted(p for p in agreement.diverged if claims[p].rounds_done == state.rounds_done + 1)
        if len(ahead) >= 2 and all(accept.claims_agree(claims[p], claims[ahead[0]], state.rel_tol, state.abs_tol)
                                   for p in ahead[1:]):
            verdict.catch_up = (CatchUp(tuple(ahead), 1, claims[ahead[0]]),)
    return verdict


def _consensus(state: SharedState, gathered: Mapping[str, Any],
               round: int) -> tuple[Consensus | None, int, dict[str, AnchorClaim]]:
    claims: dict[str, AnchorClaim] = {}
    bad = 0
    for peer, raw in gathered.items():
        try:
            message = state.decode_message(raw)
            if message.round != round:
                raise MessageError(f"claim for round {message.round}, expected {round}")
            if message.rounds_done > round:  # a self-claimed count, bounded by the schedule
                raise MessageError(f"claims {message.rounds_done} outer steps by round {round}")
            claims[peer] = accept.capped(state, claim_of(message))
        except MessageError as e:
            bad += 1
            logger.warning(f"round {round}: ignoring the claim of {peer}: {e}")
    if len(claims) < 2:
        return None, bad, claims
    return consensus(claims, rel_tol=state.rel_tol, abs_tol=state.abs_tol, salt=str(round)), bad, claims
