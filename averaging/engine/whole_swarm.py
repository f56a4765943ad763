"""The whole-swarm round: one group of everybody, every member holding the same anchor.

From "group formed" to "anchor moved" (``WholeSwarm.end``): **judge** the members' claims
(``averaging.state.verdict``), **catch up** on missed steps (``averaging.engine.recover``),
**step** (the group's average, our own if alone, else the work folds), **re-sync** if no catch-up
reached the group's anchor, **account** for our work in the merge correction, and **settle** partial
rounds and a split swarm's reunion (``averaging.engine.lineage``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from averaging.engine.kind import RoundConclusion, RoundEnding, account, alone_or_fold, take
from averaging.engine.lineage import LineageWatch, lineage_fold
from averaging.engine.recover import Recovery
from averaging.math.fingerprints import DivergenceWatch
from averaging.math.outer_step import OuterConfig, anchor_before_step
from averaging.math.wire import EXTRA_CODE, WireFormat
from averaging.network.interface import AverageOutcome
from averaging.state.accept import check_average, rms
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Applied, Verdict, judge

logger = logging.getLogger(__name__)


def conclude(state: SharedState, outcome: AverageOutcome, local_pseudo_grad: torch.Tensor, *, round: int,
             averaged: torch.Tensor | None = None, self_id: str = "", alone: bool = False,
             recovery: Recovery | None = None) -> RoundConclusion:
    """Judge, catch up (with ``recovery``; without one none is tried) and step. A needed re-sync
    is returned (``resync``), not done: it replaces the anchor after the step."""
    # (a partial all-reduce had a group, though its result is not ours to apply)
    conclusion = RoundConclusion(applied=Applied.FOLDED, group_size=max(1, len(outcome.group)), error=outcome.error)
    if outcome.ok and averaged is not None:
        conclusion.group_size = len(outcome.group)
        verdict = conclusion.verdict = judge(state, outcome.gathered, round=round, self_id=self_id)
        reached = recovery.first_reached(verdict.catch_up, round=round, work_rms=rms(local_pseudo_grad)) \
            if recovery is not None else None
        if reached is not None:
            conclusion.caught_up = reached.steps
        else:
            conclusion.resync = verdict.resync
        problem = check_average(averaged, local_pseudo_grad, reference_rms=state.last_rms)
        take(conclusion, problem, lambda: state.apply(averaged, round=round))
    return alone_or_fold(conclusion, state, local_pseudo_grad, round=round, alone=alone)


class WholeSwarm:
    """The whole-swarm kind of round (``averaging.engine.kind.RoundKind``); worker thread only."""

    state_numel = 0
    extra_code = EXTRA_CODE  # the inner optimizer's moments, when they ride
    keep_partial = False  # a partial result is not ours to apply: the others' step is replayed next round
    group_count = None

    def __init__(self, *, state: SharedState, outer: OuterConfig, wire: WireFormat, recovery: Recovery,
                 peer_id: str, alone: Callable[[], bool]):
        self.state, self.outer, self.wire, self.recovery = state, outer, wire, recovery
        self.peer_id, self._alone = peer_id, alone
        # What we sent in partial rounds, with its weight, until ``_settle_partial``.
        self._unconfirmed: list[tuple[torch.Tensor, float]] = []
        self._divergence = DivergenceWatch()
        self.lineage = LineageWatch()

    def key_bits(self, round: int) -> str | None:
        return None

    def claim(self, round: int) -> dict:
        return self.state.claim_message(round=round).encode()

    def pack(self, extra: torch.Tensor) -> None:
        pass  # nothing of the state rides

    def end(self, round: int, outcome: AverageOutcome, *, pseudo_grad: torch.Tensor, sent: torch.Tensor,
            averaged: torch.Tensor, extra: torch.Tensor | None, weight: float,
            correction_out: torch.Tensor) -> RoundEnding:
        old_anchor, rounds_before = self.state.anchor.clone(), self.state.rounds_done
        usable = averaged if outcome.ok else None
        conclusion = conclude(self.state, outcome, pseudo_grad, round=round, averaged=usable, self_id=self.peer_id,
                              alone=self._alone(), recovery=self.recovery)
        self._report_divergence(round, conclusion.verdict)
        resynced = False
        if conclusion.resync is not None:
            step = usable if conclusion.applied == Applied.AVERAGED else None
            resynced = self.recovery.resync(round, conclusion.resync, step)
        partial = outcome.partial > 0  # our work is in the step the others applied: held until confirmed
        accounted, correction = account(self.state, conclusion, pseudo_grad=pseudo_grad, sent=sent,
                                        old_anchor=old_anchor, in_group_step=partial,
                                        error_feedback=self.wire.error_feedback, out=correction_out)
        given_back = 0.0
        if outcome.ok:
            given_back += self._settle_partial(round, conclusion, resynced, correction)
        elif partial:
            self._unconfirmed.append((accounted.clone(), weight))
        ending = RoundEnding(conclusion, correction, reached=accounted is not None, resynced=resynced)
        ending.given_back = given_back + self._merge_lineages(round, outcome, ending, old_anchor, rounds_before,
                                                              weight, averaged)
        return ending

    def _settle_partial(self, round: int, conclusion: RoundConclusion, resynced: bool,
                        correction: torch.Tensor) -> float:
        """The first judged round after partial ones tells whether the group applied their steps
        (each replayed step carried one, oldest first); one nobody applied gives its work back to
        the parameters and its weight (returned) to the next contribution: never counted twice."""
        if not self._unconfirmed:
            return 0.0
        unconfirmed, self._unconfirmed = self._unconfirmed, []
        if resynced:
            return 0.0  # the downloaded state holds whatever the group applied: nothing to tell
        lost = unconfirmed[conclusion.caught_up:]
        for sent, _ in lost:
            correction -= sent
        if lost:
            logger.info(f"round {round}: {len(lost)} partial round(s) before were applied by nobody; their "
                        "work goes into our next contribution")
        return sum(weight for _, weight in lost)

    def _merge_lineages(self, round: int, outcome: AverageOutcome, ending: RoundEnding, old_anchor: torch.Tensor,
                        rounds_before: int, weight: float, averaged: torch.Tensor) -> float:
        """At a split swarm's reunion (``averaging.engine.lineage``): re-synced, our side's anchor
        is kept in part through the correction; either side weighs its next contribution with its
        tokens since the split (returned). Then the round is recorded."""
        conclusion, verdict, resynced = ending.conclusion, ending.conclusion.verdict, ending.resynced
        # The other side: the peers we re-sync from, or (kept) those who diverged from us.
        other_side = conclusion.resync.donors if resynced and conclusion.resync is not None else \
            verdict.diverged if verdict is not None else []
        claimed = verdict.claimed_steps if verdict is not None else {}
        tokens = self.lineage.reunion(group_size=len(outcome.group), rounds_done=rounds_before,
                                      others={p: claimed.get(p, 0) for p in other_side}) if other_side else None
        if tokens is not None:
            ending.reunion = True
            if resynced:
                kept = self.state.anchor
                if conclusion.applied == Applied.AVERAGED and self.state.last_round == round:
                    # the two lineages' distance before this round's step, which both sides took
                    kept = anchor_before_step(kept, averaged, self.state.momentum, lr=self.outer.lr,
                                              mu=self.outer.momentum, nesterov=self.outer.nesterov)
                ending.correction += lineage_fold(old_anchor, kept, lr=self.outer.lr, mu=self.outer.momentum)
                ending.lineage_merged = self.lineage.steps_apart(rounds_before)
                logger.info(f"round {round}: a reunion: the {ending.lineage_merged} outer step(s) our side took "
                            "apart are merged into the group's anchor through our next contribution")
        reached = conclusion.applied in (Applied.AVERAGED, Applied.LOCAL) and not resynced
        self.lineage.observe(group=outcome.group if outcome.ok else (), rounds_done=self.state.rounds_done,
                             tokens=weight if reached else 0.0, partial=outcome.partial > 0 and not outcome.ok)
        return tokens or 0.0

    def _report_divergence(self, round: int, verdict: Verdict | None) -> None:
        """Name the members off the group's anchor (``DivergenceWatch``): once, then if they stay off."""
        agreement = verdict.consensus if verdict is not None else None
        for report in self._divergence.observe(agreement, self.peer_id):
            agreeing = f"{len(agreement.agreeing)} of {len(agreement.agreeing) + len(agreement.diverged)} members agree"
            if report.persistent:
                logger.warning(f"round {round}: {report.peer} has held an anchor the group does not in "
                               f"{report.streak} of our groups in a row ({agreeing}): it is not catching up, "
                               "or it lies about its anchor")
            else:
                logger.info(f"round {round}: {report.peer} holds an anchor the group does not ({agreeing}); "
                            "it should catch up or re-sync")
