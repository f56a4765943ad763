"""Keeping the work of a split swarm's other side at the reunion: its lineage folds, it is not lost.

While a swarm is split (an outage, a router restart), each side averages within itself and steps
its own anchor: two lineages. When the sides meet, the group's consensus keeps one anchor
(``averaging.state.verdict``) and the members holding the other re-sync to it. Re-syncing alone
would drop every outer step their side took apart. Instead each of them folds its side's
displacement since the split into its next contribution, the rule DiLoCo already applies to a
peer whose round reached no anchor: its parameters become the kept anchor minus that displacement
(plus the work since its snapshot), so its next pseudo-gradient carries the lineage's work into
the group's average, weighted by the tokens this peer trained apart. The kept lineage stays
whole, the other enters the shared model as contributions weighted by work (and judged by robust
aggregation like any other), and nothing flips back: after the fold every member holds the kept
anchor.

When is a re-sync a reunion, and not a member that slipped (a lost part, a bad disk)? Only when
all of these hold, so a fold never counts a step twice:

- the group is larger than every group we averaged in since the last *whole* round (a round
  whose group was as large as any in the last ``window`` rounds);
- our anchor took outer steps since that whole round (our side has work to keep);
- none of the peers we re-sync from was in any of our groups since then (they are the other
  side; a slipped member re-syncs from peers it has just averaged with, and folds nothing).

The anchor at the last whole round is kept in fp16 (2 bytes a parameter): a fold is a
displacement of several rounds, and fp16's 2^-11 relative rounding of the anchor is far below it.
A side that never averaged with the other (a peer that joined during the split) has no whole
round in common with it, and its steps are dropped as before (the ``reunion`` event says so).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class Fold:
    """A lineage folded at a reunion: its outer steps apart, and our tokens in them (the weight
    the next contribution carries for it)."""

    steps: int
    tokens: float


class LineageWatch:
    """The last whole round's anchor and what we did since; the fold at a reunion (sync worker's
    thread only)."""

    def __init__(self, numel: int, *, window: int = 60):
        self.window = window
        self._sizes: deque[int] = deque(maxlen=window)  # group sizes of the last ``window`` rounds
        self._whole_anchor = torch.empty(numel, dtype=torch.float16)
        self._whole_rounds_done: int | None = None  # None: no whole round yet
        self._apart_members: set[str] = set()  # everyone in our groups since the whole round
        self._apart_largest = 0  # the largest of those groups
        self._apart_tokens = 0.0  # our tokens that reached our anchor since the whole round

    def fold(self, correction: torch.Tensor, *, old_anchor: torch.Tensor, rounds_done: int, group_size: int,
             donors: Collection[str]) -> Fold | None:
        """After a re-sync that replaced ``old_anchor`` (ours, ``rounds_done`` outer steps): if it was
        a reunion (the module's rules), add our side's work since the split to ``correction`` (in
        place: the parameters then carry it into the next contribution) and return what was folded."""
        if self._whole_rounds_done is None or rounds_done <= self._whole_rounds_done:
            return None
        if not self._apart_largest or group_size <= self._apart_largest or self._apart_members.intersection(donors):
            return None
        lineage = old_anchor - self._whole_anchor.float()  # minus the displacement: anchors move by -step
        if not torch.isfinite(lineage).all():  # an anchor past fp16's range: keep the re-sync plain
            return None
        correction += lineage
        return Fold(steps=rounds_done - self._whole_rounds_done, tokens=self._apart_tokens)

    def observe(self, *, group: Collection[str], anchor: torch.Tensor, rounds_done: int, tokens: float) -> None:
        """After each round: its group (empty: none), the anchor it left, and our ``tokens`` that
        reached it (0 when our work was folded or the anchor replaced)."""
        size = max(1, len(group))
        self._sizes.append(size)
        if size >= max(self._sizes):
            self._whole_anchor.copy_(anchor)
            self._whole_rounds_done = rounds_done
            self._apart_members.clear()
            self._apart_largest = 0
            self._apart_tokens = 0.0
            return
        self._apart_members.update(group)
        self._apart_largest = max(self._apart_largest, size)
        self._apart_tokens += tokens
