"""The round engine: when a round ends, what the sync worker does with it, and the merge.

One ``OuterLoop`` per peer, driven by the training loop with one ``after_step`` call per inner
step; the node and the library API both use it. The training loop never waits on the network
unless it must:

- **overlap** (default): rounds are wall-clock windows on the run's schedule. At the last step
  boundary before the deadline the loop snapshots its parameters (device→pinned host, async on
  CUDA) and calls ``begin_sync``; the worker thread computes the pseudo-gradient, runs the
  all-reduce and the outer step, and prepares matchmaking for the next round, while the loop
  keeps training. ``try_merge`` at a later step boundary adds the result in one fused pass
  (``averaging.math.merge``). The loop never waits for the network: a sync may outlast its round.
  Matchmaking for the next round then runs beside it (the worker's prepare lane), and if the
  running sync is expected to end before the next deadline the next round's sync is queued behind
  it (its snapshot taken at its own deadline, its pseudo-gradient corrected for the merge that had
  not happened yet: double buffers). If not, the peer stays out of that round: its work is folded
  into its next contribution, and the outer step it missed is replayed from the group's history
  when it rejoins (``OuterState.catch_up``), not by downloading the state.
- **blocking** (the OpenDiLoCo baseline): a fixed number of inner steps per round (fewer if the
  deadline comes first), then the loop waits, idle, for the all-reduce at the round's deadline:
  every peer waits for the slowest, and for the network.

Threads: ``after_step``/``begin_sync``/``try_merge`` run on the training thread; the sync job runs
on the worker's thread and is the only code that changes the anchor; the two meet through the
jobs' futures. At most two syncs are outstanding (one running, one queued), so two snapshot and
two correction buffers suffice: a job's buffers are reused only after it was merged.

Time: every clock read and every wait goes through a ``Clock`` (the real one unless a test passes
a fake whose time moves only when the test says so; ``tests/unit/fake_clock.py``).
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, wait
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Protocol, TypeVar

import torch

from averaging.engine.worker import SyncWorker
from averaging.math.fingerprints import AnchorClaim, DivergenceWatch
from averaging.math.flat import FlatLayout
from averaging.math.merge import apply_correction_, merge_correction
from averaging.math.outer_step import pseudo_gradient
from averaging.math.traffic import round_payload
from averaging.math.wire import WireFormat, accounted_for
from averaging.network.interface import AppliedUpdate, DownloadedState, Progress
from averaging.state.shared_state import Applied, OuterState, RoundConclusion, StateTooFarAhead
from protocols.errors import ConfigError
from protocols.messages import MessageError
from protocols.schedule import RoundSchedule

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Clock(Protocol):
    """Where the round engine reads time and waits. Both threads use it: ``now``/``monotonic`` on
    the training thread and the worker's; ``sleep``/``sleep_until`` only on the worker's;
    ``wait`` only on the training thread, for a job on the worker. Waiting on a job goes through
    the clock too, so that a fake one knows the loop is idle and can let the worker's sleeps pass."""

    def now(self) -> float:
        """Unix seconds: the run's schedule (round deadlines) is in these."""

    def monotonic(self) -> float:
        """Seconds from an arbitrary origin, for durations."""

    def sleep(self, seconds: float) -> None: ...

    def sleep_until(self, when: float) -> None:
        """Return once ``now() >= when`` (at once if it already is)."""

    def wait(self, job: Future[T]) -> T:
        """Block until a worker job is done; its result (or its exception, raised)."""


class SystemClock:
    """The real clock."""

    def now(self) -> float:
        return time.time()

    def monotonic(self) -> float:
        return time.perf_counter()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)

    def sleep_until(self, when: float) -> None:
        time.sleep(max(0.0, when - time.time()))

    def wait(self, job: Future[T]) -> T:
        return job.result()


SYSTEM_CLOCK = SystemClock()


class SyncMode(StrEnum):
    """How a round ends (``round.sync_mode``)."""

    OVERLAP = "overlap"  # wall-clock rounds; average in the background while training
    BLOCKING = "blocking"  # H inner steps, then wait for the all-reduce: the OpenDiLoCo baseline


