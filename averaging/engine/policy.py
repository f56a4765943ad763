"""Join a round's sync or stay out of it: the policy, decided once per round as a value.

A peer stays out of a round (its work is folded into its next contribution) when it could only
hold its group back: it started training with too little of the round left, its previous sync
cannot end by this round's deadline, or the swarm's syncs take so long that its peers average only
in every k-th round (``sync_period``). How the rules were learned: docs/incidents.md.
"""

from __future__ import annotations

import logging
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from averaging.engine.config import LoopConfig, SyncMode
from averaging.engine.stats import Window
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

MAX_OUTSTANDING = 2  # syncs not yet merged: one running, one queued behind it
LATENESS_ALPHA = 0.3  # EMA weight of the newest sync's lateness (its end minus its round's deadline)
# A peer that starts training with less than this fraction of a round left stays out of it: its
# sliver of a pseudo-gradient would be judged against full ones.
MIN_FIRST_WINDOW_FRACTION = 0.5


@dataclass(frozen=True, slots=True)
class Decision:
    """Join the round's sync, or stay out of it for ``stay_out`` (a reason for the log and records)."""

    stay_out: str | None = None

    @property
    def join(self) -> bool:
        return self.stay_out is None


@dataclass(frozen=True, slots=True)
class Outstanding:
    """A sync not merged yet, as the policy sees it."""

    round: int
    done: bool


def suggested_round_seconds(lateness: float) -> float:
    """A round length that fits a sync ending ``lateness`` seconds after its deadline, with room
    for matchmaking and noise: whole seconds, a quarter more than the measured lateness."""
    return float(math.ceil(lateness * 1.25 + 1.0))


def round_advice(lateness: float | None, round_seconds: float) -> str | None:
    """What to tell a user whose syncs end more than a round after their deadline (None: they fit)."""
    if lateness is None or lateness <= round_seconds:
        return None
    return (f"syncs end {lateness:.1f}s after the deadline, longer than a round ({round_seconds:g}s): "
            f"use --round-seconds {suggested_round_seconds(lateness):g}")


class JoinPolicy:
    """The join/stay-out rules of one peer (training thread), and the sync lateness they use."""

    def __init__(self, config: LoopConfig, schedule: Callable[[], RoundSchedule],
                 swarm_lateness: Callable[[], Sequence[float]] | None = None):
        self.config = config
        self._schedule = schedule
        # The other live peers' published sync lateness, so that everyone agrees on the sync period.
        self._swarm_lateness = swarm_lateness
        self.lateness: float | None = None  # EMA of how long after its deadline our sync ends
        self._warned_round_seconds = False

    def note_lateness(self, lateness: float | None) -> None:
        """A sync ended ``lateness`` seconds after its round's deadline (None: no all-reduce ran)."""
        if lateness is None:
            return
        previous = self.lateness
        self.lateness = lateness if previous is None else (1 - LATENESS_ALPHA) * previous + LATENESS_ALPHA * lateness
        advice = round_advice(self.lateness, self._schedule().round_seconds)
        if self.config.mode == SyncMode.OVERLAP and not self._warned_round_seconds and previous is not None and advice:
            self._warned_round_seconds = True
            logger.warning(f"{advice} for a sync every round (or a smaller codec, averaging.compression); "
                           "until then this peer averages every other round or less")

    @property
    def agreed_lateness(self) -> float | None:
        """The median of our sync lateness and the other live peers' published ones: every peer
        reads the same records, and a lying minority cannot move the median. None while unmeasured."""
        values = [v for v in (self._swarm_lateness() if self._swarm_lateness is not None else ()) if math.isfinite(v)]
        if self.lateness is not None:
            values.append(self.lateness)
        return statistics.median(values) if values else None

    @property
    def sync_period(self) -> int:
        """Every how many rounds this peer can sync (it joins only rounds divisible by k): k when
        syncs take up to k rounds, from the swarm's lateness, so that all peers choose the same k."""
        lateness = self.agreed_lateness
        if lateness is None or self.config.mode == SyncMode.BLOCKING:
            return 1
        return max(1, math.ceil(lateness / self._schedule().round_seconds))

    def decide(self, round: int, *, window: Window, first_round: int, outstanding: Sequence[Outstanding],
               folded_tokens: int) -> Decision:
        """Join ``round`` or stay out of it (``window`` is the one training it; ``outstanding`` the
        syncs not merged yet, oldest first; ``folded_tokens`` work already folded into this one)."""
        if self._started_late(round, window, first_round, bool(outstanding) or folded_tokens > 0):
            left = self._schedule().round_end(round) - window.started
            return Decision(f"this peer started training {left:.1f}s before the deadline")
        if self._can_join(round, outstanding):
            return Decision()
        if outstanding and self.sync_period == 1:
            return Decision(f"the sync of round {outstanding[-1].round} is still running")
        return Decision(f"the swarm's syncs take about {self.agreed_lateness:.1f}s past their deadline, "
                        f"so its peers average in rounds divisible by {self.sync_period}")

    def _started_late(self, round: int, window: Window, first_round: int, carrying: bool) -> bool:
        """Whether our first window since the engine started covers less than
        ``MIN_FIRST_WINDOW_FRACTION`` of ``round`` (never a blocking window that did its steps)."""
        if round != first_round or window.round != round or carrying:
            return False
        if self.config.mode == SyncMode.BLOCKING and window.steps >= self.config.inner_steps:
            return False
        schedule = self._schedule()
        return schedule.round_end(round) - window.started < MIN_FIRST_WINDOW_FRACTION * schedule.round_seconds

    def _can_join(self, round: int, outstanding: Sequence[Outstanding]) -> bool:
        """Whether our sync of ``round`` can start at its deadline: at most one sync ahead of it,
        expected to end by then (a wrong guess only makes the sync late)."""
        if self.config.mode == SyncMode.BLOCKING:
            return True
        period = self.sync_period
        if period > 1 and round % period:
            return False  # the rounds every peer whose syncs take this long joins: in phase
        if not outstanding:
            return True
        if len(outstanding) >= MAX_OUTSTANDING:
            return False
        running = outstanding[-1]
        if running.done:
            return True
        expected_end = self._schedule().round_end(running.round) + (self.lateness or 0.0)
        return expected_end <= self._schedule().round_end(round)
