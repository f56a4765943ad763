"""The global round schedule: every peer derives round numbers and deadlines from the run's
start time and round length, so nobody counts steps and nobody waits for anybody."""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RoundSchedule:
    start_time: float  # unix seconds at which round 1 begins
    round_seconds: float

    def round_at(self, t: float) -> int:
        """The round in progress at time ``t`` (1-based; 0 before the run starts)."""
        if t < self.start_time:
            return 0
        return 1 + math.floor((t - self.start_time) / self.round_seconds)

    def round_start(self, round: int) -> float:
        return self.start_time + (round - 1) * self.round_seconds

    def round_end(self, round: int) -> float:
        """The deadline of ``round``: when its all-reduce is scheduled to begin."""
        return self.start_time + round * self.round_seconds

    def progress(self, t: float) -> float:
        """Global training progress in rounds (e.g. 3.25 = a quarter into round 4); drives the lr schedule."""
        return max(0.0, (t - self.start_time) / self.round_seconds)