SYNC_MODES = tuple(mode.value for mode in SyncMode)
RESYNC_ATTEMPTS = 5
MAX_OUTSTANDING = 2  # syncs not yet merged: one running, one queued behind it
LATENESS_ALPHA = 0.3  # EMA weight of the newest sync's lateness (its end minus its round's deadline)
# A peer that starts training (joined, resumed) with less than this fraction of a round left stays
# out of that round and brings its work to the next. Its pseudo-gradient would be a sliver of an
# honest one, and robust aggregation judges a group's parts against our own (``averaging.math.robust``):
# seen in a test, a peer resumed 0.6 s before a 6 s round's deadline refused its only partner's part
# (three folded rounds of work, over 30x ours) and banned it.
MIN_FIRST_WINDOW_FRACTION = 0.5


@dataclass(slots=True)
class RoundStats:
    """One finished round, as the metrics file and the view report it."""

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
    bad_reports: int
    resynced: bool
    rounds_done: int
    bytes_sent: int = 0  # this round's all-reduce payload (``averaging.math.traffic.round_payload``); 0 if none ran
    bytes_received: int = 0
    caught_up: int = 0  # outer steps we had missed and replayed from the group (instead of a re-sync)
    skipped: bool = False  # we stayed out of this round: our previous sync was still running
    # What robust aggregation refused during this round's sync (``AveragingBackend.robustness``),
    # only the kinds that occurred: e.g. {"refused_parts": 2, "bans": 1}; {} on a clean round.
    robust: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Window:
    """The round being trained right now."""

    round: int
    started: float
    steps: int = 0
    tokens: int = 0
    compute_s: float = 0.0
    wait_s: float = 0.0
    loss_sum: float = 0.0
    ended: float = 0.0
    stayed_out: str | None = None  # why we stay out of this round's sync, once decided


@dataclass(slots=True)
class _SyncResult:
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


@dataclass(slots=True)
class _Job:
    window: _Window
    future: Future
    slot: int  # which snapshot/correction buffers it uses
    then: list[RoundStats] = field(default_factory=list)  # skipped rounds reported after this one


@dataclass(slots=True)
class StepTimer:
    """EMA of the inner-step time: stop early enough to meet the round deadline."""

    mean: float | None = None
    alpha: float = 0.2

    def add(self, seconds: float) -> None:
        self.mean = seconds if self.mean is None else (1 - self.alpha) * self.mean + self.alpha * seconds

    def fits_before(self, deadline: float, now: float) -> bool:
        return now + (self.mean or 0.0) <= deadline


@dataclass(kw_only=True, slots=True)
class LoopConfig:
    """How rounds end and how long the network may take."""

    mode: SyncMode = SyncMode.OVERLAP
    inner_steps: int = 100  # blocking mode: inner steps per round
    matchmaking_seconds: float = 3.0
    prepare_lead: float = 4.5  # overlap mode: start matchmaking this long before the round's deadline
    download_timeout: float = 60.0

    def __post_init__(self):
        self.mode = validate_sync(self.mode, self.inner_steps)


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


def validate_sync(mode: str, inner_steps: int) -> SyncMode:
    """The checks ``[round]`` and ``LoopConfig`` share; messages name the config keys."""
    if mode not in SYNC_MODES:
        raise ConfigError(f"round.sync_mode ({mode!r}) must be one of: {', '.join(SYNC_MODES)}")
    if inner_steps < 1:
        raise ConfigError(f"round.inner_steps ({inner_steps}) must be >= 1")
    return SyncMode(mode)


