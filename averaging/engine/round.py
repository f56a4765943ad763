"""One round's sync on the worker's thread, as named phases:

    prepare -> exchange -> judge -> recover -> account

- **prepare** (the prepare lane, ``prepare_lead`` before the deadline): matchmaking, with our
  claim attached;
- **exchange** (at the deadline): the pseudo-gradient from the snapshot, what the codec sends,
  the all-reduce;
- **judge**: the group's claims give a ``Verdict`` (``averaging.state.verdict``);
- **recover**: act on it: catch up before the step, apply the step (the group's average if it
  is usable, ours if alone, nothing if neither: the work folds), re-sync after it if we could
  not catch up (``averaging.engine.recover``);
- **account**: what the new anchor accounts for of our work (error feedback), the merge
  correction for the live parameters, the weight carried into the next contribution, bytes.

The training thread hands a round over with ``RoundEngine.begin_sync`` and merges the result
(``RoundEngine.try_merge``); this module is the only code that changes the anchor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future, wait
from dataclasses import dataclass, field

import torch

from averaging.engine.clock import Clock
from averaging.engine.config import LoopConfig
from averaging.engine.lineage import LineageWatch, lineage_fold
from averaging.engine.mixing import (
    Mixing,
    claims_by_peer,
    far_claims,
    far_from_group,
    group_rounds_done,
    pack_state,
    state_numel,
    state_problem,
    unpack_state,
)
from averaging.engine.recover import Recovery
from averaging.engine.worker import SyncWorker
from averaging.math.codecs import bytes_per_value
from averaging.math.fingerprints import DivergenceWatch
from averaging.math.flat import FlatLayout
from averaging.math.merge import merge_correction
from averaging.math.outer_step import anchor_before_step, pseudo_gradient
from averaging.math.wire import EXTRA_CODE, LATTICE_CODE, WireFormat, accounted_for, round_payload
from averaging.network.interface import AverageOutcome
from averaging.state.accept import check_average, rms
from averaging.state.shared_state import SharedState
from averaging.state.verdict import Applied, Resync, Verdict, judge
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)
EXTRA_BYTES_PER_VALUE = bytes_per_value(EXTRA_CODE)  # the inner state on the wire (both ways)


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
class SyncResult:
    """What the worker hands back to the training thread for one round."""

    conclusion: RoundConclusion
    correction: torch.Tensor
    sync_s: float
    allreduce_s: float
    group: tuple[str, ...]
    resynced: bool
    bytes_sent: int = 0
    bytes_received: int = 0
    lateness_s: float | None = None  # when the all-reduce ended, relative to its round's deadline (None: none ran)
    rounds_done: int = 0  # outer steps applied once this round was concluded
    robust: dict[str, int] = field(default_factory=dict)
    lineage_merged: int = 0  # a reunion where we re-synced: our side's outer steps apart, merged through the next contribution
    reunion: bool = False  # the round met the other side of a split that stepped apart (either side: lineage.py's rules)
    # The group's mean of the inner optimizer's moments (``averaging.engine.inner_sync``), when they
    # rode the all-reduce and the round's average was applied; None: keep our own.
    inner_state: torch.Tensor | None = None


def conclude(state: SharedState, outcome: AverageOutcome, local_pseudo_grad: torch.Tensor, *, round: int,
             averaged: torch.Tensor | None = None, self_id: str = "", alone: bool = False,
             recovery: Recovery | None = None) -> RoundConclusion:
    """The judge and recover phases up to the step: judge the group's claims, catch up as the
    verdict says (with ``recovery``; without one no catch-up is tried), then apply the group's
    average if the round succeeded and the average is usable; otherwise our own pseudo-gradient if
    we are alone in the swarm (we then define the shared model), or nothing, so that the work is
    folded into our next contribution (the anchor must not move away from the group's). A needed
    re-sync is returned (``resync``), not done: it replaces the anchor after the step."""
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
        _take(conclusion, problem, lambda: state.apply(averaged, round=round))
    return _alone_or_fold(conclusion, state, local_pseudo_grad, round=round, alone=alone)


def _take(conclusion: RoundConclusion, problem: str | None, step: Callable[[], None]) -> None:
    """Apply the group's step (``step``) unless something is wrong with it (``problem``: kept as the error)."""
    if problem is None:
        step()
        conclusion.applied = Applied.AVERAGED
    else:
        conclusion.error = problem


def _alone_or_fold(conclusion: RoundConclusion, state: SharedState, local_pseudo_grad: torch.Tensor, *,
                   round: int, alone: bool) -> RoundConclusion:
    """A round that applied no group step: our own if we are alone in the swarm, else nothing (it folds)."""
    if conclusion.applied != Applied.AVERAGED and alone:
        state.apply(local_pseudo_grad, round=round)
        conclusion.applied = Applied.LOCAL
    return conclusion


def conclude_mixed(state: SharedState, outcome: AverageOutcome, local_pseudo_grad: torch.Tensor, *, round: int,
                   averaged: torch.Tensor | None = None, mixed: torch.Tensor | None = None,
                   alone: bool = False, self_id: str = "", lattice: bool = False) -> RoundConclusion:
    """``conclude`` for a sub-group round (``averaging.engine.mixing``): no verdict, no catch-up, no
    re-sync (anchors of different groups differ by design); if the round succeeded and both the
    average and the group's mean state (``mixed``: the extra vector's head) are usable, take the
    group's state and apply its step, so every member ends with the same anchor. Otherwise as
    ``conclude``: our own step if alone, else the work folds (our stale anchor and the folded work
    offset each other in our next group's mean).

    ``lattice``: the state rode the lattice code, which a member far from its group cannot decode
    (``averaging.math.lattice``; its averager kept our own state): such a member applies the group's
    step to its own state and re-syncs from the near members (``resync``, no reference claim: they
    hold one state after the round, and the download's donors must agree)."""
    conclusion = RoundConclusion(applied=Applied.FOLDED, group_size=max(1, len(outcome.group)), error=outcome.error)
    if outcome.ok and averaged is not None and mixed is not None:
        conclusion.group_size = len(outcome.group)
        anchor, momentum = unpack_state(mixed, state.layout.numel)
        by_peer = claims_by_peer(state, outcome.gathered, round=round)
        claims = list(by_peer.values())
        donors = far_from_group(by_peer, self_id=self_id) if lattice else None
        if donors:
            _take(conclusion, check_average(averaged, local_pseudo_grad, reference_rms=state.last_rms),
                  lambda: state.apply(averaged, round=round))
            conclusion.resync = Resync(donors=donors, reference=None)
            return conclusion
        problem = check_average(averaged, local_pseudo_grad, reference_rms=state.last_rms) or state_problem(
            anchor, momentum, state, claims, members=len(outcome.group), local_pseudo_grad=local_pseudo_grad,
            left_out=far_claims(by_peer, self_id=self_id, lattice_coded=lattice))
        _take(conclusion, problem, lambda: state.mix(
            anchor, momentum, averaged, round=round, rounds_done=group_rounds_done(state, claims, round=round)))
    return _alone_or_fold(conclusion, state, local_pseudo_grad, round=round, alone=alone)


class RoundRunner:
    """The worker thread's side of every round; holds what carries from one round to the next."""

    def __init__(self, *, state: SharedState, worker: SyncWorker, layout: FlatLayout, config: LoopConfig,
                 schedule: Callable[[], RoundSchedule], clock: Clock, wire: WireFormat, client_mode: bool,
                 peer_id: str, alone: Callable[[], bool], extra_numel: int = 0, mixing: Mixing | None = None):
        """``extra_numel``: the inner optimizer's moments ride each all-reduce (``run``'s ``inner_state``).
        ``mixing``: sub-group rounds (``averaging.engine.mixing``): the anchor and momentum ride too,
        ahead of the moments in the extra vector, and ``conclude_mixed`` replaces the verdict."""
        self.state, self.worker, self.layout, self.config = state, worker, layout, config
        self.mixing = mixing
        self.mixed_numel = state_numel(layout.numel) if mixing is not None else 0
        # The extra vector sent and averaged (sub-groups only: without them the moments' own buffer is sent).
        self._extra = torch.zeros(self.mixed_numel + extra_numel) if mixing is not None else None
        self.group_count: int | None = None  # the count of the last round we prepared (published in our progress record)
        self._schedule, self.clock = schedule, clock
        # The payload's codec (error feedback: the residual lives in the live parameters, see
        # averaging.math.wire) and, for the byte counts, whether we reduce nothing (client mode).
        self.wire, self.client_mode = wire, client_mode
        self.peer_id, self._alone = peer_id, alone
        self.recovery = Recovery(state=state, backend=worker.backend, schedule=schedule, clock=clock,
                                 download_timeout=config.download_timeout)
        self._pseudo_grad = layout.new_buffer()
        self._folded_weight = 0.0  # weight of syncs whose work reached no anchor, for the next one
        # What we sent in rounds whose result came back partial (not applied), with its weight,
        # until a later round tells whether the group applied that step (``_settle_partial``).
        self._unconfirmed: list[tuple[torch.Tensor, float]] = []
        self._robust_seen: dict[str, int] = {}  # the backend's counters at the last sync
        self._divergence = DivergenceWatch()
        self.lineage = LineageWatch()

    # -- prepare (the prepare lane) ----------------------------------------------------------------
    def prepare(self, round: int, not_before: float = 0.0, previous: Future | None = None) -> None:
        """Start ``round``'s matchmaking with our claim (not before ``not_before``). Waiting here is
        free: in blocking mode the worker has nothing else to do until then."""
        self.clock.sleep_until(not_before)
        deadline = self._schedule().round_end(round)
        if previous is not None:
            # Our claim describes our anchor: let a sync about to land update it first, as long as
            # matchmaking can still start in time (a stale claim is handled, but costs a check).
            wait([previous], timeout=max(0.0, deadline - self.config.matchmaking_seconds - self.clock.now()))
        key = {}
        if self.mixing is not None:
            bits, _, self.group_count = self.mixing.key_bits(round)
            key = {"key_bits": bits}  # (a backend without sub-groups takes no such argument)
        self.worker.backend.prepare(round=round, scheduled_time=deadline,
                                    gather=self.state.claim_message(round=round,
                                                                    with_momentum=self.mixing is not None).encode(),
                                    timeout=max(0.0, deadline - self.clock.now()) + self.worker.matchmaking_grace,
                                    **key)

    # -- the round's sync (the sync lane) ------------------------------------------------------------
    def run(self, round: int, tokens: int, event: torch.cuda.Event | None, snapshot: torch.Tensor,
            correction_out: torch.Tensor, pending_correction: torch.Tensor | None,
            prepared: Future | None, inner_state: tuple[torch.Tensor, torch.Tensor] | None = None) -> SyncResult:
        """``snapshot``: the parameters at the round's end (``event``: its copy on CUDA);
        ``pending_correction``: a previous sync's correction the snapshot does not contain yet;
        ``inner_state``: (the moments at the round's end, a buffer for the group's mean of them)."""
        if prepared is not None:
            prepared.result()  # the prepare lane's job: it raised only if the backend is broken
        if event is not None:
            event.synchronize()
        if pending_correction is not None:
            snapshot.add_(pending_correction)  # taken before that merge: as if it had been applied
        pseudo_grad = pseudo_gradient(self.state.anchor, snapshot, out=self._pseudo_grad)
        weight = float(tokens) + self._folded_weight
        extra = None
        if self._extra is not None:
            extra = self._extra
            pack_state(self.state, extra)
            if inner_state is not None:
                extra[self.mixed_numel:].copy_(inner_state[0])
        elif inner_state is not None:
            extra = inner_state[1]
            extra.copy_(inner_state[0])  # averaged in place: the snapshot stays for the landing
        sent, averaged, outcome, sync_s = self._exchange(round, pseudo_grad, weight, extra)
        robust = self._robust_since_last()
        # Only a group's all-reduce tells how long the next one will take: a failed matchmaking
        # (alone, or no group) ends on its own timeout, and peers with another history would then
        # guess differently and stay out of different rounds.
        allreduced = outcome.ok or outcome.partial > 0  # a partial result too: only its outcome is not ours
        lateness_s = self.clock.now() - self._schedule().round_end(round) if allreduced else None
        old_anchor, rounds_before = self.state.anchor.clone(), self.state.rounds_done
        conclusion, resynced = self._judge_and_recover(round, outcome, pseudo_grad, averaged)
        correction = self._account(round, outcome, conclusion, resynced, pseudo_grad, sent, old_anchor, weight,
                                   correction_out)
        merged, reunion = self._merge_lineages(round, outcome, conclusion, resynced, old_anchor, rounds_before,
                                               weight, averaged, correction)
        group_size = len(outcome.group) if allreduced else 0
        sent_bytes, received_bytes = round_payload(
            self.layout.numel, group_size, client_mode=self.client_mode,
            send_bytes_per_value=self.wire.send_bytes_per_value(),
            return_bytes_per_value=self.wire.return_bytes_per_value())
        if extra is not None:
            # with sub-groups the whole extra vector travels in the mixing code (both ways)
            per_value = bytes_per_value(self.mixing.code) if self.mixing is not None else EXTRA_BYTES_PER_VALUE
            extra_sent, extra_received = round_payload(
                extra.numel(), group_size, client_mode=self.client_mode,
                send_bytes_per_value=per_value, return_bytes_per_value=per_value)
            sent_bytes, received_bytes = sent_bytes + extra_sent, received_bytes + extra_received
        landed = None
        if inner_state is not None and outcome.ok and conclusion.applied == Applied.AVERAGED:
            landed = inner_state[1]
            if extra is not landed:
                landed.copy_(extra[self.mixed_numel:])
        return SyncResult(conclusion, correction, sync_s, outcome.allreduce_s, outcome.group, resynced,
                          sent_bytes, received_bytes, lateness_s=lateness_s, rounds_done=self.state.rounds_done,
                          robust=robust, lineage_merged=merged, reunion=reunion, inner_state=landed)

    def _exchange(self, round: int, pseudo_grad: torch.Tensor, weight: float,
                  extra: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, AverageOutcome, float]:
        """The all-reduce at the round's deadline of what the codec can carry exactly (our own full
        pseudo-gradient stays as the fallback of a local round): (sent, averaged, outcome, sync_s).
        ``extra`` (the inner optimizer's moments) is averaged in place in the same all-reduce."""
        started = self.clock.monotonic()
        sent = self.wire.to_send(pseudo_grad)
        averaged = sent.clone()
        timeout = max(0.0, self._schedule().round_end(round) - self.clock.now()) + self.worker.matchmaking_grace
        more = {} if extra is None else {"extra": extra}  # (a backend without extras takes no such argument)
        if self.mixing is not None:
            more["keep_partial"] = True  # sub-groups: our own values stand for a missing share
        outcome = self.worker.backend.average(averaged, weight=weight, timeout=timeout + self.worker.allreduce_timeout,
                                              round=round, **more)
        return sent, averaged, outcome, self.clock.monotonic() - started

    def _judge_and_recover(self, round: int, outcome: AverageOutcome, pseudo_grad: torch.Tensor,
                           averaged: torch.Tensor) -> tuple[RoundConclusion, bool]:
        """Judge, catch up, step, then re-sync if the verdict said so and no catch-up reached the
        group's anchor; (conclusion, whether a re-sync replaced the anchor)."""
        usable = averaged if outcome.ok else None
        if self.mixing is not None:
            conclusion = conclude_mixed(self.state, outcome, pseudo_grad, round=round, averaged=usable,
                                        mixed=self._extra if outcome.ok else None, alone=self._alone(),
                                        self_id=self.peer_id, lattice=self.mixing.code == LATTICE_CODE)
            if conclusion.resync is None:
                return conclusion, False
            logger.warning(f"round {round}: our anchor is far from our group's (its claims), too far to decode the "
                           "group's lattice-coded state; downloading it")
            # (as any re-sync: a donor that has not applied this round's step yet gets it on top)
            return conclusion, self.recovery.resync(round, conclusion.resync, usable)
        conclusion = conclude(self.state, outcome, pseudo_grad, round=round, averaged=usable, self_id=self.peer_id,
                              alone=self._alone(), recovery=self.recovery)
        self._report_divergence(round, conclusion.verdict)
        if conclusion.resync is None:
            return conclusion, False
        step = usable if conclusion.applied == Applied.AVERAGED else None
        return conclusion, self.recovery.resync(round, conclusion.resync, step)

    def _account(self, round: int, outcome: AverageOutcome, conclusion: RoundConclusion, resynced: bool,
                 pseudo_grad: torch.Tensor, sent: torch.Tensor, old_anchor: torch.Tensor, weight: float,
                 correction_out: torch.Tensor) -> torch.Tensor:
        """What the new anchor accounts for: with error feedback only what was sent, so the residual
        stays in the parameters for the next round (averaging.math.wire). A partial result is not
        applied, but our contribution is in the step the others applied, which we replay next
        round: it leaves the parameters as if averaged, held until that is confirmed. Work that
        reached no anchor weighs in the next contribution. Returns the merge correction."""
        # (with sub-groups a partial round folds: we keep our stale anchor and nobody replays steps)
        partial = outcome.partial > 0 and self.mixing is None
        accounted = accounted_for(pseudo_grad, sent, averaged=conclusion.applied == Applied.AVERAGED or partial,
                                  local=conclusion.applied == Applied.LOCAL, error_feedback=self.wire.error_feedback)
        correction = merge_correction(self.state.anchor, old_anchor, accounted, out=correction_out,
                                      contributed=accounted is not None)
        self._folded_weight = 0.0 if accounted is not None else weight
        if outcome.ok:
            self._folded_weight += self._settle_partial(round, conclusion, resynced, correction)
        elif partial:
            self._unconfirmed.append((accounted.clone(), weight))
        return correction

    def _merge_lineages(self, round: int, outcome: AverageOutcome, conclusion: RoundConclusion, resynced: bool,
                        old_anchor: torch.Tensor, rounds_before: int, weight: float, averaged: torch.Tensor,
                        correction: torch.Tensor) -> tuple[int, bool]:
        """At a split swarm's reunion (``averaging.engine.lineage``): re-synced, our side's anchor is
        kept in part through the correction; either side weighs its next contribution with its
        tokens since the split. Then the round is recorded. Returns the outer steps our side took
        apart that a re-sync merged instead of dropping (0: none, or we were the kept side), and
        whether the round was a reunion at all. Sub-group rounds have no sides: every round meets
        peers of other groups, and their anchors are mixed, not replaced."""
        if self.mixing is not None:
            return 0, False
        merged = 0
        verdict = conclusion.verdict
        # The other side: the peers we re-sync from, or (kept) those who diverged from us.
        other_side = conclusion.resync.donors if resynced and conclusion.resync is not None else \
            verdict.diverged if verdict is not None else []
        claimed = verdict.claimed_steps if verdict is not None else {}
        tokens = self.lineage.reunion(group_size=len(outcome.group), rounds_done=rounds_before,
                                      others={p: claimed.get(p, 0) for p in other_side}) if other_side else None
        if tokens is not None:
            self._folded_weight += tokens  # either side's work weighs in the merge with its tokens apart
            if resynced:
                kept = self.state.anchor
                if conclusion.applied == Applied.AVERAGED and self.state.last_round == round:
                    # the two lineages' distance before this round's step, which both sides took
                    kept = anchor_before_step(kept, averaged, self.state.momentum, lr=self.state.config.lr,
                                              mu=self.state.config.momentum, nesterov=self.state.config.nesterov)
                correction += lineage_fold(old_anchor, kept, lr=self.state.config.lr, mu=self.state.config.momentum)
                merged = self.lineage.steps_apart(rounds_before)
                logger.info(f"round {round}: a reunion: the {merged} outer step(s) our side took apart are merged "
                            "into the group's anchor through our next contribution (weighted by our tokens apart)")
        reached = conclusion.applied in (Applied.AVERAGED, Applied.LOCAL) and not resynced
        self.lineage.observe(group=outcome.group if outcome.ok or outcome.partial else (),
                             rounds_done=self.state.rounds_done, tokens=weight if reached else 0.0)
        return merged, tokens is not None

    def _settle_partial(self, round: int, conclusion: RoundConclusion, resynced: bool,
                        correction: torch.Tensor) -> float:
        """The first judged round after partial ones tells whether the group applied their steps:
        each step we replayed (``caught_up``) carried one of them, oldest first. A partial round
        whose step nobody applied (every member lost a share: a reducer crashed or was refused)
        gives its work back to the parameters (``correction``) for the next contribution, with its
        weight (returned). So our work is never counted twice, and never lost."""
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

    def _robust_since_last(self) -> dict[str, int]:
        """What robust aggregation refused since the previous sync (syncs run one at a time, so the
        difference of the backend's cumulative counters belongs to this one), kinds that occurred."""
        counters = self.worker.backend.robustness()
        delta = {kind: count - self._robust_seen.get(kind, 0) for kind, count in counters.items()}
        self._robust_seen = counters
        return {kind: count for kind, count in delta.items() if count}
