"""The round engine: when a round ends, what the sync worker does with it, and the merge.

One ``OuterLoop`` per peer, driven by the training loop with one ``after_step`` call per inner
step; the node and the library API both use it. The training loop never waits on the network
unless it must:

- **overlap** (default): rounds are wall-clock windows on the run's schedule. At the last step
  boundary before the deadline the loop snapshots its parameters (device→pinned host, async on
  CUDA) and calls ``begin_sync``; the worker thread computes the pseudo-gradient, runs the
  all-reduce and the outer step, and prepares matchmaking for the next round, while the loop
  keeps training. ``try_merge`` at a later step boundary adds the result in one fused pass
  (``averaging.merge``). The loop only stalls if a sync is still in flight when the *next*
  round ends.
- **blocking** (the OpenDiLoCo baseline): a fixed number of inner steps per round (fewer if the
  deadline comes first), then the loop waits, idle, for the all-reduce at the round's deadline:
  every peer waits for the slowest, and for the network.

Threads: ``after_step``/``begin_sync``/``try_merge`` run on the training thread; the sync job runs
on the worker's thread and is the only code that changes the anchor; the two meet through the
job's future (the training thread reads the anchor only while no job is in flight).

Time: every clock read and every wait goes through a ``Clock`` (the real one unless a test passes
a fake whose time moves only when the test says so; ``tests/unit/fake_clock.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import StrEnum
from typing import Protocol, TypeVar

import torch

from averaging.backend import DownloadedState, Progress
from averaging.diloco import Applied, OuterState, RoundConclusion
from averaging.flat import FlatLayout
from averaging.merge import apply_correction_, merge_correction
from averaging.outer import pseudo_gradient
from averaging.sync import SyncWorker
from averaging.traffic import round_payload
from averaging.wire import WireFormat, accounted_for
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
    bytes_sent: int = 0  # this round's all-reduce payload (``averaging.traffic.round_payload``); 0 if none ran
    bytes_received: int = 0


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


@dataclass(slots=True)
class _Job:
    window: _Window
    future: Future
    weight: float


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
                 clock: Clock = SYSTEM_CLOCK, wire: WireFormat | None = None, client_mode: bool = False):
        self.outer, self.worker, self.layout = outer, worker, layout
        # The payload's codec (error feedback: the residual lives in the live parameters, see
        # averaging.wire) and, for the byte counts, whether we reduce nothing (client mode).
        self.wire, self.client_mode = wire or WireFormat(), client_mode
        self._params, self._schedule, self.config = params, schedule, config
        self.peer_id, self._alone, self.device = peer_id, alone, device
        self.clock = clock  # read on both threads (see Clock)
        cuda = device.type == "cuda"
        # Host staging for the parameter snapshot: pinned so device→host copies are async.
        self._host_params = layout.new_buffer(pin_memory=cuda)
        self._pseudo_grad = layout.new_buffer()
        self._host_correction = layout.new_buffer(pin_memory=cuda)
        self._device_correction = torch.empty(layout.numel, device=device) if cuda else None
        self._timer = StepTimer()
        self._job: _Job | None = None
        self._carried_tokens = 0  # tokens of work folded from rounds that did not make it
        self._prepared_round = 0
        self.window: _Window | None = None
        self.last_download: DownloadedState | None = None  # the state adopted by initial_sync

    # -- lifecycle ---------------------------------------------------------------------------
    @property
    def round(self) -> int:
        return self.window.round if self.window else 0

    @property
    def syncing(self) -> bool:
        """A round's sync is in flight (the loop keeps training meanwhile in overlap mode)."""
        return self._job is not None

    def start(self) -> None:
        now = self.clock.now()
        self.window = _Window(max(1, self._schedule().round_at(now)), started=now)
        self._maybe_prepare(now)

    def initial_sync(self, donors: list[str], *, newer_than: int = -1, progress: Progress | None = None) -> int | None:
        """Adopt the shared state of a running swarm (blocking: before training starts), unless
        it is not newer than ``newer_than`` (a peer resumed from a checkpoint keeps its own).
        ``progress(done_bytes, total_bytes)`` is called on the worker thread."""
        state = self.clock.wait(self.worker.submit(self.worker.backend.download_state, donors,
                                                   timeout=self.config.download_timeout, progress=progress))
        if state is None:
            return None
        offered = state.metadata.get("round") if isinstance(state.metadata, dict) else None
        if isinstance(offered, int) and offered <= newer_than:
            logger.info(f"the swarm's state (round {offered}) is not newer than ours (round {newer_than}): kept ours")
            return None
        adopted = self.outer.adopt(state)  # MessageError if invalid: the caller reports it
        self.load_anchor_into_params()
        self.last_download = state
        return adopted

    def resume(self, state: DownloadedState) -> int:
        """Start from a saved shared state (a checkpoint): validated like a download."""
        adopted = self.outer.adopt(state)
        self.load_anchor_into_params()
        return adopted

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
        advance sits in hivemind's matchmaking where late peers of the previous round could find it."""
        round = self.window.round
        if self._prepared_round >= round:
            return
        if now >= self._schedule().round_end(round) - self.config.prepare_lead:
            self._prepared_round = round
            self.worker.submit(self._prepare, round)

    def _round_over(self) -> bool:
        if self.config.mode == SyncMode.BLOCKING and self.window.steps >= self.config.inner_steps:
            return True  # then wait, idle, for the all-reduce at the deadline: lockstep
        return not self._timer.fits_before(self._schedule().round_end(self.window.round), self.clock.now())

    def begin_sync(self) -> list[RoundStats]:
        """End the current round: snapshot, hand it to the worker, start the next window."""
        finished = self.try_merge(wait=True)  # the previous sync must land before a new snapshot
        window, now = self.window, self.clock.now()
        window.ended = now
        if self._prepared_round < window.round:  # blocking mode can finish its steps early
            self._prepared_round = window.round
            deadline = self._schedule().round_end(window.round)
            self.worker.submit(self._prepare, window.round, not_before=deadline - self.config.prepare_lead)
        event = self._snapshot_params()
        weight = float(window.tokens + self._carried_tokens)
        next_round = max(window.round + 1, self._schedule().round_at(now))
        future = self.worker.submit(self._sync_round, window.round, weight, event)
        self._job = _Job(window, future, weight)
        self.window = _Window(next_round, started=now)
        if self.config.mode == SyncMode.BLOCKING:
            finished += self.try_merge(wait=True)
            self.window.started = self.clock.now()  # the wait belongs to the round that ended
        return finished

    def try_merge(self, wait: bool = False) -> list[RoundStats]:
        """Merge a finished sync into the live parameters (a step boundary); never blocks unless ``wait``."""
        job = self._job
        if job is None or (not wait and not job.future.done()):
            return []
        already_done, waited_from = job.future.done(), self.clock.monotonic()
        result: _SyncResult = self.clock.wait(job.future)
        stall_s = 0.0 if already_done else self.clock.monotonic() - waited_from
        self._job = None
        self._merge(result.correction)
        # In blocking mode the round's own wait is part of the round; in overlap mode a stall
        # (a sync longer than a round) is charged to the window that had to wait.
        charged = job.window if self.config.mode == SyncMode.BLOCKING else self.window
        charged.wait_s += stall_s
        conclusion = result.conclusion
        contributed = conclusion.applied == Applied.AVERAGED
        self._carried_tokens = 0 if contributed or conclusion.applied == Applied.LOCAL else int(job.weight)
        window = job.window
        end = self.clock.now() if self.config.mode == SyncMode.BLOCKING else window.ended
        return [RoundStats(
            round=window.round, inner_steps=window.steps, tokens=window.tokens, compute_s=window.compute_s,
            wait_s=window.wait_s, sync_s=result.sync_s, allreduce_s=result.allreduce_s, wall_s=end - window.started,
            loss=window.loss_sum / window.steps if window.steps else None,
            group_size=conclusion.group_size, group=list(result.group), applied=conclusion.applied,
            error=conclusion.error, diverged=sorted(conclusion.verdict.diverged) if conclusion.verdict else [],
            bad_reports=conclusion.bad_reports, resynced=result.resynced, rounds_done=self.outer.rounds_done,
            bytes_sent=result.bytes_sent, bytes_received=result.bytes_received,
        )]

    @torch.no_grad()
    def _snapshot_params(self) -> torch.cuda.Event | None:
        """Copy the live parameters to the host buffer; on CUDA asynchronously, with an event
        the worker waits on (the copies are stream-ordered before the next step's kernels)."""
        params = self._params()
        for name, view in self.layout.views(self._host_params).items():
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
    def _prepare(self, round: int, not_before: float = 0.0) -> None:
        # Waiting here is free: in blocking mode the worker has nothing else to do until then.
        self.clock.sleep_until(not_before)
        deadline = self._schedule().round_end(round)
        self.worker.backend.prepare(round=round, scheduled_time=deadline,
                                    gather=self.outer.round_report(round=round).encode(),
                                    timeout=deadline - self.clock.now() + self.worker.matchmaking_grace)

    def _sync_round(self, round: int, weight: float, event: torch.cuda.Event | None) -> _SyncResult:
        # 1. The pseudo-gradient, once the snapshot has reached the host.
        if event is not None:
            event.synchronize()
        pseudo_grad = pseudo_gradient(self.outer.anchor, self._host_params, out=self._pseudo_grad)
        # 2. The all-reduce at the round's deadline, of what the codec can carry exactly (our own
        #    full pseudo-gradient stays as the fallback of a local round).
        started = self.clock.monotonic()
        sent = self.wire.to_send(pseudo_grad)
        averaged = sent.clone()
        timeout = max(0.0, self._schedule().round_end(round) - self.clock.now()) + self.worker.matchmaking_grace
        outcome = self.worker.backend.average(averaged, weight=weight, timeout=timeout + self.worker.allreduce_timeout)
        sync_s = self.clock.monotonic() - started
        # 3. Outer step, consistency check, re-sync if our anchor diverged.
        old_anchor = self.outer.anchor.clone()
        conclusion = self.outer.conclude(outcome, pseudo_grad, round=round, averaged=averaged if outcome.ok else None,
                                         self_id=self.peer_id, alone=self._alone())
        resynced = bool(conclusion.donors) and self._resync(round, conclusion, averaged if outcome.ok else None)
        # 4. What the new anchor accounts for: with error feedback only what was sent, so the
        #    residual stays in the parameters for the next round (averaging.wire).
        accounted = accounted_for(pseudo_grad, sent, averaged=conclusion.applied == Applied.AVERAGED,
                                  local=conclusion.applied == Applied.LOCAL, error_feedback=self.wire.error_feedback)
        correction = merge_correction(self.outer.anchor, old_anchor, accounted, out=self._host_correction,
                                      contributed=accounted is not None)
        sent_bytes, received_bytes = round_payload(
            self.layout.numel, len(outcome.group) if outcome.ok else 0, client_mode=self.client_mode,
            send_bytes_per_value=self.wire.send_bytes_per_value(),
            return_bytes_per_value=self.wire.return_bytes_per_value())
        return _SyncResult(conclusion, correction, sync_s, outcome.allreduce_s, outcome.group, resynced,
                           sent_bytes, received_bytes)

    def _resync(self, round: int, conclusion: RoundConclusion, averaged: torch.Tensor | None) -> bool:
        """Our anchor disagrees with the group's: take the state of a peer that agrees."""
        logger.warning(f"round {round}: our anchor diverged from the group's; re-syncing from {conclusion.donors}")
        adopted = None
        for _ in range(RESYNC_ATTEMPTS):
            state = self.worker.backend.download_state(conclusion.donors, timeout=self.config.download_timeout)
            if state is None:
                continue
            try:
                adopted = self.outer.adopt(state)
            except MessageError as e:
                logger.warning(f"round {round}: refused the state of {state.peer}: {e}")
                continue
            if adopted >= round:
                break
            self.clock.sleep(0.2)  # the donor has not applied this round's outer step yet
        if adopted is not None and adopted < round and averaged is not None and conclusion.applied == Applied.AVERAGED:
            self.outer.apply(averaged, round=round)  # catch the donor's state up to this round
        return adopted is not None
