"""What the round engine counts: the window being trained, finished rounds, step time, bytes."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from averaging.state.verdict import Applied


@dataclass(slots=True)
class RoundStats:
    """One finished round, as the metrics file and the view report it (field names are the
    metrics file's: users' scripts read them)."""

    round: int
    inner_steps: int
    tokens: int
    compute_s: float  # time in inner steps (throttling included)
    wait_s: float  # time the training loop was stalled on the network
    sync_s: float  # from handing over the pseudo-gradient to the averaged result
    allreduce_s: float  # the all-reduce itself (from its scheduled start)
    wall_s: float  # the round's wall-clock length
    loss: float | None
    group_size: int
    group: list[str]
    applied: Applied
    error: str | None
    diverged: list[str]
    bad_reports: int  # group members' claims that failed validation (``Verdict.bad_claims``)
    resynced: bool
    rounds_done: int
    bytes_sent: int = 0  # this round's all-reduce payload (``averaging.math.wire.round_payload``); 0 if none ran
    bytes_received: int = 0
    caught_up: int = 0  # outer steps we had missed and replayed from the group (instead of a re-sync)
    skipped: bool = False  # we stayed out of this round's sync (its work folded into the next)
    # What robust aggregation refused in this round's sync, kinds that occurred: {"bans": 1}; {} if none.
    robust: dict[str, int] = field(default_factory=dict)
    # A reunion at which we re-synced: our side's outer steps apart, merged (``averaging.engine.lineage``).
    lineage_merged: int = 0
    # The round met the other side of a split that stepped apart (the ``reunion`` event).
    lineage_reunion: bool = False


@dataclass(slots=True)
class Window:
    """The round being trained right now (training thread)."""

    round: int
    started: float
    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    loss_sum: float = 0.0
    ended: float = 0.0
    stay_out: str | None = None  # why we stay out of this round's sync, once decided

    @property
    def loss(self) -> float | None:
        return self.loss_sum / self.steps if self.steps else None


@dataclass(slots=True)
class StepTimer:
    """EMA of the inner-step time: stop early enough to meet the round deadline."""

    mean: float | None = None
    alpha: float = 0.2

    def add(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else (1 - self.alpha) * self.mean + self.alpha * seconds

    def fits_before(self, deadline: float, now: float) -> bool:
        return now + (self.mean or 0.0) <= deadline


@dataclass
class Traffic:
    """Cumulative averaging bytes (all-reduce payloads and downloads, not headers or DHT traffic:
    hivemind counts nothing per averager), updated from both threads."""

    sent: int = 0
    received: int = 0

    def __post_init__(self):
        self._lock = threading.Lock()

    def add(self, *, sent: int = 0, received: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.received += received
