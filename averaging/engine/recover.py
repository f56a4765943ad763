"""Acting on a verdict: catch up by replaying missed outer steps, or re-sync by downloading the state.

Runs on the sync worker's thread (it fetches over the network and changes the shared state).
A catch-up costs 2 bytes/param a step and is kept only if it reaches the verdict's reference; a
re-sync costs 8 bytes/param and is checked against the reference too (``accept.check_state``).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence

import torch

from averaging.engine.clock import Clock
from averaging.network.interface import AveragingBackend
from averaging.state import accept
from averaging.state.accept import StateTooFarAhead
from averaging.state.served import AppliedUpdate
from averaging.state.shared_state import SharedState
from averaging.state.verdict import CatchUp, Resync
from protocols.messages import MessageError
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

RESYNC_ATTEMPTS = 5


def newest_round(schedule: RoundSchedule, now: float) -> int:
    """The newest round an honest state can have: the schedule's round now, plus one for a donor
    whose clock runs ahead of ours (a donor's claimed round is not trusted beyond that)."""
    return schedule.round_at(now) + 1


def download_horizon(schedule: RoundSchedule, now: float, download_timeout: float) -> int:
    """The newest round a donor's slice may honestly carry during a download starting now: donors
    keep stepping while it runs, up to ``download_timeout``."""
    return newest_round(schedule, now) + math.ceil(download_timeout / schedule.round_seconds)


class Recovery:
    """Brings our shared state to the group's anchor, with the network (worker thread only)."""

    def __init__(self, *, state: SharedState, backend: AveragingBackend, schedule: Callable[[], RoundSchedule],
                 clock: Clock, download_timeout: float):
        self.state, self.backend = state, backend
        self._schedule, self.clock, self.download_timeout = schedule, clock, download_timeout

    def first_reached(self, plans: Sequence[CatchUp], *, round: int, work_rms: float) -> CatchUp | None:
        """Try the verdict's catch-ups in order; the first that reaches its reference (None: none did)."""
        return next((plan for plan in plans if self.catch_up(plan, round=round, work_rms=work_rms)), None)

    def catch_up(self, plan: CatchUp, *, round: int, work_rms: float = 0.0) -> bool:
        """Replay ``plan.steps`` fetched from its donors after undoing our last ``plan.rewind``
        (``SharedState.catch_up``); ``work_rms``: our own pseudo-gradient's RMS, a size bound."""
        first = self.state.rounds_done - plan.rewind
        donors = list(plan.donors)
        updates = self.fetch_steps(donors, first=first, count=plan.steps)
        if len(updates) < plan.steps:
            logger.warning(f"round {round}: no peer of {donors} could send outer step {first + len(updates) + 1}; "
                           "not caught up")
            return False
        undone = f" after undoing our last {plan.rewind}" if plan.rewind else ""
        if not self.state.catch_up(updates, plan.reference, rewind=plan.rewind, work_rms=work_rms):
            logger.warning(f"round {round}: replaying {plan.steps} missed outer step(s){undone} did not reach the "
                           "group's anchor; not caught up")
            return False
        if plan.steps:
            logger.info(f"round {round}: caught up with {plan.steps} missed outer step(s){undone} from {donors}")
        return True

    def fetch_steps(self, donors: list[str], *, first: int, count: int) -> list[AppliedUpdate]:
        """The outer steps after ``first`` .. ``first + count - 1`` of them, in order, each from the
        first of ``donors`` that holds it, up to the first that none holds."""
        updates: list[AppliedUpdate] = []
        for rounds_done in range(first, first + count):
            update = self.backend.fetch_update(donors, rounds_done=rounds_done, numel=self.state.layout.numel,
                                               timeout=self.download_timeout)
            if update is None:
                break
            updates.append(update)
        return updates

    def resync(self, round: int, resync: Resync, step: torch.Tensor | None) -> bool:
        """Our anchor disagrees with the group's: take the state of a peer that agrees. ``step``:
        this round's averaged pseudo-gradient, when we applied it (a donor may have applied it
        too, or not yet: then we apply it on top of its state)."""
        logger.warning(f"round {round}: our anchor diverged from the group's; re-syncing from {resync.donors}")
        adopted = None
        donors = list(resync.donors)
        check = accept.slice_check(self.state, resync.reference)
        for _ in range(RESYNC_ATTEMPTS):
            # Per attempt: the donors may have applied this round's step, and more while we retried.
            now = self.clock.now()
            state = self.backend.download_state(
                donors, timeout=self.download_timeout, max_round=max(round, download_horizon(
                    self._schedule(), now, self.download_timeout)),
                same_state=lambda a, b: accept.same_state(self.state, a, b), check=check)
            if state is None:
                continue
            try:
                adopted = self.state.adopt(state, require_claim=True,
                                           max_round=max(round, newest_round(self._schedule(), self.clock.now())),
                                           reference=resync.reference, step=step)
            except StateTooFarAhead as e:
                # The donors stepped twice meanwhile: the next group's verdict brings a fresh reference.
                logger.warning(f"round {round}: refused the state of {state.peer}: {e}; the next round's group "
                               "check will tell us again")
                break
            except MessageError as e:
                logger.warning(f"round {round}: refused the state of {state.peer}: {e}")
                # The first donor held sets which claims the others must match: another leads next.
                donors = donors[1:] + donors[:1]
                continue
            if adopted >= round:
                break
            self.clock.sleep(0.2)  # the donor has not applied this round's outer step yet
        if adopted is not None and adopted < round and step is not None:
            self.state.apply(step, round=round)  # catch the donor's state up to this round
        return adopted is not None