class OuterLoop:
    def __init__(self, *, outer: OuterState, worker: SyncWorker, layout: FlatLayout,
                 params: Callable[[], dict[str, torch.Tensor]], schedule: Callable[[], RoundSchedule],
                 config: LoopConfig, peer_id: str, alone: Callable[[], bool], device: torch.device,
                 clock: Clock = SYSTEM_CLOCK, wire: WireFormat | None = None, client_mode: bool = False,
                 swarm_lateness: Callable[[], Sequence[float]] | None = None):
        self.outer, self.worker, self.layout = outer, worker, layout
        # The payload's codec (error feedback: the residual lives in the live parameters, see
        # averaging.math.wire) and, for the byte counts, whether we reduce nothing (client mode).
        self.wire, self.client_mode = wire or WireFormat(), client_mode
        self._params, self._schedule, self.config = params, schedule, config
        self.peer_id, self._alone, self.device = peer_id, alone, device
        # The other live peers' published sync lateness (their progress records): the sync period
        # is agreed on from everyone's, so that the peers average in the same rounds (sync_period).
        self._swarm_lateness = swarm_lateness
        self.clock = clock  # read on both threads (see Clock)
        cuda = device.type == "cuda"
        # Host staging for the parameter snapshots and the merge corrections: pinned so that
        # device<->host copies are async. Two of each (slot 1 allocated when first needed): a sync
        # queued behind a running one must not overwrite the buffers the running one still uses.
        self._pinned = cuda
        self._host_params: list[torch.Tensor | None] = [layout.new_buffer(pin_memory=cuda), None]
        self._host_correction: list[torch.Tensor | None] = [layout.new_buffer(pin_memory=cuda), None]
        self._pseudo_grad = layout.new_buffer()
        self._device_correction = torch.empty(layout.numel, device=device) if cuda else None
        self._timer = StepTimer()
        self._jobs: deque[_Job] = deque()  # submitted, not yet merged (oldest first)
        self._skipped_tokens = 0  # tokens of rounds we stayed out of, for our next contribution
        self._carried_weight = 0.0  # worker thread: weight of syncs that folded, for the next one
        # Worker thread: what we sent in rounds whose result came back partial (not applied), with
        # its weight, until a later round tells whether the group applied that step (see _settle_partial).
        self._unconfirmed: list[tuple[torch.Tensor, float]] = []
        self._prepared_round = 0  # the last round we decided about (joined or skipped)
        self._first_round = 0  # the round start() began in (our first window, nothing carried into it)
        self._prepares: dict[int, Future] = {}  # round -> its matchmaking job (prepare lane)
        self._lateness: float | None = None  # EMA of how long after its deadline a sync ends
        self._robust_seen: dict[str, int] = {}  # worker thread: the backend's counters at the last sync
        self._warned_round_seconds = False
        self._divergence = DivergenceWatch()
        self.window: _Window | None = None
        self.last_download: DownloadedState | None = None  # the state adopted by initial_sync

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.window.round if self.window else 0

    @property
    def syncing(self) -> bool:
        """A round's sync is in flight (the loop keeps training meanwhile in overlap mode)."""
        return bool(self._jobs)

    def outstanding(self) -> list[tuple[int, Future]]:
        """The rounds whose sync has not been merged yet, oldest first, with their jobs."""
        return [(job.window.round, job.future) for job in self._jobs]

    @property
    def sync_period(self) -> int:
        """Every how many rounds this peer can sync: 1 while syncs end within a round of their
        deadline; k when they take up to k rounds. Such a peer joins only rounds divisible by k.
        Deciding each round from its own timing alone, a peer could settle one round off the
        others' phase and then always meet nobody; and peers that each chose k from their own
        lateness chose differently (14-34 s syncs in 12 s rounds: k = 2 or 3) and met only in
        pairs, each pair on its own lineage. So k comes from the swarm's lateness (``agreed_lateness``)."""
        lateness = self.agreed_lateness
        if lateness is None or self.config.mode == SyncMode.BLOCKING:
            return 1
        return max(1, math.ceil(lateness / self._schedule().round_seconds))

    @property
    def agreed_lateness(self) -> float | None:
        """The median of our sync lateness and the other live peers' published ones (every peer
        reads the same records, so they agree on it up to a heartbeat; a minority claiming any
        lateness cannot move the median out of the honest peers' range). Ours alone while nobody
        else published one; None while nobody has measured any."""
        values = [v for v in (self._swarm_lateness() if self._swarm_lateness is not None else ()) if math.isfinite(v)]
        if self._lateness is not None:
            values.append(self._lateness)
        return statistics.median(values) if values else None

    @property
    def sync_lateness(self) -> float | None:
        """How long after its round's deadline a sync typically ends (seconds, EMA), once measured."""
        return self._lateness

    def start(self) -> None:
        now = self.clock.now()
        self.window = _Window(max(1, self._schedule().round_at(now)), started=now)
        self._first_round = self.window.round
        self._maybe_prepare(now)

    def initial_sync(self, donors: list[str], *, newer_than: int = -1, progress: Progress | None = None) -> int | None:
        """Adopt the shared state of a running swarm (blocking: before training starts), unless
        it is not newer than ``newer_than`` (a peer resumed from a checkpoint keeps its own).
        ``progress(done_bytes, total_bytes)`` is called on the worker thread."""
        state = self.clock.wait(self.worker.submit(self.worker.backend.download_state, donors,
                                                   timeout=self.config.download_timeout, progress=progress,
                                                   same_state=self.outer.same_state, max_round=self._download_horizon(),
                                                   check=self.outer.slice_check()))
        if state is None:
            return None
        offered = state.metadata.get("round") if isinstance(state.metadata, dict) else None
        if isinstance(offered, int) and offered <= newer_than:
            logger.info(f"the swarm's state (round {offered}) is not newer than ours (round {newer_than}): kept ours")
            return None
        # MessageError if invalid: the caller reports it.
        adopted = self.outer.adopt(state, require_claim=True, max_round=self._now_round())
        self.load_anchor_into_params()
        self.last_download = state
        return adopted

    def resume(self, state: DownloadedState) -> int:
        """Start from a saved shared state (a checkpoint): validated like a download."""
        adopted = self.outer.adopt(state)
        self.load_anchor_into_params()
        return adopted

    def _now_round(self) -> int:
        """The newest round an honest state can have: the schedule's round now, plus one for a donor
        whose clock runs ahead of ours (a donor's claimed round is not trusted beyond that)."""
        return self._schedule().round_at(self.clock.now()) + 1

    def _download_horizon(self) -> int:
        """The newest round a donor's slice may honestly carry during a download starting now: the
        donors keep stepping while it runs (up to ``download_timeout``). Bounded at the start, a
        download on a slow link refused every donor that had moved on (3.3 Mbit/s, 63 s: "expected
        an int in [0, 4], got 5"), gave up, and the joiner started from the initial weights."""
        return self._now_round() + math.ceil(self.config.download_timeout / self._schedule().round_seconds)

    def progress(self, now: float | None = None) -> float:
        """Global progress in rounds, for the inner learning-rate schedule."""
        return self._schedule().progress(self.clock.now() if now is None else now)

    def finish(self) -> list[RoundStats]:
        """Leaving: let a sync in flight land (bounded by the all-reduce timeout)."""
        return self.try_merge(wait=True)

    # -- the training thread's side ----------------------------------------------------------
    def after_step(self, *, tokens: int, seconds: float, loss: float | None = None) -> list[RoundStats]:
        """Call after every inner step; returns the rounds that finished (usually none)."""
        window = self.window
        window.steps += 1
        window.tokens += tokens
        window.compute_s += seconds
        if loss is not None:
            window.loss_sum += loss
        self._timer.add(seconds)
        finished = self.try_merge()
        self._maybe_prepare(self.clock.now())
        if self._round_over():
            finished += self.begin_sync()
        return finished

    def _maybe_prepare(self, now: float) -> None:
        """Start matchmaking shortly before the deadline. Not earlier: a step prepared long in
        advance sits in hivemind's matchmaking where late peers of the previous round could find it.
        A peer that cannot be ready to average at the deadline stays out of the round instead: in a
        group it would hold everyone's all-reduce back (``_can_join``)."""
        round = self.window.round
        if self._prepared_round < round and now >= self._schedule().round_end(round) - self.config.prepare_lead:
            self._decide(round)

    def _decide(self, round: int, *, not_before: float = 0.0) -> None:
        """Join ``round`` (its matchmaking queued on the prepare lane, not before ``not_before``) or
        stay out of it. Once per round: at its prepare time, or in ``begin_sync`` if the window ends
        before that (blocking mode's early steps; steps longer than ``prepare_lead``), by the same rules."""
        self._prepared_round = round
        if self._started_late(round):
            self._stay_out(self._late_reason(round))
        elif self._can_join(round):
            previous = self._jobs[-1].future if self._jobs else None
            self._prepares[round] = self.worker.submit_prepare(self._prepare, round, not_before=not_before,
                                                               previous=previous)
        elif self._jobs and self.sync_period == 1:
            self._stay_out(f"the sync of round {self._jobs[-1].window.round} is still running")
        else:
            self._stay_out(f"the swarm's syncs take about {self.agreed_lateness:.1f}s past their deadline, "
                           f"so its peers average in rounds divisible by {self.sync_period}")

    def _stay_out(self, reason: str) -> None:
        self.window.stayed_out = reason
        logger.info(f"round {self.window.round}: staying out, {reason}; this round's work goes into the next "
                    "contribution")

    def _late_reason(self, round: int) -> str:
        left = self._schedule().round_end(round) - self.window.started
        return f"this peer started training {left:.1f}s before the deadline"

    def _started_late(self, round: int) -> bool:
        """Whether our first window (since ``start``) covers less than ``MIN_FIRST_WINDOW_FRACTION``
        of ``round``: we joined or resumed near its deadline. Both modes: a blocking joiner with a
        few steps, met by a partner with a full round, is as likely to refuse the partner's part
        (over 30x its own) and ban it. Only the first window: blocking mode restarts every window
        after its wait, and that is lockstep, not lateness; nor is a blocking window that did its
        ``inner_steps`` (a full contribution, however little time was left)."""
        if round != self._first_round or self.window.round != round or self._jobs or self._skipped_tokens:
            return False
        if self.config.mode == SyncMode.BLOCKING and self.window.steps >= self.config.inner_steps:
            return False
        schedule = self._schedule()
        return schedule.round_end(round) - self.window.started < MIN_FIRST_WINDOW_FRACTION * schedule.round_seconds

    def _can_join(self, round: int) -> bool:
        """Whether our sync of ``round`` can start at its deadline: no more than one sync ahead of
        it, and that one expected to end by then (from how late past their deadlines recent syncs
        ended). A wrong guess costs lateness, not correctness: the sync is queued and runs late."""
        if self.config.mode == SyncMode.BLOCKING:
            return True
        period = self.sync_period
        if period > 1 and round % period:
            return False  # the rounds every peer whose syncs take this long joins: in phase
        if not self._jobs:
            return True
        if len(self._jobs) >= MAX_OUTSTANDING:
            return False
        running = self._jobs[-1]
        if running.future.done():
            return True
        expected_end = self._schedule().round_end(running.window.round) + (self._lateness or 0.0)
        return expected_end <= self._schedule().round_end(round)

    def _round_over(self) -> bool:
        if self.config.mode == SyncMode.BLOCKING and self.window.steps >= self.config.inner_steps:
            return True  # then wait, idle, for the all-reduce at the deadline: lockstep
        return not self._timer.fits_before(self._schedule().round_end(self.window.round), self.clock.now())

    def begin_sync(self) -> list[RoundStats]:
        """End the current round: snapshot, hand it to the worker, start the next window. In
        overlap mode this never waits for an earlier sync (``try_merge`` merges what has landed)."""
        blocking = self.config.mode == SyncMode.BLOCKING
        finished = self.try_merge(wait=blocking)
        window, now = self.window, self.clock.now()
        window.ended = now
        next_round = max(window.round + 1, self._schedule().round_at(now))
        if self._prepared_round < window.round:  # the window ended before its prepare time
            self._decide(window.round, not_before=self._schedule().round_end(window.round) - self.config.prepare_lead)
        prepared = self._prepares.pop(window.round, None)
        for stale in [r for r in self._prepares if r < window.round]:
            self._prepares.pop(stale)
        self.window = _Window(next_round, started=now)
        if prepared is None:  # we stayed out of this round: fold its work into the next one
            self._skipped_tokens += window.tokens
            finished += self._report_later(self._skipped_stats(window))
            return finished
        assert len(self._jobs) < MAX_OUTSTANDING, "a round was joined with two syncs outstanding"
        # Buffers: the other pair than the sync still in flight (allocated only if one ever is).
        slot = 1 - self._jobs[-1].slot if self._jobs else 0
        if self._host_params[slot] is None:
            self._host_params[slot] = self.layout.new_buffer(pin_memory=self._pinned)
            self._host_correction[slot] = self.layout.new_buffer(pin_memory=self._pinned)
        event = self._snapshot_params(self._host_params[slot])
        # A sync still in flight has a correction this snapshot does not contain yet.
        pending = self._jobs[-1].slot if self._jobs else None
        tokens, self._skipped_tokens = window.tokens + self._skipped_tokens, 0
        future = self.worker.submit(self._sync_round, window.round, tokens, event, slot, pending, prepared)
        self._jobs.append(_Job(window, future, slot))
        if blocking:
            finished += self.try_merge(wait=True)
            self.window.started = self.clock.now()  # the wait belongs to the round that ended
        return finished

    def _report_later(self, stats: RoundStats) -> list[RoundStats]:
        """Keep reports in round order: a skipped round is reported after the syncs before it."""
        if self._jobs:
            self._jobs[-1].then.append(stats)
            return []
        return [stats]

    def _skipped_stats(self, window: _Window) -> RoundStats:
        reason = window.stayed_out or "the previous round's sync was still running"
        return RoundStats(
            round=window.round, inner_steps=window.steps, tokens=window.tokens, compute_s=window.compute_s,
            wait_s=window.wait_s, sync_s=0.0, allreduce_s=0.0, wall_s=window.ended - window.started,
            loss=window.loss_sum / window.steps if window.steps else None, group_size=1, group=[],
            applied=Applied.FOLDED, error=f"skipped: {reason}", diverged=[],
            bad_reports=0, resynced=False, rounds_done=self.outer.rounds_done, skipped=True)

    def try_merge(self, wait: bool = False) -> list[RoundStats]:
        """Merge finished syncs into the live parameters, oldest first (a step boundary); never
        blocks unless ``wait``, which merges every outstanding sync."""
        finished: list[RoundStats] = []
        while self._jobs and (wait or self._jobs[0].future.done()):
            finished += self._merge_job(self._jobs.popleft())
        return finished

    def _merge_job(self, job: _Job) -> list[RoundStats]:
        already_done, waited_from = job.future.done(), self.clock.monotonic()
        result: _SyncResult = self.clock.wait(job.future)
        stall_s = 0.0 if already_done else self.clock.monotonic() - waited_from
        self._merge(result.correction)
        self._note_lateness(result.lateness_s)
        # In blocking mode the round's own wait is part of the round; in overlap mode a wait (only
        # ``finish`` waits) is charged to the window that had to wait.
        charged = job.window if self.config.mode == SyncMode.BLOCKING else self.window
        charged.wait_s += stall_s
        conclusion = result.conclusion
        window = job.window
        end = self.clock.now() if self.config.mode == SyncMode.BLOCKING else window.ended
        return [RoundStats(
            round=window.round, inner_steps=window.steps, tokens=window.tokens, compute_s=window.compute_s,
            wait_s=window.wait_s, sync_s=result.sync_s, allreduce_s=result.allreduce_s, wall_s=end - window.started,
            loss=window.loss_sum / window.steps if window.steps else None,
            group_size=conclusion.group_size, group=list(result.group), applied=conclusion.applied,
            error=conclusion.error, diverged=sorted(conclusion.verdict.diverged) if conclusion.verdict else [],
            bad_reports=conclusion.bad_reports, resynced=result.resynced, rounds_done=result.rounds_done,
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received, caught_up=conclusion.caught_up,
            robust=result.robust,
        ), *(replace(skipped, rounds_done=result.rounds_done) for skipped in job.then)]

    def _note_lateness(self, lateness: float | None) -> None:
        if lateness is None:
            return
        previous = self._lateness
        self._lateness = lateness if previous is None else (1 - LATENESS_ALPHA) * previous + LATENESS_ALPHA * lateness
        advice = round_advice(self._lateness, self._schedule().round_seconds)
        if self.config.mode == SyncMode.OVERLAP and not self._warned_round_seconds and previous is not None and advice:
            self._warned_round_seconds = True
            logger.warning(f"{advice} for a sync every round (or a smaller codec, averaging.compression); "
                           "until then this peer averages every other round or less")

    @torch.no_grad()
    def _snapshot_params(self, buffer: torch.Tensor) -> torch.cuda.Event | None:
        """Copy the live parameters to a host buffer; on CUDA asynchronously, with an event
        the worker waits on (the copies are stream-ordered before the next step's kernels)."""
        params = self._params()
        for name, view in self.layout.views(buffer).items():
            view.copy_(params[name].detach(), non_blocking=True)
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @torch.no_grad()
    def _merge(self, correction: torch.Tensor) -> None:
        params = self._params()
        names = self.layout.names
        if self._device_correction is not None:
            # Pinned host buffer → device, stream-ordered before the next step's kernels; the
            # worker rewrites the host buffer only after the next snapshot's event, i.e. later.
            self._device_correction.copy_(correction, non_blocking=True)
            corrections = self.layout.views(self._device_correction)
        else:
            corrections = self.layout.views(correction)
        apply_correction_([params[n].data for n in names], [corrections[n] for n in names])

    @torch.no_grad()
    def load_anchor_into_params(self) -> None:
        params = self._params()
        for name, view in self.layout.views(self.outer.anchor).items():
            params[name].data.copy_(view)

    # -- the worker thread's side ------------------------------------------------------------
    def _prepare(self, round: int, not_before: float = 0.0, previous: Future | None = None) -> None:
        # Waiting here is free: in blocking mode the worker has nothing else to do until then.
        self.clock.sleep_until(not_before)
        deadline = self._schedule().round_end(round)
        if previous is not None:
            # Our report describes our anchor: let a sync about to land update it first, as long as
            # matchmaking can still start in time (a stale report is handled, but costs a check).
            wait([previous], timeout=max(0.0, deadline - self.config.matchmaking_seconds - self.clock.now()))
        self.worker.backend.prepare(round=round, scheduled_time=deadline,
                                    gather=self.outer.round_report(round=round).encode(),
                                    timeout=max(0.0, deadline - self.clock.now()) + self.worker.matchmaking_grace)

    def _sync_round(self, round: int, tokens: int, event: torch.cuda.Event | None, slot: int,
                    pending: int | None, prepared: Future | None) -> _SyncResult:
        # 1. The pseudo-gradient, once the snapshot has reached the host (and matchmaking began).
        if prepared is not None:
            prepared.result()  # the prepare lane's job: it raised only if the backend is broken
        if event is not None:
            event.synchronize()
        snapshot = self._host_params[slot]
        if pending is not None:
            # Taken before the previous sync's merge: as if that correction had been applied.
            snapshot.add_(self._host_correction[pending])
        pseudo_grad = pseudo_gradient(self.outer.anchor, snapshot, out=self._pseudo_grad)
        weight = float(tokens) + self._carried_weight
        # 2. The all-reduce at the round's deadline, of what the codec can carry exactly (our own
        #    full pseudo-gradient stays as the fallback of a local round).
        started = self.clock.monotonic()
        sent = self.wire.to_send(pseudo_grad)
        averaged = sent.clone()
        timeout = max(0.0, self._schedule().round_end(round) - self.clock.now()) + self.worker.matchmaking_grace
        outcome = self.worker.backend.average(averaged, weight=weight, timeout=timeout + self.worker.allreduce_timeout,
                                              round=round)
        sync_s = self.clock.monotonic() - started
        robust = self._robust_since_last()
        # Only a group's all-reduce tells how long the next one will take: a failed matchmaking
        # (alone, or no group) ends on its own timeout, and peers with another history would then
        # guess differently and stay out of different rounds.
        allreduced = outcome.ok or outcome.partial > 0  # a partial result too: only its outcome is not ours
        lateness_s = self.clock.now() - self._schedule().round_end(round) if allreduced else None
        # 3. Consistency check (catching up with missed outer steps, or re-syncing if we cannot),
        #    then the outer step.
        old_anchor = self.outer.anchor.clone()
        conclusion = self.outer.conclude(outcome, pseudo_grad, round=round, averaged=averaged if outcome.ok else None,
                                         self_id=self.peer_id, alone=self._alone(),
                                         catch_up=lambda donors, steps, reference, rewind, work_rms: self._catch_up(
                                             round, donors, steps, reference, rewind, work_rms))
        self._report_divergence(round, conclusion)
        resynced = bool(conclusion.donors) and self._resync(round, conclusion, averaged if outcome.ok else None)
        # 4. What the new anchor accounts for: with error feedback only what was sent, so the
        #    residual stays in the parameters for the next round (averaging.math.wire). A partial result
        #    is not applied, but our contribution is in the step the others applied, which we replay
        #    next round: it leaves the parameters as if averaged, held until that is confirmed.
        accounted = accounted_for(pseudo_grad, sent, averaged=conclusion.applied == Applied.AVERAGED or outcome.partial > 0,
                                  local=conclusion.applied == Applied.LOCAL, error_feedback=self.wire.error_feedback)
        correction = merge_correction(self.outer.anchor, old_anchor, accounted, out=self._host_correction[slot],
                                      contributed=accounted is not None)
        # Work that reached no anchor weighs in the next contribution.
        self._carried_weight = 0.0 if accounted is not None else weight
        if outcome.ok:
            self._carried_weight += self._settle_partial(round, conclusion, resynced, correction)
        elif outcome.partial:
            self._unconfirmed.append((accounted.clone(), weight))
        sent_bytes, received_bytes = round_payload(
            self.layout.numel, len(outcome.group) if allreduced else 0, client_mode=self.client_mode,
            send_bytes_per_value=self.wire.send_bytes_per_value(),
            return_bytes_per_value=self.wire.return_bytes_per_value())
        return _SyncResult(conclusion, correction, sync_s, outcome.allreduce_s, outcome.group, resynced,
                           sent_bytes, received_bytes, lateness_s=lateness_s, rounds_done=self.outer.rounds_done,
                           robust=robust)

    def _report_divergence(self, round: int, conclusion: RoundConclusion) -> None:
        """Name the members off the group's anchor (``DivergenceWatch``): once, then if they stay off."""
        verdict = conclusion.verdict
        for report in self._divergence.observe(verdict, self.peer_id):
            agreeing = f"{len(verdict.agreeing)} of {len(verdict.agreeing) + len(verdict.diverged)} members agree"
            if report.persistent:
                logger.warning(f"round {round}: {report.peer} has held an anchor the group does not in "
                               f"{report.streak} of our groups in a row ({agreeing}): it is not catching up, "
                               "or it lies about its anchor")
            else:
                logger.info(f"round {round}: {report.peer} holds an anchor the group does not ({agreeing}); "
                            "it should catch up or re-sync")

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

    def _robust_since_last(self) -> dict[str, int]:
        """What robust aggregation refused since the previous sync (syncs run one at a time, so the
        difference of the backend's cumulative counters belongs to this one), kinds that occurred."""
        counters = self.worker.backend.robustness()
        delta = {kind: count - self._robust_seen.get(kind, 0) for kind, count in counters.items()}
        self._robust_seen = counters
        return {kind: count for kind, count in delta.items() if count}

    def _catch_up(self, round: int, donors: list[str], steps: int, reference: AnchorClaim, rewind: int = 0,
                  work_rms: float = 0.0) -> bool:
        """Replay ``steps`` outer steps fetched from ``donors`` (2 bytes/param each), after undoing
        our own last ``rewind`` (``OuterState.catch_up``)."""
        updates: list[AppliedUpdate] = []
        first = self.outer.rounds_done - rewind
        for rounds_done in range(first, first + steps):
            update = self.worker.backend.fetch_update(donors, rounds_done=rounds_done, numel=self.layout.numel,
                                                      timeout=self.config.download_timeout)
            if update is None:
                logger.warning(f"round {round}: no peer of {donors} could send outer step {rounds_done + 1}; "
                               "not caught up")
                return False
            updates.append(update)
        undone = f" after undoing our last {rewind}" if rewind else ""
        if not self.outer.catch_up(updates, reference, rewind=rewind, work_rms=work_rms):
            logger.warning(f"round {round}: replaying {steps} missed outer step(s){undone} did not reach the "
                           "group's anchor; not caught up")
            return False
        if steps:
            logger.info(f"round {round}: caught up with {steps} missed outer step(s){undone} from {donors}")
        return True

    def _resync(self, round: int, conclusion: RoundConclusion, averaged: torch.Tensor | None) -> bool:
        """Our anchor disagrees with the group's: take the state of a peer that agrees."""
        logger.warning(f"round {round}: our anchor diverged from the group's; re-syncing from {conclusion.donors}")
        adopted = None
        donors = list(conclusion.donors)
        step = averaged if conclusion.applied == Applied.AVERAGED else None
        check = self.outer.slice_check(conclusion.reference)
        for _ in range(RESYNC_ATTEMPTS):
            # Per attempt: the donors may have applied this round's step, and more while we retried.
            newest = max(round, self._download_horizon())
            state = self.worker.backend.download_state(donors, timeout=self.config.download_timeout,
                                                       same_state=self.outer.same_state, max_round=newest,
                                                       check=check)
            if state is None:
                continue
            try:
                adopted = self.outer.adopt(state, require_claim=True, max_round=max(round, self._now_round()),
                                           reference=conclusion.reference, step=step)
            except StateTooFarAhead as e:
                # On a slow link the donors stepped twice while we downloaded: retrying against this
                # round's reference only gets further (seen: 5 attempts holding the sync lane for a
                # minute, every round meanwhile skipped). The next group's check brings a fresh one.
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
        if adopted is not None and adopted < round and averaged is not None and conclusion.applied == Applied.AVERAGED:
            self.outer.apply(averaged, round=round)  # catch the donor's state up to this round
        return adopted is not None
