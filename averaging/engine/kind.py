"""What the two kinds of round share: the protocol the round frame drives, and how a round ended.

A kind of round says how a peer meets its group (matchmaking key, claim, what rides the extra
vector) and what it does with the group's answer, from "group formed" to "anchor moved":
``averaging.engine.whole_swarm`` (one group of everybody, a verdict on the anchor) or
``averaging.engine.subgroups`` (groups that change every round and mix their members' state).
``averaging.engine.round`` drives either.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from averaging.math.merge import merge_correction
from averaging.math.wire import accounted_for
from averaging.network.interface import AverageOutcome
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Applied, Resync, Verdict


@dataclass(slots=True)
class RoundConclusion:
    """How a round ended for the anchor: the verdict, what recovery did, the step applied."""

    applied: Applied
    group_size: int
    error: str | None = None
    verdict: Verdict | None = None  # None: no usable average (failed, partial, or none)
    caught_up: int = 0  # outer steps we missed and replayed (no re-sync)
    resync: Resync | None = None  # we could not catch up: re-sync from these donors

    @property
    def bad_claims(self) -> int:
        return self.verdict.bad_claims if self.verdict is not None else 0


@dataclass(slots=True)
class RoundEnding:
    """What a kind of round hands back to the frame once the anchor has moved (or not)."""

    conclusion: RoundConclusion
    correction: torch.Tensor  # what the live parameters get at the merge
    reached: bool  # our work is in the new anchor, or in the group's step we will replay
    given_back: float = 0.0  # weight of earlier work given back to the parameters, for our next contribution
    resynced: bool = False  # a download replaced the anchor
    lineage_merged: int = 0  # a reunion where we re-synced: our side's outer steps apart, merged
    reunion: bool = False  # the round met the other side of a split that stepped apart


class RoundKind(Protocol):
    """One kind of round, driven by ``averaging.engine.round.RoundRunner`` on the worker's thread."""

    state_numel: int  # values of our anchor and momentum at the head of the extra vector (0: they do not ride)
    extra_code: str  # the extra vector's code, both ways (for the byte counts)
    keep_partial: bool  # a result with a share missing is ok, our own values standing in for it
    group_count: int | None  # the group count of the last round prepared (None: one group of everybody)

    def key_bits(self, round: int) -> str | None:
        """hivemind's matchmaking bits for ``round`` (None: the round's own, one group)."""

    def claim(self, round: int) -> dict:
        """The claim about our anchor attached to matchmaking, encoded."""

    def pack(self, extra: torch.Tensor) -> None:
        """Write what rides at the head of the extra vector (``state_numel`` values)."""

    def end(self, round: int, outcome: AverageOutcome, *, pseudo_grad: torch.Tensor, sent: torch.Tensor,
            averaged: torch.Tensor, extra: torch.Tensor | None, weight: float,
            correction_out: torch.Tensor) -> RoundEnding:
        """From the group's answer to the moved anchor and the merge correction."""


def take(conclusion: RoundConclusion, problem: str | None, step: Callable[[], None]) -> None:
    """Apply the group's step (``step``) unless something is wrong with it (``problem``: kept as the error)."""
    if problem is None:
        step()
        conclusion.applied = Applied.AVERAGED
    else:
        conclusion.error = problem


def alone_or_fold(conclusion: RoundConclusion, state: SharedState, local_pseudo_grad: torch.Tensor, *,
                  round: int, alone: bool) -> RoundConclusion:
    """A round that applied no group step: our own if we are alone in the swarm (we then define the
    shared model), else nothing: the work folds into our next contribution."""
    if conclusion.applied != Applied.AVERAGED and alone:
        state.apply(local_pseudo_grad, round=round)
        conclusion.applied = Applied.LOCAL
    return conclusion


def account(state: SharedState, conclusion: RoundConclusion, *, pseudo_grad: torch.Tensor, sent: torch.Tensor,
            old_anchor: torch.Tensor, in_group_step: bool, error_feedback: bool,
            out: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """(What the new anchor accounts for of our work or None, the merge correction); with error
    feedback only what was sent (``averaging.math.wire``). ``in_group_step``: a partial round we replay."""
    accounted = accounted_for(pseudo_grad, sent, averaged=conclusion.applied == Applied.AVERAGED or in_group_step,
                              local=conclusion.applied == Applied.LOCAL, error_feedback=error_feedback)
    correction = merge_correction(state.anchor, old_anchor, accounted, out=out, contributed=accounted is not None)
    return accounted, correction
