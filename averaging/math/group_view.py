"""What the members and reducers of a sub-group must agree on, computed once per group.

From the members' signed claims (the same on every member and reducer) ``group_view`` decides the
**far** members (``averaging.math.lattice.left_out``: weight 0 in the group's mean state) and the
lattice code's **grid**. The averager process computes it for its reducers and hands ``far`` back
with the round's outcome, so the engine reads the reducers' own decision.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from averaging.math.fingerprints import NUM_PROJECTIONS, chunk_length, claim_of, momentum_of
from averaging.math.lattice import Lattice, group_lattice, left_out
from protocols.messages import ClaimMessage


@dataclass(frozen=True, slots=True)
class GroupView:
    """A group's agreed decisions (members by peer id)."""

    far: frozenset[str] = frozenset()  # their state gets weight 0 in the group's mean
    lattice: Lattice | None = None  # the lattice code's grid (a lattice-coded group with claims)


def decode_claims(raw: Mapping[str, Any], *, numel: int) -> dict[str, ClaimMessage]:
    """The members' claims that decode, by peer id, in the group's order; one that does not counts
    for nobody (every member and reducer drops the same ones)."""
    claims = {}
    for peer, encoded in raw.items():
        try:
            claims[peer] = ClaimMessage.decode(encoded, numel=numel, chunk_len=chunk_length(numel),
                                               num_projections=NUM_PROJECTIONS)
        except Exception:  # noqa: BLE001 - anything undecodable: no claim
            continue
    return claims


def group_view(claims: Mapping[str, ClaimMessage], *, lattice_coded: bool) -> GroupView:
    """The view of a group from its members' decoded claims (``decode_claims``)."""
    anchors = [claim_of(message) for message in claims.values()]
    far = left_out(anchors, coded=lattice_coded)
    grid = group_lattice(anchors, [momentum_of(m) for m in claims.values()], far) if lattice_coded and anchors \
        else None
    return GroupView(far=frozenset(peer for peer, f in zip(claims, far) if f), lattice=grid)
