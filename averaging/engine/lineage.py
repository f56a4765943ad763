"""Merging a split swarm's two lineages at the reunion, instead of dropping one side's work.

While a swarm is split each side steps its own anchor; when the sides meet, the consensus keeps one
anchor and the others re-sync to it (``averaging.state.verdict``), which alone would drop their
side's outer steps. Instead the swarm's anchor moves, over the next outer steps, to the two anchors
averaged by the tokens each side trained since the split, with an ordinary round: each re-syncing
peer keeps ``(1 - mu) / lr`` of the distance to its own anchor in its parameters (``lineage_fold``),
both sides weigh that contribution by their tokens since the split, and the outer step (which moves
the anchor ``lr / (1 - mu)`` x a pseudo-gradient in all) does the rest.

A round is a reunion only when no side's steps would be counted twice (``LineageWatch.reunion``; the
rules and why: docs/design.md, "Finding each other again after an outage").
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Mapping

import torch


def lineage_fold(ours: torch.Tensor, kept: torch.Tensor, *, lr: float, mu: float) -> torch.Tensor:
    """What a re-syncing peer adds to its parameters so that its next pseudo-gradient carries
    ``(1 - mu) / lr * (kept - ours)`` (module docstring); both anchors before this round's step."""
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
        """Our tokens since the split if this round meets ``others`` (the other side, with the outer
        steps each claims) as a reunion, else None: the group is larger than every group since the
        last whole round, we stepped since, none of ``others`` was in our groups since (a slipped
        member), and one of them stepped since (else it is only behind)."""
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

    def observe(self, *, group: Collection[str], rounds_done: int, tokens: float, partial: bool = False) -> None:
        """After each round: its group (empty: none), our outer steps after it, and our ``tokens``
        that reached our anchor (0 when our work was folded or the anchor replaced). A ``partial``
        round met nobody for good and counts neither way: after a split, the halves' first group can
        come back partial, and counted whole it would hide the reunion the next round re-syncs in."""
        if partial:
            return
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
