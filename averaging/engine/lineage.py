"""Merging a split swarm's two lineages at the reunion, instead of dropping one side's work.

While a swarm is split (an outage, a router restart), each side averages within itself and steps
its own anchor: two lineages. When the sides meet, the group's consensus keeps one anchor
(``averaging.state.verdict``) and the members holding the other re-sync to it, which alone would
drop every outer step their side took apart. The rule here merges them: the swarm's anchor moves,
over the outer steps after the reunion, to the two lineages' anchors averaged by the tokens each
side trained since the split.

How, with the machinery every round already has (no extra message, no extra agreement):

- each re-syncing peer keeps a share of the distance between the two anchors in its parameters
  (``lineage_fold``): its next pseudo-gradient is ``(1 - mu) / lr * (kept - ours)`` plus its work
  since the snapshot, weighted by its own tokens since the split;
- each peer of the kept side adds its own tokens since the split to its next contribution's
  weight (its pseudo-gradient is its ordinary one);
- the group averages as always: the average carries ``T_ours / (T_kept + T_ours)`` of that scaled
  distance, and the outer step applies it with its momentum. A single pseudo-gradient ``g`` moves
  the anchor by ``lr / (1 - mu) * g`` in all (this step and the momentum's tail), so the
  ``(1 - mu) / lr`` scale makes the total move the token-weighted share of the distance, no more.

Folding a side's whole displacement since the split on top of the kept anchor instead would count
what both sides learned twice (they train on the same data); docs/design.md has the measurement.

When is a round a reunion, and not a member that slipped (a lost part, a bad disk)? Only when
all of these hold, so no side's steps are counted twice:

- the group is larger than every group we averaged in since the last *whole* round (a round
  whose group was as large as any in the last ``window`` rounds);
- our anchor took outer steps since that whole round (our side has work to weigh);
- the peers on the other side (those we re-sync from, or those who diverged from us) were in none
  of our groups since then (a slipped member re-syncs from peers it has just averaged with), and
  one of them claims outer steps taken since that whole round (it stepped apart too: a member that
  missed a round and is merely behind has not, and catches up instead).

A side that never averaged with the other (a peer that joined during the split) has no whole round
in common with it: its work is dropped as before, and the ``reunion`` event says so.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

import torch


def lineage_fold(ours: torch.Tensor, kept: torch.Tensor, *, lr: float, mu: float) -> torch.Tensor:
    """What a re-syncing peer adds to its parameters (which the re-sync put at ``kept`` plus its
    local work) so that its next pseudo-gradient carries ``(1 - mu) / lr * (kept - ours)``: the
    outer step then moves the anchor towards ``ours`` by this peer's token share of the distance
    (the module's docstring). ``ours``: our anchor before the re-sync; ``kept``: the group's, both
    before this round's outer step."""
    return ours.sub(kept).mul_((1 - mu) / lr)


class LineageWatch:
    """What we did since the last whole round, and whether a round is a reunion (sync worker's
    thread only): group sizes, members and our tokens, no tensors."""

    def __init__(self, *, window: int = 60):
        self.window = window
        self._sizes: deque[int] = deque(maxlen=window)  # group sizes of the last ``window`` rounds
        self._whole_rounds_done: int | None = None  # outer steps at the last whole round (None: none yet)
        self._apart_members: set[str] = set()  # everyone in our groups since the whole round
        self._apart_largest = 0  # the largest of those groups (0: no round since)
        self._apart_tokens = 0.0  # our tokens that reached our anchor since the whole round

    def reunion(self, *, group_size: int, others: Mapping[str, int], rounds_done: int) -> float | None:
        """Our tokens since the split if this round meets ``others`` (the other side: the peers we
        re-sync from, or those who diverged from us, with the outer steps each claims) as a reunion
        (the module's rules); else None. ``rounds_done``: our outer steps before this round's."""
        if self._whole_rounds_done is None or rounds_done <= self._whole_rounds_done or not others:
            return None
        if max(others.values()) <= self._whole_rounds_done:  # they did not step apart: only behind
            return None
        if not self._apart_largest or group_size <= self._apart_largest or self._apart_members.intersection(others):
            return None
        return self._apart_tokens

    def steps_apart(self, rounds_done: int) -> int:
        """Our outer steps since the last whole round, given ``rounds_done`` now."""
        return 0 if self._whole_rounds_done is None else max(0, rounds_done - self._whole_rounds_done)

    def observe(self, *, group: Collection[str], rounds_done: int, tokens: float) -> None:
        """After each round: its group (empty: none), our outer steps after it, and our ``tokens``
        that reached our anchor (0 when our work was folded or the anchor replaced)."""
        size = max(1, len(group))
        self._sizes.append(size)
        if size >= max(self._sizes):
            self._whole_rounds_done = rounds_done
            self._apart_members.clear()
            self._apart_largest = 0
            self._apart_tokens = 0.0
            return
        self._apart_members.update(group)
        self._apart_largest = max(self._apart_largest, size)
        self._apart_tokens += tokens
